"""`MegatronLMDummyScheduler` (what the user writes) and the Megatron-Core scheduler it becomes.

The run's schedule comes from the dummy scheduler (`total_num_steps`, `warmup_num_steps`) and the plugin's
Megatron-LM fields, with Megatron-LM's meaning (`megatron/training/training.py` get_optimizer_param_scheduler,
`arguments.py` validate_args): a schedule is counted either in iterations (`train_iters`, `lr_decay_iters`,
`lr_warmup_iters`) or in samples (`train_samples`, `lr_decay_samples`, `lr_warmup_samples`, divided by the
global batch), and the weight decay moves from `start_weight_decay` to `end_weight_decay` over the run.
Megatron-LM steps its scheduler by the global batch, in samples; ours steps once per optimizer step, so
sample counts become (possibly fractional) step counts, which gives the same learning rate at every step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from ..errors import MegatronPluginConfigError

ITER_FIELDS = ("train_iters", "lr_decay_iters", "lr_warmup_iters")
SAMPLE_FIELDS = ("train_samples", "lr_decay_samples", "lr_warmup_samples")
WD_INCR_STYLES = ("constant", "linear", "cosine")
TOTAL = "MegatronLMDummyScheduler.total_num_steps"
WARMUP = "MegatronLMDummyScheduler.warmup_num_steps"


class MegatronLMDummyScheduler:
    """Placeholder for Megatron's learning-rate scheduler: the real one is built at `prepare`, with
    linear warmup over `warmup_num_steps` and the plugin's `lr_decay_style` decay over
    `total_num_steps` down to the plugin's `min_lr`. The plugin's `train_iters`/`train_samples` and
    `lr_warmup_*`/`lr_decay_*` fields can give these instead (`total_num_steps=None`)."""

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


@dataclass(frozen=True)
class Schedule:
    """The run's schedule in optimizer steps (Megatron's sample counts over the global batch)."""

    train_steps: int
    warmup_steps: float
    decay_steps: float
    wd_incr_steps: float
    start_wd: Optional[float]  # None: each group's own weight decay, constant
    end_wd: Optional[float]
    wd_incr_style: str


def _whole(plugin, name, low):
    value = getattr(plugin, name, None)
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low):
        raise MegatronPluginConfigError(name, value, f"use a whole number >= {low}, or leave it unset (None)")
    return value


def _real(plugin, name, low=0.0, below=math.inf):
    value = getattr(plugin, name, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not math.isfinite(value) or not low <= value < below):
        bound = f"in [{low}, {below})" if below != math.inf else f">= {low}"
        raise MegatronPluginConfigError(name, value, f"use a finite number {bound}, or leave it unset (None)")
    return value


def check_schedule_fields(plugin) -> None:
    """The plugin's schedule and optimizer-group fields on their own (no batch size needed), with
    Megatron-LM's rules. Raises before any distributed work."""
    for name in ITER_FIELDS + SAMPLE_FIELDS:
        _whole(plugin, name, 0 if "warmup" in name else 1)
    # a warmup of 0 is Megatron-LM's default for both kinds, so it mixes with either
    iters = [n for n in ITER_FIELDS if getattr(plugin, n, None) not in (None, 0)]
    samples = [n for n in SAMPLE_FIELDS if getattr(plugin, n, None) not in (None, 0)]
    if iters and samples:
        raise MegatronPluginConfigError(
            f"{iters[0]} and {samples[0]}", f"{getattr(plugin, iters[0])}, {getattr(plugin, samples[0])}",
            "Megatron-LM counts a schedule in iterations (train_iters, lr_decay_iters, lr_warmup_iters) or in "
            "samples (train_samples, lr_decay_samples, lr_warmup_samples), not both: set the fields of one kind",
        )
    if _real(plugin, "lr_warmup_fraction", 0.0, 1.0) is not None:
        other = [n for n in ("lr_warmup_iters", "lr_warmup_samples") if getattr(plugin, n, None) not in (None, 0)]
        if other:
            raise MegatronPluginConfigError(
                f"lr_warmup_fraction and {other[0]}", f"{plugin.lr_warmup_fraction}, {getattr(plugin, other[0])}",
                "both give the warmup: set one of lr_warmup_fraction, lr_warmup_iters and lr_warmup_samples",
            )
    _real(plugin, "min_lr")
    style = getattr(plugin, "weight_decay_incr_style", "constant")
    if style not in WD_INCR_STYLES:
        raise MegatronPluginConfigError("weight_decay_incr_style", style, f"use one of {WD_INCR_STYLES}")
    start, end = _real(plugin, "start_weight_decay"), _real(plugin, "end_weight_decay")
    if style == "constant" and (start is not None or end is not None):
        name = "start_weight_decay" if start is not None else "end_weight_decay"
        raise MegatronPluginConfigError(
            name, getattr(plugin, name),
            "with weight_decay_incr_style='constant' the weight decay is the optimizer's (each param group's own): "
            "leave start_weight_decay/end_weight_decay unset, or set weight_decay_incr_style='linear' or 'cosine'",
        )
    if style != "constant":
        if start is None or end is None:
            name = "start_weight_decay" if start is None else "end_weight_decay"
            raise MegatronPluginConfigError(
                name, None, f"weight_decay_incr_style={style!r} moves the weight decay from start_weight_decay to "
                            "end_weight_decay: set both",
            )
        if end < start:  # megatron-core's OptimizerParamScheduler asserts it
            raise MegatronPluginConfigError(
                "end_weight_decay", end, f"Megatron-Core's scheduler only increases the weight decay: use an "
                                         f"end_weight_decay >= start_weight_decay ({start})",
            )
    _real(plugin, "lr_mult")
    for name in ("scale_lr_cond", "no_wd_decay_cond"):
        cond = getattr(plugin, name, None)
        if cond is not None and not callable(cond):
            raise MegatronPluginConfigError(name, cond, f"pass a function {name}(name, param) -> bool, or None")


def _counts_samples(plugin) -> bool:
    return any(getattr(plugin, n, None) not in (None, 0) for n in SAMPLE_FIELDS)


def _steps(samples: int, global_batch: int) -> float:
    """Megatron's sample count as optimizer steps (an integer when it divides)."""
    whole, rest = divmod(samples, global_batch)
    return whole if rest == 0 else samples / global_batch


def resolve_schedule(plugin, dummy: Optional[MegatronLMDummyScheduler],
                     global_batch_size: Optional[int] = None) -> Schedule:
    """The run's schedule from the dummy scheduler and the plugin, as Megatron-LM derives it. Sample-based
    fields need the global batch: without it (before the batch is known) they are checked as far as
    they can be. Raises MegatronPluginConfigError naming the fields that disagree."""
    check_schedule_fields(plugin)
    g = global_batch_size
    if g is not None and (not isinstance(g, numbers.Integral) or g < 1):
        g = None
    total = dummy.total_num_steps if dummy is not None else None
    if total is not None and not (isinstance(total, numbers.Integral) and not isinstance(total, bool) and total >= 0):
        raise MegatronPluginConfigError(TOTAL, total, "pass the number of optimizer steps of the run, a whole number")
    total = total or None  # 0 or None: the plugin's train_iters/train_samples say it
    warmup_given = dummy.warmup_num_steps if dummy is not None else 0
    if not (isinstance(warmup_given, numbers.Real) and not isinstance(warmup_given, bool) and warmup_given >= 0):
        raise MegatronPluginConfigError(WARMUP, warmup_given, "warmup must be a number of steps >= 0")
    by_samples = _counts_samples(plugin)

    # the run's steps
    train = plugin.train_iters
    if plugin.train_samples is not None and g is not None:
        train = plugin.train_samples // g  # Megatron-LM's update_train_iters
        if train < 1:
            raise MegatronPluginConfigError(
                "train_samples", plugin.train_samples,
                f"fewer samples than one global batch ({g}): the run would have no step; raise train_samples",
            )
    given = "train_iters" if plugin.train_iters is not None else "train_samples"
    if total is not None and train is not None and total != train:
        detail = "" if given == "train_iters" else f" (= {train} steps of the global batch {g})"
        raise MegatronPluginConfigError(
            f"{TOTAL} and {given}", f"{total}, {getattr(plugin, given)}",
            f"the run has {total} steps by the scheduler but {train} by {given}{detail}: pass one of them (e.g. "
            f"MegatronLMDummyScheduler(optimizer, total_num_steps=None) to take {given}'s), or make them agree",
        )
    train = total or train
    if train is None and plugin.train_samples is None:
        raise MegatronPluginConfigError(
            TOTAL, dummy.total_num_steps if dummy is not None else None,
            "pass the number of optimizer steps of the run (e.g. args.max_train_steps), or set the plugin's "
            "train_iters (or train_samples)",
        )
    if g is None and by_samples:
        # checked again once the global batch is known (resolve), before the scheduler is built
        return Schedule(train or 1, 0, 1, 1, None, None, "constant")

    # decay and warmup, in steps
    if by_samples:
        decay_samples = plugin.lr_decay_samples or plugin.train_samples
        decay = _steps(decay_samples, g) if decay_samples is not None else train
        wd_incr = _steps(plugin.train_samples, g) if plugin.train_samples is not None else train
    else:
        decay = plugin.lr_decay_iters or train
        wd_incr = train
    warmup, source = None, None
    if plugin.lr_warmup_fraction is not None:
        warmup, source = plugin.lr_warmup_fraction * decay, "lr_warmup_fraction"
    elif plugin.lr_warmup_iters is not None:
        warmup, source = plugin.lr_warmup_iters, "lr_warmup_iters"
    elif plugin.lr_warmup_samples is not None:
        warmup = _steps(plugin.lr_warmup_samples, g) if plugin.lr_warmup_samples else 0
        source = "lr_warmup_samples"
    if warmup is not None and warmup_given and warmup != warmup_given:
        raise MegatronPluginConfigError(
            f"{WARMUP} and {source}", f"{warmup_given}, {getattr(plugin, source)}",
            f"the warmup is {warmup_given} steps by the scheduler but {warmup:g} by {source}: set one of them "
            "(the scheduler's warmup_num_steps=0 leaves it to the plugin), or make them agree",
        )
    if warmup is None:
        warmup, source = warmup_given, WARMUP
    if not warmup < decay:  # megatron-core's OptimizerParamScheduler asserts it
        raise MegatronPluginConfigError(
            source, getattr(plugin, source) if source != WARMUP else warmup_given,
            f"warmup ({warmup:g} steps) must be shorter than the {decay:g} decay steps (total_num_steps, train_iters/"
            "train_samples or lr_decay_iters/lr_decay_samples)",
        )
    incr = getattr(plugin, "weight_decay_incr_style", "constant")
    return Schedule(int(train), warmup, decay, wd_incr, getattr(plugin, "start_weight_decay", None),
                    getattr(plugin, "end_weight_decay", None), incr)


def check_scheduler(scheduler, plugin=None, global_batch_size: Optional[int] = None) -> None:
    """Refuse a scheduler we cannot build, and the plugin's schedule fields that do not agree with it,
    before any distributed work. The global batch defaults to the resolved plugin's `global_batch_size`
    (absent on the user's plugin: sample counts are then checked once it is known)."""
    if scheduler is not None and not isinstance(scheduler, MegatronLMDummyScheduler):
        raise MegatronPluginConfigError(
            "lr_scheduler", type(scheduler).__name__,
            "You can't use a custom scheduler with Megatron-LM. Please use "
            "`megatron_plugin.MegatronLMDummyScheduler(optimizer, total_num_steps, warmup_num_steps)` instead.",
        )
    if plugin is None:
        if scheduler is not None and not scheduler.total_num_steps:
            raise MegatronPluginConfigError(TOTAL, scheduler.total_num_steps,
                                            "pass the number of optimizer steps of the run (e.g. args.max_train_steps)")
        return
    if scheduler is None:
        check_schedule_fields(plugin)
        return
    if global_batch_size is None:
        global_batch_size = getattr(plugin, "global_batch_size", None)
    resolve_schedule(plugin, scheduler, global_batch_size)


def build_scheduler(dummy: MegatronLMDummyScheduler, optimizer, plugin,
                    global_batch_size: Optional[int] = None) -> OptimizerParamScheduler:
    """Megatron-Core's scheduler over `optimizer`'s param groups. Each group keeps its own peak learning
    rate (`max_lr` where the optimizer's builder set one, e.g. scale_lr_cond's groups, else its `lr`) and
    weight decay; `lr_mult` scales its min_lr too. With a weight-decay schedule, every group that decays
    follows it and the others stay at 0."""
    if global_batch_size is None:
        global_batch_size = getattr(plugin, "global_batch_size", None)
    if _counts_samples(plugin) and global_batch_size is None:
        name = next(n for n in SAMPLE_FIELDS if getattr(plugin, n, None) not in (None, 0))
        raise MegatronPluginConfigError(
            name, getattr(plugin, name),
            "sample counts need the global batch size: build the scheduler through accelerator.prepare",
        )
    s = resolve_schedule(plugin, dummy, global_batch_size)
    scheduled = s.start_wd is not None
    for g in optimizer.param_groups:
        # Megatron sets every group's lr and weight decay each step; keep each group's own values.
        g["max_lr"] = g.get("max_lr", g["lr"])
        g["min_lr"] = min(plugin.min_lr * g.get("lr_mult", 1.0), g["max_lr"])
        own = g.get("weight_decay", 0.0)
        g["start_wd"], g["end_wd"] = ((s.start_wd, s.end_wd) if own > 0 else (0.0, 0.0)) if scheduled else (own, own)
    max_lr = max((g["max_lr"] for g in optimizer.param_groups), default=0.0)
    wd = max((g.get("weight_decay", 0.0) for g in optimizer.param_groups), default=0.0)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=max_lr,
        min_lr=min(plugin.min_lr, max_lr),
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=s.decay_steps,
        lr_decay_style=plugin.lr_decay_style,
        start_wd=s.start_wd if scheduled else wd,
        end_wd=s.end_wd if scheduled else wd,
        wd_incr_steps=s.wd_incr_steps,
        wd_incr_style=s.wd_incr_style,
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
        # mcore's scheduler adds the saved step count to its own: start from 0 so a load mid-run lands on
        # the saved learning rate
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state_dict)
