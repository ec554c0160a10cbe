"""`Trainer`: transformers' Trainer whose steps run on Megatron-Core parallelism (`megatron_plugin.Accelerator`).

Trainer's own loop stays (callbacks, progress bar, logging, evaluation and save schedules, checkpoint rotation);
what differs lives on `MegatronTrainerMixin`, which TRL's trainers reuse (`integrations/trl.py`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import re

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader

from ..accelerator import _ENV_FLAG, Accelerator
from ..engine.data import check_dataloader, prepare_megatron_dataloader
from ..engine.scheduler import MegatronLMDummyScheduler
from ..errors import MegatronPluginConfigError
from ..plugin import MegatronLMPlugin

# lr_scheduler_type -> Megatron's lr_decay_style; "constant" has no warmup in HF (get_constant_schedule)
HF_DECAY_STYLES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
SAMPLING = ("random", "sequential")
MEGATRON_FOLDER = "megatron"  # inside checkpoint-N: the run's state as accelerator.save_state writes it
_logger = transformers.utils.logging.get_logger(__name__)


def _value(args, name):
    value = getattr(args, name, None)
    return getattr(value, "value", value)  # the Enum fields' strings


def check_training_arguments(args) -> None:
    """Refuse, by name and before any Megatron process group, what changes training and the Megatron run cannot
    honour."""
    if args is None:
        return
    refusals = [
        # fp16 from the accelerate config (ACCELERATE_MIXED_PRECISION, args.mixed_precision) is Megatron's, with
        # its loss scaler; TrainingArguments' own fp16 flag would be HF's amp, which the engine never runs
        ("fp16", bool(args.fp16), "Megatron's mixed precision comes from the accelerate config (mixed_precision: "
                                  "bf16 or fp16 there), or bf16=True: leave fp16 False"),
        ("fp16_full_eval", bool(args.fp16_full_eval), "evaluation runs in the training precision: leave it False"),
        ("bf16_full_eval", bool(args.bf16_full_eval), "evaluation runs in the training precision: leave it False"),
        ("torch_compile", bool(args.torch_compile),
         "compile the Megatron layers instead: MegatronLMPlugin(torch_compile=True) (megatron_lm_torch_compile in "
         "the accelerate config), and leave torch_compile False"),
        ("deepspeed", args.deepspeed, "DeepSpeed and Megatron are two parallelisms: drop deepspeed"),
        ("fsdp", args.fsdp, "FSDP and Megatron are two parallelisms: drop fsdp"),
        ("parallelism_config", args.parallelism_config,
         "the accelerate config's Megatron settings lay out the parallelism: drop parallelism_config"),
        ("neftune_noise_alpha", args.neftune_noise_alpha, "NEFTune's embedding noise is not applied: leave it None"),
        ("label_smoothing_factor", args.label_smoothing_factor,
         "the Megatron loss has no label smoothing: leave it 0.0"),
        ("use_liger_kernel", bool(args.use_liger_kernel), "Liger's kernels replace HF modules Megatron never runs: "
                                                           "leave it False"),
        ("auto_find_batch_size", bool(args.auto_find_batch_size),
         "the micro-batch is laid out at prepare: set per_device_train_batch_size yourself"),
        ("load_best_model_at_end", bool(args.load_best_model_at_end),
         "checkpoints hold the Megatron state, not HF weights to reload: load the best checkpoint-N with "
         "resume_from_checkpoint, or leave it False"),
        ("lr_scheduler_kwargs", args.lr_scheduler_kwargs or None,
         "Megatron's schedules take no extra arguments: leave lr_scheduler_kwargs empty"),
        ("enable_jit_checkpoint", bool(getattr(args, "enable_jit_checkpoint", False)),
         "each rank's SIGTERM timer would start the collective Megatron save at a different step: leave it False "
         "and save with save_steps"),
        ("optim_args", args.optim_args, "leave optim_args unset: the optimizer takes learning_rate, weight_decay, "
                                        "adam_beta1/2 and adam_epsilon"),
    ]
    for name, value, fix in refusals:
        if value not in (None, False, 0, 0.0, "", [], {}):
            raise MegatronPluginConfigError(name, value, fix)
    _check_accelerator_config(args)
    if args.use_cpu and torch.cuda.is_available():
        raise MegatronPluginConfigError(
            "use_cpu", True,
            "the Megatron run takes the GPUs whenever CUDA is available: hide them to train on CPU "
            "(CUDA_VISIBLE_DEVICES= accelerate launch ...), or leave use_cpu False",
        )
    if _value(args, "lr_scheduler_type") not in HF_DECAY_STYLES:
        raise MegatronPluginConfigError("lr_scheduler_type", _value(args, "lr_scheduler_type"),
                                        f"Megatron's schedules give HF's {sorted(HF_DECAY_STYLES)}: use one of those")
    if _value(args, "optim") not in OPTIMIZERS:
        raise MegatronPluginConfigError("optim", _value(args, "optim"),
                                        f"Megatron runs take torch's AdamW or SGD: use one of {OPTIMIZERS}")
    if _value(args, "train_sampling_strategy") not in SAMPLING:
        raise MegatronPluginConfigError("train_sampling_strategy", _value(args, "train_sampling_strategy"),
                                        f"batches are cut from one sampler per step: use one of {SAMPLING}")
    if args.data_seed is not None and args.data_seed != args.seed:
        raise MegatronPluginConfigError("data_seed", args.data_seed,
                                        f"the Megatron loaders shuffle with seed ({args.seed}): leave data_seed unset")


# what a Megatron run honours of Trainer's AcceleratorConfig: its defaults only (the engine lays out and shards
# the batches, and accumulates gradients over its micro-batches); non_blocking only overlaps host copies, and
# use_configured_state (reuse an accelerate state made before; TrainingArguments pops it at device setup) changes
# no number
_ACCELERATOR_CONFIG_FREE = ("non_blocking", "use_configured_state")


def _check_accelerator_config(args) -> None:
    from transformers.trainer_pt_utils import AcceleratorConfig

    config = getattr(args, "accelerator_config", None)
    if config is None:
        return
    if isinstance(config, dict):
        config = AcceleratorConfig(**config)
    for field in dataclasses.fields(AcceleratorConfig):
        default = field.default if field.default is not dataclasses.MISSING else None
        value = getattr(config, field.name, default)
        if field.name not in _ACCELERATOR_CONFIG_FREE and value not in (default, {} if default is None else default):
            raise MegatronPluginConfigError(
                f"accelerator_config.{field.name}", value,
                "the Megatron engine lays out, shards and accumulates the batches itself (gradient_accumulation_steps "
                f"gives its micro-batches): leave {field.name} at its default ({default!r})",
            )


# the plugin fields the TrainingArguments decide, with a plugin's values when not set (after its __post_init__):
# another value of the user's plugin would be overwritten silently, so it is refused
_PLUGIN_DEFAULTS = {"gradient_clipping": 1.0, "lr_decay_style": "linear", "min_lr": 0.0,
                    "calculate_per_token_loss": False}


def _refuse_conflicts(plugin, mapped: dict) -> None:
    for name, value in mapped.items():
        given = getattr(plugin, name)
        if given is not None and given != _PLUGIN_DEFAULTS[name] and given != value:
            raise MegatronPluginConfigError(
                name, given,
                f"the TrainingArguments give it ({value!r}; {_MAPPED_FROM[name]}): set it there and leave the "
                "plugin's at its default",
            )


_MAPPED_FROM = {
    "gradient_clipping": "from max_grad_norm", "lr_decay_style": "from lr_scheduler_type",
    "min_lr": "HF's schedules decay to 0", "calculate_per_token_loss": "HF's loss is the token mean of the "
                                                                      "global batch",
}


def megatron_plugin_for(args, plugin=None) -> MegatronLMPlugin:
    """The run's plugin: the given one, else the accelerate launch config's (`MEGATRON_LM_*` environment), with
    the fields TrainingArguments decide written in. Raises when no Megatron config is there."""
    if plugin is None:
        if os.environ.get(_ENV_FLAG, "false").lower() != "true":
            raise MegatronPluginConfigError(
                "accelerate config", "no Megatron-LM settings",
                "launch with `accelerate launch --config_file <a config with distributed_type: MEGATRON_LM>`, or pass "
                "Trainer(..., megatron_lm_plugin=MegatronLMPlugin(tp_degree=...)); without Megatron use "
                "transformers.Trainer",
            )
        plugin = MegatronLMPlugin()
    else:
        plugin = copy.copy(plugin)
    micro = args.gradient_accumulation_steps
    if plugin.num_micro_batches not in (1, micro):
        raise MegatronPluginConfigError(
            "gradient_accumulation_steps and megatron_lm_num_micro_batches", f"{micro}, {plugin.num_micro_batches}",
            "both give the micro-batches of a step: set gradient_accumulation_steps and leave num_micro_batches at 1",
        )
    plugin.num_micro_batches = micro
    mapped = {
        # HF clips only when max_grad_norm > 0; the plugin's 0 means no clipping
        "gradient_clipping": float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else 0.0,
        "lr_decay_style": HF_DECAY_STYLES[_value(args, "lr_scheduler_type")],
        "min_lr": 0.0,
        # HF divides the summed token losses by the step's token count over the global batch (num_items_in_batch)
        "calculate_per_token_loss": True,
    }
    _refuse_conflicts(plugin, mapped)
    for name, value in mapped.items():
        setattr(plugin, name, value)
    plugin.seed = args.seed
    if not getattr(args, "average_tokens_across_devices", True) and _dp_size(plugin) > 1:
        raise MegatronPluginConfigError(
            "average_tokens_across_devices", False,
            "the Megatron step divides by the token count of the whole global batch (each data-parallel rank's own "
            "count would weigh ranks differently): leave average_tokens_across_devices True",
        )
    # transformers 5 names it activation_checkpointing (gradient_checkpointing mirrors it)
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        _map_gradient_checkpointing(plugin)
    return plugin


def _map_gradient_checkpointing(plugin) -> None:
    """HF's gradient checkpointing (TRL's configs switch it on) is Megatron's full recompute of every layer, one
    at a time; a recompute setting of the user's plugin wins. Recompute replays the same forward (megatron-core
    restores the RNG state for dropout), so HF's activation_checkpointing_kwargs (which layers, reentrant or not)
    trade memory for compute only and are not read. The CPU engine has no recompute: there it is left off, which
    costs memory and changes no number."""
    if plugin.recompute_granularity is not None:
        return
    if not torch.cuda.is_available():
        _logger.warning_once(
            "gradient_checkpointing=True: the CPU Megatron engine does not recompute activations; training is the "
            "same, it only keeps every layer's activations in memory"
        )
        return
    plugin.recompute_granularity = "full"
    plugin.recompute_method = "uniform"
    plugin.recompute_num_layers = 1


@contextlib.contextmanager
def _accelerator_method(accelerator, name, replacement):
    """`accelerator.<name>` is `replacement` inside the block (an instance attribute over the class's method), for
    Trainer code that calls accelerate where the Megatron run needs something else."""
    setattr(accelerator, name, replacement)
    try:
        yield
    finally:
        delattr(accelerator, name)


class _TrainerAccelerator(Accelerator):
    """Trainer reads `optimizer_step_was_skipped` after every step only to decide whether to call its scheduler's
    step, which here is an adapter that does nothing (the engine steps Megatron's scheduler itself, and leaves it
    where it is when it skips the step). Reading the engine's flag would wait for the GPU each step for nothing."""

    @property
    def optimizer_step_was_skipped(self):
        return False


RANK_LOSS = "megatron_plugin/rank loss"


@contextlib.contextmanager
def _logging_rank_loss(engine):
    """Inside the block, a per-token loss function (loss sum, token count, logs) also logs this data-parallel
    rank's own [loss sum, token count] under RANK_LOSS (its sequences' context-parallel parts added up): the
    engine's loss is the token mean over every data-parallel rank's batch, HF's evaluation loop takes each
    process's own. The train step's forward_step is replaced on the instance, which both engines call."""
    from megatron.core import parallel_state

    step = engine.train_step_handler
    own = vars(step).get("forward_step")
    inner = step.forward_step

    def forward_step(data_iterator, model):
        output, loss_func = inner(data_iterator, model)

        def with_rank_loss(output_tensor):
            result = loss_func(output_tensor)
            if isinstance(result, tuple) and len(result) == 3 and isinstance(result[2], dict):
                pair = torch.stack([result[0].detach().float(), result[1].detach().float()])
                if parallel_state.get_context_parallel_world_size() > 1:
                    dist.all_reduce(pair, group=parallel_state.get_context_parallel_group())
                result = (result[0], result[1], {**result[2], RANK_LOSS: pair})
            return result

        return output, with_rank_loss

    step.forward_step = forward_step
    try:
        yield
    finally:
        if own is None:
            del step.forward_step
        else:
            step.forward_step = own


class _StepBatches:
    """The indices of each data-parallel rank's batches for one epoch, in place of the `BatchSampler` inside
    accelerate's `BatchSamplerShard` (which gives batch i to rank i % dp): whole steps of micro x num_micro rows
    per rank, then, as HF's Trainer does at the end of an epoch, a last step of the whole micro-batches that are
    left (each rank the same number), which a dropping BatchSampler would lose."""

    drop_last = True  # the shard then never cycles back to the epoch's first rows

    def __init__(self, sampler, micro: int, num_micro: int, dp: int):
        self.sampler, self.micro, self.num_micro, self.dp = sampler, micro, num_micro, dp
        self.batch_size = micro * num_micro

    def _layout(self, n: int):
        """(whole steps, micro-batches per rank in the last partial step)."""
        steps = n // (self.batch_size * self.dp)
        return steps, (n - steps * self.batch_size * self.dp) // (self.micro * self.dp)

    def __iter__(self):
        indices = list(self.sampler)
        steps, left = self._layout(len(indices))
        for i in range(steps * self.dp):
            yield indices[i * self.batch_size:(i + 1) * self.batch_size]
        start, rows = steps * self.batch_size * self.dp, left * self.micro
        for rank in range(self.dp if left else 0):
            yield indices[start + rank * rows:start + (rank + 1) * rows]

    def __len__(self):
        steps, left = self._layout(len(self.sampler))
        return (steps + (1 if left else 0)) * self.dp


def _with_partial_last_step(loader, num_micro: int):
    """The prepared train loader, its epoch ending on a partial step where HF's would (drop_last: the micro-batches
    that fill no whole step; without it, the sizes were checked to fill whole steps)."""
    from accelerate.data_loader import BatchSamplerShard

    shard = getattr(loader, "batch_sampler", None)
    if (num_micro == 1 or not isinstance(shard, BatchSamplerShard) or shard.split_batches or not shard.drop_last
            or shard.batch_size is None or shard.batch_size % num_micro):
        return loader
    shard.batch_sampler = _StepBatches(shard.batch_sampler.sampler, shard.batch_size // num_micro, num_micro,
                                       shard.num_processes)
    shard.batch_size = None  # the shard then yields each round of batches, the shorter last one too
    return loader


class _PendingLoader:
    """The train DataLoader before prepare, sized as the prepared one will be (micro x num_micro rows per
    data-parallel rank a batch): Trainer counts its steps from this length before the engine exists."""

    def __init__(self, loader: DataLoader, length: int):
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self._length = length

    def __len__(self):
        if self._length is None:  # Trainer's has_length reads a TypeError as "no length": max_steps decides
            raise TypeError("the train dataset has no length")
        return self._length


def _interleaved_eval_refusal(value, n: int, alternative: str = "") -> MegatronPluginConfigError:
    return MegatronPluginConfigError(
        "per_device_eval_batch_size", value,
        f"the interleaved pipeline schedule (num_layers_per_virtual_pipeline_stage) runs an eval batch as {n} "
        f"micro-batches: give eval batches (and an eval set) of a multiple of {n} rows{alternative}")


def _interleaved(plugin) -> bool:
    """megatron-core's interleaved schedule (virtual pipeline stages) takes only multiples of the pipeline size
    as micro-batch counts."""
    return plugin.pp_degree > 1 and plugin.num_layers_per_virtual_pipeline_stage is not None


def _dp_size(plugin) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(world // (plugin.tp_degree * plugin.pp_degree * plugin.context_parallel_size), 1)


def _gather_tree(value, group):
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_tree(v, group) for v in value)
    if isinstance(value, dict):
        return type(value)({k: _gather_tree(v, group) for k, v in value.items()})
    if not torch.is_tensor(value):
        return value
    value = value.contiguous()
    if value.dim() == 0:
        value = value[None]
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value, group=group)
    return torch.cat(parts)


class MegatronTrainerMixin:
    """What makes a `transformers.Trainer` (or a TRL trainer built on it) run on Megatron-Core.

    Put it first in the bases: `class MyTrainer(MegatronTrainerMixin, transformers.Trainer)`. The constructor
    takes Trainer's arguments plus `megatron_lm_plugin=` (default: the accelerate launch config's).

    The mapping. `gradient_accumulation_steps` becomes the plugin's `num_micro_batches` and Trainer itself counts
    one batch per optimizer step (its copy of the arguments has `gradient_accumulation_steps=1`): every train
    batch holds per_device_train_batch_size x num_micro rows per data-parallel rank, and one engine call
    (`model(**batch)`) runs forward, backward, clipping (`max_grad_norm`), the optimizer and the scheduler.
    The optimizer is Trainer's (`create_optimizer`: AdamW with the decay / no-decay groups of
    `get_decay_parameter_names`, betas, eps); the scheduler is Megatron's with HF's curve
    (`lr_scheduler_type` -> lr_decay_style, `get_warmup_steps`); `seed` -> the plugin's seed; `bf16` -> mixed
    precision. Losses are token means over the global batch (calculate_per_token_loss), as HF's loss with
    num_items_in_batch. `check_training_arguments` refuses the rest by name, before any Megatron process group;
    without args, the TrainingArguments Trainer (or TRL) makes are mapped and checked the same way, in
    `create_accelerator_and_postprocess`. The plugin given is copied, never written; a value of it that the
    arguments decide (`_PLUGIN_DEFAULTS`, num_micro_batches, a subclass's train step) and that differs is refused.
    So are compute_loss_func and a subclass's own compute_loss: the engine's step computes the loss.

    Trainer methods overridden here: `create_accelerator_and_postprocess` (our Accelerator), `_get_dataloader` /
    `get_train_dataloader` (loaders made here, prepared with the engine: data-parallel ranks only; the train
    loader is sized as prepared before the engine exists, so Trainer counts the right steps),
    `get_total_train_batch_size`, `gather_function` (over data-parallel ranks), `_track_num_input_tokens`,
    `create_scheduler`, `_prepare_for_training` (one `accelerator.prepare(model, optimizer, train loader,
    scheduler)`), `_move_model_to_device` (nothing: prepare places the model), `_wrap_model` (the engine),
    `training_step` (an epoch's last step with the micro-batches left, `_with_partial_last_step`), `compute_loss`,
    `prediction_step` (one engine call per eval batch, this rank's own loss: `_logging_rank_loss`),
    `_get_learning_rate` (the lr the step used), `train` (resume_from_checkpoint=True takes the newest complete
    checkpoint; a warning at the end says trainer.model keeps the initial weights),
    `save_model`, `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler` (accelerator.save_state /
    load_state in checkpoint-N/megatron), `_load_from_checkpoint`, `_save_scaler` / `_load_scaler` (nothing to
    do). Trainer's optimizer.step, lr_scheduler.step and zero_grad reach adapters that do nothing: the engine did
    them.

    Hooks a subclass (TRL's trainers) fills:
    - `megatron_train_step()` -> (train step class or None, its kwargs): written into the plugin's
      custom_train_step_class / custom_train_step_kwargs before prepare; None keeps the family's step
      (the GPT step for causal LMs: labels, -100 ignored).
    - `megatron_batch(inputs, training)` -> the dict of tensors given to `model(**batch)`: what the train step
      takes (default: the tensors of Trainer's batch as they are).
    - `megatron_rows(inputs)` -> how many samples Trainer's batch holds (default: the rows of its first tensor;
      DPO: pairs), from which an epoch's shorter last step gets its micro-batch count.
    - `megatron_record(output, training)`: called after each engine call with its output (`.loss`,
      `.metrics` where the step's output class has them, or the loss tensor); `self.megatron_engine.metrics`
      holds the step's logs. Default: nothing (the loss is logged by Trainer).

    What a subclass may also use: `self.megatron_engine` (None until built), `self._megatron_plugin` (the run's
    plugin, written before prepare: set fields in `create_accelerator_and_postprocess` after super(); e.g.
    calculate_per_token_loss=False for a step whose loss function returns (loss, logs)),
    `self._megatron_build(...)` (extend it to act right after prepare, e.g. take a weight snapshot),; the engine's
    `.metrics` and loss are the same on every pipeline stage.
    """

    def __init__(self, *args, megatron_lm_plugin=None, **kwargs):
        given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        _refuse_custom_loss(type(self), given.get("compute_loss_func"))
        self._megatron_given_plugin = megatron_lm_plugin
        self._megatron_plugin = None
        training_args = given.get("args")
        if training_args is not None:
            training_args = self._megatron_arguments(training_args)
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (args[0], training_args, *args[2:])
        # else Trainer (or TRL's trainer) makes its default arguments: mapped in create_accelerator_and_postprocess
        self.megatron_engine = None
        self._megatron_train_loader = None
        self._megatron_lr = None
        super().__init__(*args, **kwargs)

    def _megatron_arguments(self, training_args):
        """The run's plugin from the arguments (checked first), and the arguments Trainer's loop is given: one batch
        (of every micro-batch) per optimizer step."""
        check_training_arguments(training_args)
        self._megatron_plugin = megatron_plugin_for(training_args, self._megatron_given_plugin)
        training_args = copy.copy(training_args)
        training_args.gradient_accumulation_steps = 1
        return training_args

    # -- hooks ----------------------------------------------------------------------------------------
    def megatron_train_step(self):
        return None, {}

    def megatron_batch(self, inputs, training: bool):
        return {k: v for k, v in inputs.items() if torch.is_tensor(v)}

    def megatron_rows(self, inputs) -> int:
        return next(v.shape[0] for v in inputs.values() if torch.is_tensor(v) and v.dim() > 0)

    def megatron_record(self, output, training: bool):
        pass

    # -- accelerator ----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        if self._megatron_plugin is None:  # args=None: the TrainingArguments Trainer (or TRL) made for it
            self.args = self._megatron_arguments(self.args)
        plugin = self._megatron_plugin
        step_class, step_kwargs = self.megatron_train_step()
        if step_class is not None:
            if plugin.custom_train_step_class not in (None, step_class):
                raise MegatronPluginConfigError(
                    "custom_train_step_class", plugin.custom_train_step_class.__name__,
                    f"{type(self).__name__} trains with its own step ({step_class.__name__}): leave the plugin's "
                    "custom_train_step_class unset, or use megatron_plugin.integrations.Trainer for your own step",
                )
            plugin.custom_train_step_class = step_class
            plugin.custom_train_step_kwargs = dict(step_kwargs or {})
        self.accelerator = _TrainerAccelerator(mixed_precision=self.args.mixed_precision, megatron_lm_plugin=plugin)
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    @property
    def gather_function(self):
        return self._gather_over_data_parallel

    @gather_function.setter
    def gather_function(self, value):
        # Trainer sets accelerate's gather_for_metrics (over every process) again after each evaluation loop: TP
        # and PP peers would add their copies of the same rows
        pass

    def _gather_over_data_parallel(self, value):
        """Evaluation's gather: the tensor-/pipeline-parallel peers of a replica hold the same rows, so rows are
        gathered over the data-parallel ranks only (in their order, which is the loader's)."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) == 1:
            return value
        return _gather_tree(value, group)

    # -- data -----------------------------------------------------------------------------------------
    def _get_dataloader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                        dataloader_key=None):
        """Trainer's DataLoader, not prepared by accelerate: the train loader is prepared with the model
        (`_prepare_for_training`), the others sharded over data-parallel ranks here, in Trainer's batches
        (per_device_eval_batch_size rows a rank: one engine call each, `prediction_step`)."""
        with _accelerator_method(self.accelerator, "prepare", lambda loader: loader):  # Trainer's code calls it
            loader = super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        if is_training:
            return loader
        self._check_eval_size(loader.dataset, loader.batch_size)
        engine = self._megatron_built()
        prepared = self._eval_loader(engine, loader)
        if dataloader_key is not None and self.args.dataloader_persistent_workers:
            self._eval_dataloaders[dataloader_key] = prepared  # Trainer reuses what it stored: the prepared one
        return prepared

    def _check_eval_size(self, dataset, batch: int):
        """With several data-parallel ranks an eval set must fill whole rounds of per_device_eval_batch_size rows
        on every rank: the rows accelerate repeats to even them out would be counted twice (the gather here is not
        accelerate's gather_for_metrics). One rank takes a shorter last batch, as HF's loop does. On the
        interleaved pipeline schedule every eval batch runs as num_micro_batches micro-batches
        (`_eval_micro_batches`): checked here, before the run, not at the first such batch."""
        plugin, sized = self._megatron_plugin, hasattr(dataset, "__len__")
        dp, n = _dp_size(plugin), plugin.num_micro_batches
        if _interleaved(plugin) and batch is not None:
            last = len(dataset) % batch if sized and dp == 1 and not self.args.dataloader_drop_last else 0
            if batch % n or last % n:
                raise _interleaved_eval_refusal(batch if batch % n else f"{batch} (last batch: {last})", n,
                                                ", or set dataloader_drop_last=True")
        if self.args.dataloader_drop_last or dp == 1 or batch is None or not sized:
            return
        if len(dataset) % (batch * dp):
            raise MegatronPluginConfigError(
                "dataloader_drop_last", False,
                f"the {len(dataset)} evaluation samples do not fill whole batches of {batch * dp} "
                "(per_device_eval_batch_size x data-parallel ranks): give a multiple of that many, or set "
                "dataloader_drop_last=True (the last partial batches are then not evaluated)",
            )

    def _eval_loader(self, engine, loader):
        from accelerate.data_loader import prepare_data_loader
        from megatron.core import parallel_state

        return prepare_data_loader(
            loader, device=engine.device, num_processes=parallel_state.get_data_parallel_world_size(),
            process_index=parallel_state.get_data_parallel_rank(), split_batches=False, put_on_device=True,
            non_blocking=engine.device.type == "cuda",
        )

    def get_train_dataloader(self):
        if self._megatron_train_loader is not None:
            return self._megatron_train_loader
        loader = super().get_train_dataloader()
        plugin = self._megatron_plugin
        sized = hasattr(loader.dataset, "__len__")
        if sized and loader.batch_size is not None and plugin.num_micro_batches > 1 and not loader.drop_last:
            n, micro = len(loader.dataset), loader.batch_size * _dp_size(plugin)
            if n % micro:
                raise MegatronPluginConfigError(
                    "dataloader_drop_last", False,
                    f"the last of the {n} samples do not fill a micro-batch of {micro} (per_device_train_batch_size "
                    "x data-parallel ranks): set dataloader_drop_last=True",
                )
            if n % (micro * plugin.num_micro_batches):
                # whole micro-batches, the last step shorter (`_with_partial_last_step`): nothing is dropped
                loader = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                                    collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                                    pin_memory=loader.pin_memory, drop_last=True)
        check_dataloader(loader, plugin, _dp_size(plugin))
        if not sized:
            return _PendingLoader(loader, None)
        # the length prepare will give it, computed as it will be built (no process group needed)
        as_prepared = _with_partial_last_step(
            prepare_megatron_dataloader(loader, plugin, _dp_size(plugin), 0, torch.device("cpu"), plugin.seed),
            plugin.num_micro_batches)
        steps = getattr(getattr(as_prepared, "batch_sampler", None), "batch_sampler", None)
        left = steps._layout(len(loader.dataset))[1] if isinstance(steps, _StepBatches) else 0
        if left and _interleaved(plugin) and left % plugin.pp_degree:
            raise MegatronPluginConfigError(
                "num_layers_per_virtual_pipeline_stage", plugin.num_layers_per_virtual_pipeline_stage,
                f"each epoch ends, as HF's, on a step of the {left} micro-batches left, which the interleaved "
                f"pipeline schedule cannot run (it takes multiples of pp_degree={plugin.pp_degree}): give a train "
                "set that fills whole steps, or run without virtual pipeline stages",
            )
        return _PendingLoader(loader, len(as_prepared))

    def _track_num_input_tokens(self, inputs):
        # tensor- and pipeline-parallel peers read the same rows: count them once, over data-parallel ranks
        with _accelerator_method(self.accelerator, "gather", self._gather_over_data_parallel):
            super()._track_num_input_tokens(inputs)

    def get_total_train_batch_size(self, args) -> int:
        plugin = self._megatron_plugin
        return self._train_batch_size * plugin.num_micro_batches * _dp_size(plugin)

    # -- optimizer, scheduler, prepare ----------------------------------------------------------------
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """Megatron's scheduler, built at prepare, with HF's curve: linear warmup over `get_warmup_steps`
        (megatron-core reaches the peak at the same step), then HF's linear / cosine decay to 0 over the
        run, or constant. HF's "constant" has no warmup."""
        if self.lr_scheduler is None:
            kind = _value(self.args, "lr_scheduler_type")
            warmup = 0 if kind == "constant" else self.args.get_warmup_steps(num_training_steps)
            if warmup >= num_training_steps:  # megatron-core's scheduler asserts a warmup shorter than the decay
                raise MegatronPluginConfigError(
                    "warmup_steps", self.args.warmup_steps,
                    f"the warmup ({warmup} steps) must be shorter than the run ({num_training_steps} steps): lower "
                    "warmup_steps, or raise max_steps / num_train_epochs",
                )
            self.lr_scheduler = MegatronLMDummyScheduler(optimizer or self.optimizer, num_training_steps, warmup)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _megatron_build(self, max_steps, pending):
        """accelerator.prepare of the model with the optimizer, the train loader and the scheduler, once:
        Megatron lays out the step from the loader it is given with the model. Returns the prepared loader."""
        if self.lr_scheduler is not None and not isinstance(self.lr_scheduler, MegatronLMDummyScheduler):
            raise MegatronPluginConfigError(
                "optimizers[1]", type(self.lr_scheduler).__name__,
                "Megatron builds its scheduler from lr_scheduler_type and warmup_steps: pass optimizers=(opt, None)",
            )
        # eval logits cost a TP gather and the whole vocabulary per token: only when something reads them
        wants_logits = self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None
        if wants_logits and not self.args.prediction_loss_only:
            if self._megatron_plugin.pp_degree > 1:
                raise MegatronPluginConfigError(
                    "compute_metrics", getattr(self.compute_metrics, "__name__", self.compute_metrics),
                    "with pipeline parallelism only the last stage holds the logits: drop compute_metrics and "
                    "preprocess_logits_for_metrics (or set prediction_loss_only=True), or run without pp_degree",
                )
            self._megatron_plugin.return_logits = True
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        for dataset in (d for d in evals if d is not None):
            self._check_eval_size(dataset, self.args.eval_batch_size)  # before any Megatron process group
        self.create_optimizer()
        self.create_scheduler(max_steps)
        model, optimizer, loader, scheduler = self.accelerator.prepare(
            self.model, self.optimizer, pending.loader, self.lr_scheduler)
        self.optimizer, self.lr_scheduler = optimizer, scheduler
        self.megatron_engine = self.model_wrapped = model
        return _with_partial_last_step(loader, model.plugin.num_micro_batches)

    def _megatron_built(self):
        """The engine; built here with the train loader and schedule when evaluation comes before training, so
        train() can follow."""
        if self.megatron_engine is None:
            if self.train_dataset is not None:
                pending = self.get_train_dataloader()
                max_steps = self.set_initial_training_values(self.args, pending)[-1]
                self._megatron_train_loader = self._megatron_build(max_steps, pending)
            else:
                raise MegatronPluginConfigError(
                    "train_dataset", None,
                    "Megatron lays out the step from the train loader: pass train_dataset (evaluation alone "
                    "needs it too)",
                )
        return self.megatron_engine

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.megatron_engine is None:
            loader = self._megatron_build(max_steps, train_dataloader)
        elif self._megatron_train_loader is not None:  # built by an evaluation before train(), with this loader
            loader = self._megatron_train_loader
        else:
            raise MegatronPluginConfigError(
                "train()", "a second call",
                "a Megatron Trainer trains once: build a new Trainer (with resume_from_checkpoint) for another run",
            )
        self._megatron_train_loader = None
        model = self.megatron_engine
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = loader
        return model, loader

    def _move_model_to_device(self, model, device):
        # prepare builds the Megatron model on its device from these weights: a whole HF copy there would only
        # take memory
        pass

    def _wrap_model(self, model, training=True, dataloader=None):
        return self._megatron_built()

    # -- steps ----------------------------------------------------------------------------------------
    @staticmethod
    def _loss_of(output):
        """The step's loss, the same on every rank: the engine gives every pipeline stage the last stage's logs
        (`MegatronCoreEngine._share_from_last_stage`), which Trainer averages over the processes when it logs."""
        return output if torch.is_tensor(output) else output.loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        engine = self.megatron_engine
        engine.train()
        # HF logs the learning rate its step used; the engine steps the scheduler inside the call
        self._megatron_lr = engine.optimizer.param_groups[0]["lr"]
        # an epoch's last step may hold fewer micro-batches (`_with_partial_last_step`), as HF's does
        rows, n = self.megatron_rows(inputs), engine.plugin.num_micro_batches
        micro = self.args.per_device_train_batch_size
        count = rows // micro if rows % micro == 0 and 1 <= rows // micro < n else n
        with engine.micro_batch_count(count):
            output = engine(**self.megatron_batch(inputs, training=True))
        self.megatron_record(output, training=True)
        return self._loss_of(output).detach()

    def _get_learning_rate(self):
        if self._megatron_lr is not None:
            return self._megatron_lr
        return self.optimizer.param_groups[0]["lr"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        engine = self.megatron_engine
        output = engine(**self.megatron_batch(inputs, training=engine.training))
        self.megatron_record(output, training=engine.training)
        loss = self._loss_of(output)
        return (loss, output) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """This rank's eval loss (the token mean of its own batch: HF's loop averages each process's loss) and,
        when compute_metrics or preprocess_logits_for_metrics is set, the logits gathered over TP (the whole
        vocabulary) for this rank's rows; evaluation gathers rows over data-parallel ranks."""
        engine = self._megatron_built()
        engine.eval()
        labels = None
        if self.label_names and all(inputs.get(k) is not None for k in self.label_names):
            labels = tuple(inputs[k].detach() for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        # HF's evaluation loop averages each process's loss of its own batch (repeated by its rows)
        count = self._eval_micro_batches(engine, self.megatron_rows(inputs))
        with torch.no_grad(), engine.micro_batch_count(count), _logging_rank_loss(engine):
            output = engine(**self.megatron_batch(inputs, training=False))
        self.megatron_record(output, training=False)
        loss = getattr(engine, "metrics", {}).get(RANK_LOSS)
        loss = (self._loss_of(output) if loss is None else loss).detach()
        logits = None if torch.is_tensor(output) else getattr(output, "logits", None)
        if prediction_loss_only or logits is None:
            return loss, None, None
        return loss, logits, labels

    def _eval_micro_batches(self, engine, rows: int) -> int:
        """An eval batch runs whole (its loss is the same cut into micro-batches: a token mean, or a mean of
        equal parts), except on megatron-core's interleaved pipeline schedule, which needs a multiple of the
        pipeline size: there, the step's micro-batch count."""
        plugin, n = engine.plugin, engine.plugin.num_micro_batches
        if not _interleaved(plugin):
            return 1
        if rows % n:  # an unsized eval set, which _check_eval_size could not check before the run
            raise _interleaved_eval_refusal(rows, n)
        return n

    # -- train --------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # Trainer's pick (the highest checkpoint-N) may be a half-written one
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise MegatronPluginConfigError(
                    "resume_from_checkpoint", True,
                    f"no checkpoint-N in {self.args.output_dir} holds a complete Megatron state and "
                    "trainer_state.json: pass a checkpoint's path, or train from the start",
                )
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        _logger.warning_once(
            "trainer.model still holds the initial HF weights: the trained ones live in the Megatron engine "
            "(trainer.megatron_engine). Save them with trainer.save_model() (HF weights from_pretrained loads), "
            "or read them with trainer.accelerator.get_state_dict(trainer.megatron_engine)"
        )
        return result

    # -- checkpoints and export -----------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call: bool = False) -> None:
        """HF weights `from_pretrained` loads (a PeftModel: its adapter folder), with the tokenizer and the
        training arguments. Collective: every rank calls it (Trainer does). A checkpoint-N folder holds the
        Megatron state instead (`_save_optimizer_and_scheduler`), which carries the weights; with save_only_model
        it holds these HF weights alone, as HF's does."""
        if _internal_call and not self.args.save_only_model:
            return  # checkpoint-N: the Megatron state carries the weights
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self._megatron_built()
        self.accelerator.save_model(engine, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.accelerator.save_state(os.path.join(output_dir, MEGATRON_FOLDER))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is not None:
            self.accelerator.load_state(_megatron_folder(checkpoint))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        # Trainer calls it before prepare: only checked here, the weights come back with the optimizer and
        # scheduler (`_load_optimizer_and_scheduler`) once the engine exists
        _megatron_folder(resume_from_checkpoint)

    def _save_scaler(self, output_dir: str) -> None:
        pass  # a loss scaler (fp16 from the accelerate config) is part of the engine's state in megatron/

    def _load_scaler(self, checkpoint) -> None:
        pass


def _refuse_custom_loss(cls, compute_loss_func) -> None:
    """The engine's train step computes the loss (vocab-parallel, without full logits); Trainer's compute_loss
    is never on the training path, so a custom one would be ignored."""
    fix = ("the Megatron step computes the loss: give the plugin a custom_loss_function, or a train step "
           "(custom_train_step_class, see the train_steps package)")
    if compute_loss_func is not None:
        raise MegatronPluginConfigError("compute_loss_func", getattr(compute_loss_func, "__name__", compute_loss_func),
                                        f"{fix}, and drop compute_loss_func")
    if cls.compute_loss is not MegatronTrainerMixin.compute_loss:
        raise MegatronPluginConfigError("compute_loss", f"{cls.__name__}.compute_loss", f"{fix}, and drop the override")


def _has_megatron_state(checkpoint: str) -> bool:
    """checkpoint-N/megatron holds a committed save: a checkpoint format recognizes it by the file its save
    writes last (torch_dist's tracker, the native format's `latest`), so an interrupted save does not count."""
    from ..engine.checkpoint import FORMATS

    folder = os.path.join(checkpoint, MEGATRON_FOLDER)
    return os.path.isdir(folder) and any(fmt.recognizes(folder) for fmt in FORMATS.values())


def _megatron_folder(checkpoint: str) -> str:
    if not _has_megatron_state(checkpoint):
        raise MegatronPluginConfigError(
            "resume_from_checkpoint", checkpoint,
            f"no complete Megatron state in it ({MEGATRON_FOLDER}/ with its checkpoint's tracker): resume from a "
            "checkpoint-N that this Trainer wrote",
        )
    return os.path.join(checkpoint, MEGATRON_FOLDER)


def last_complete_checkpoint(output_dir: str):
    """The newest checkpoint-N of output_dir whose Megatron state was committed and whose trainer_state.json
    was written (Trainer writes it after the state), or None: what resume_from_checkpoint=True resumes."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(((int(m.group(1)), name) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                    if (m := pattern.match(name))), reverse=True)
    for _, name in found:
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, transformers.trainer.TRAINER_STATE_NAME)) and _has_megatron_state(path):
            return path
    return None


class Trainer(MegatronTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` on Megatron-Core parallelism: a Trainer script runs unchanged under
    `accelerate launch --config_file <Megatron config>` with this import. See `MegatronTrainerMixin`."""
