"""`MegatronLMDummyScheduler` (what the user writes) and the Megatron-Core scheduler it becomes."""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ..errors import MegatronPluginConfigError


class MegatronLMDummyScheduler:
    """Placeholder for Megatron's learning-rate scheduler: the real one is built at `prepare`, with
    linear warmup over `warmup_num_steps` and the plugin's `lr_decay_style` decay over
    `total_num_steps` down to the plugin's `min_lr`."""

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


def check_scheduler(scheduler, plugin=None) -> None:
    if scheduler is not None and not isinstance(scheduler, MegatronLMDummyScheduler):
        raise MegatronPluginConfigError(
            "lr_scheduler", type(scheduler).__name__,
            "You can't use a custom scheduler with Megatron-LM. Please use "
            "`megatron_plugin.MegatronLMDummyScheduler(optimizer, total_num_steps, warmup_num_steps)` instead.",
        )
    if scheduler is not None and not scheduler.total_num_steps:
        raise MegatronPluginConfigError(
            "MegatronLMDummyScheduler.total_num_steps", scheduler.total_num_steps,
            "pass the number of optimizer steps of the run (e.g. args.max_train_steps)",
        )
    if scheduler is not None and plugin is not None:
        decay_steps = plugin.lr_decay_iters or scheduler.total_num_steps
        if not 0 <= scheduler.warmup_num_steps < decay_steps:
            raise MegatronPluginConfigError(
                "warmup_num_steps", scheduler.warmup_num_steps,
                f"warmup must be >= 0 and shorter than the {decay_steps} decay steps (total_num_steps or lr_decay_iters)",
            )


def build_scheduler(dummy: MegatronLMDummyScheduler, optimizer, plugin) -> OptimizerParamScheduler:
    check_scheduler(dummy, plugin)
    max_lr = max(g["lr"] for g in optimizer.param_groups)
    decay_steps = plugin.lr_decay_iters or dummy.total_num_steps
    for g in optimizer.param_groups:
        # Megatron sets every group's lr and weight decay each step; keep each group's own values.
        g["max_lr"] = g["lr"]
        g["min_lr"] = min(plugin.min_lr, g["lr"])
        g["start_wd"] = g["end_wd"] = g.get("weight_decay", 0.0)
    wd = max(g.get("weight_decay", 0.0) for g in optimizer.param_groups)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=max_lr,
        min_lr=min(plugin.min_lr, max_lr),
        lr_warmup_steps=dummy.warmup_num_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=plugin.lr_decay_style,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


class MegatronLMSchedulerWrapper:
    """What `accelerate.prepare` returns for the scheduler: the engine steps it after each successful
    optimizer step, so `step` here does nothing."""

    def __init__(self, scheduler: OptimizerParamScheduler, optimizer):
        self.scheduler = scheduler
        self.optimizer = optimizer

    def step(self, *args, **kwargs):
        pass

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)
