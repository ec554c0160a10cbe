"""Everything `prepare` decides, decided once, before any process group exists.

`resolve` turns what the script handed over (the plugin, the HF model, optimizer, scheduler, loaders and
accelerate's state) into a frozen `RunSpec`: the model family and variant, the layout sizes, the batch
geometry, the train step, the fused weight gradient, compilation and the patches the run needs. Every
check of user input happens here, once, on every rank alike, so bad input fails everywhere before the
first collective and the rest of `prepare` (build, wrap) only reads the spec.

The user's plugin is never written: the spec holds a resolved copy (`RunSpec.plugin`, what
`accelerator.state.megatron_lm_plugin` shows after `prepare`, with `data_parallel_size`, `micro_batch_size`
and `global_batch_size` as ints, as accelerate's integration has them).
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
from accelerate.utils import DynamoBackend
from torch.utils.data import DataLoader

import train_steps

from . import patches
from .data.indexed import MegatronLMDummyDataLoader
from .engine.data import check_dataloader, micro_batch_size
from .engine.hf_io import HFReader
from .engine.optimizer import check_optimizer, check_optimizer_fields, trainable_flags
from .engine.scheduler import MegatronLMDummyScheduler, check_scheduler
from .engine.tensorboard import check_tensorboard
from .errors import MegatronPluginConfigError
from .fs import check_writable
from .models import ModelFamily, check_model, check_moe_training
from .layers.fp8 import check_output_layer as check_fp8_output_layer
from .models.convert import mcore_to_hf_sources, model_dims
from .plugin import (MegatronLMPlugin, check_compile, check_cpu_support, check_fp8, check_mixed_precision,
                     check_tp_comm_overlap, check_full_iteration_graph, refuse_with_full_iteration_graph,
                     resolve_train_step_class, uses_cuda_graphs)

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Inputs:
    """The objects handed to `prepare`, sorted by kind."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Optional[MegatronLMDummyScheduler]
    loaders: Tuple[DataLoader, ...]
    indexed: Tuple[MegatronLMDummyDataLoader, ...]  # one loader, passed once to three times

    @classmethod
    def sort(cls, args, plugin: MegatronLMPlugin, already_prepared: bool) -> "Inputs":
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if not isinstance(a, (torch.nn.Module, torch.optim.Optimizer, DataLoader))
                      and (isinstance(a, MegatronLMDummyScheduler) or hasattr(a, "step"))]
        loaders = tuple(a for a in args if isinstance(a, DataLoader))
        indexed = tuple(a for a in args if isinstance(a, MegatronLMDummyDataLoader))
        if len(models) > 1 or (models and already_prepared):
            raise MegatronPluginConfigError(
                "prepare(models)", len(models) + already_prepared,
                "Megatron runs train one model per Accelerator: prepare a single model",
            )
        if not models:
            raise MegatronPluginConfigError("prepare(model)", None, "pass the HF model to prepare with its dataloaders")
        if not loaders and not indexed:
            raise MegatronPluginConfigError(
                "prepare(dataloaders)", None,
                "pass the training and/or evaluation DataLoader (or a MegatronLMDummyDataLoader) to the same prepare "
                "call: Megatron needs the micro-batch size to lay out the step",
            )
        if len({id(a) for a in indexed}) > 1 or len(indexed) > 3:
            raise MegatronPluginConfigError(
                "prepare(MegatronLMDummyDataLoader)", f"{len({id(a) for a in indexed})} loaders, passed {len(indexed)} times",
                "pass one MegatronLMDummyDataLoader, once, twice or three times: it becomes the train, validation and "
                "test iterators in that order",
            )
        if not optimizers:
            raise MegatronPluginConfigError("prepare(optimizer)", None, "pass the optimizer to the same prepare call")
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MegatronPluginConfigError("prepare(optimizers)", len(optimizers), "pass one optimizer and one scheduler")
        for s in schedulers:
            check_scheduler(s, plugin)
        check_optimizer(optimizers[0])
        return cls(unwrap_compiled(models[0]), optimizers[0], schedulers[0] if schedulers else None, loaders, indexed)


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a `torch.compile` wrapper (an OptimizedModule, whose parameters are named
    `_orig_mod.*`): prepare builds Megatron layers from it, so the compiled HF graph would never run. Its
    parameters are the HF model's own, so an optimizer built before compiling still holds them. A model with
    compiled submodules is refused: its parameter names are no HF model's."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, torch.nn.Module):
        warnings.warn(
            f"prepare got a torch.compile'd model: it prepares the {type(inner).__name__} inside it "
            "(model._orig_mod) as Megatron layers, which torch.compile compiles only when asked: "
            "MegatronLMPlugin(torch_compile=True) or accelerate's dynamo_backend (GPU)", stacklevel=4,
        )
        model = inner
    compiled = next((n for n, _ in model.named_parameters() if "_orig_mod." in n), None)
    if compiled is not None:
        raise MegatronPluginConfigError(
            "model", f"a submodule compiled with torch.compile (parameter {compiled})",
            "pass the HF model before compiling any part of it: prepare builds Megatron layers from it, compiled "
            "when MegatronLMPlugin(torch_compile=True) or accelerate's dynamo_backend asks (GPU)",
        )
    return model


@dataclass(frozen=True)
class RunSpec:
    """What one `prepare` builds, decided and checked."""

    plugin: MegatronLMPlugin  # the resolved copy
    family: ModelFamily
    variant: str
    num_layers: int
    device_type: str
    dtype: Optional[torch.dtype]  # mixed precision: autocast on CPU, parameters on CUDA
    compile_kwargs: Optional[dict]  # torch.compile arguments of the layers, None: eager
    world_size: int
    data_parallel_size: int
    micro_batch_size: int
    step_class: type
    step_kwargs: dict
    reader: Optional[HFReader]  # where weights come from when the model has none (meta device)
    data_sizes: Any  # the indexed datasets' sizes (MegatronLMDummyDataLoader.check_for), or None
    patches: Tuple[str, ...]

    @property
    def params_dtype(self) -> torch.dtype:
        return self.dtype if (self.dtype is not None and self.device_type == "cuda") else torch.float32


def layer_compile_kwargs(plugin: MegatronLMPlugin, dynamo_plugin) -> Optional[dict]:
    """torch.compile arguments for the Megatron layers, or None for eager. accelerate's dynamo settings
    (`accelerate config`, `Accelerator(dynamo_backend=...)`) win over the plugin's plain switch."""
    if dynamo_plugin is not None and dynamo_plugin.backend != DynamoBackend.NO and not dynamo_plugin.disable:
        return dynamo_plugin.to_kwargs()
    return {} if plugin.torch_compile else None


def resolve_fusion(plugin: MegatronLMPlugin, device_type: str, compile_kwargs: Optional[dict]) -> bool:
    """`gradient_accumulation_fusion`, its default (None) decided. On CUDA, eager or compiled: with the light
    ops of compiled_linear.py compiled GPT-2 124M runs 382k tok/s fused vs 307k unfused and 350M ties
    (BENCHMARKS.md, speed round 4). Not with CUDA graphs (compile mode reduce-overhead): check_compile
    says why."""
    if plugin.gradient_accumulation_fusion is not None:
        return plugin.gradient_accumulation_fusion
    return device_type == "cuda" and not uses_cuda_graphs(compile_kwargs)


def weights_reader(hf_model, plugin: MegatronLMPlugin, family: ModelFamily, variant: str) -> Optional[HFReader]:
    """None for a model that carries its weights; for one without (meta device), a reader of the HF folder
    they come from, checked to hold every tensor the model needs. No collectives."""
    if not any(p.is_meta for p in hf_model.parameters()):
        return None
    path = plugin.hf_checkpoint or getattr(hf_model.config, "_name_or_path", "") or None
    if path is None or not os.path.isdir(path):
        raise MegatronPluginConfigError(
            "hf_checkpoint", path,
            "the model has no weights (meta device) and no local checkpoint folder to read them from: pass "
            "MegatronLMPlugin(hf_checkpoint='<HF model folder>'), or build the config with "
            "AutoConfig.from_pretrained('<folder>')",
        )
    reader = HFReader(path, variant=variant, setting="hf_checkpoint", config=hf_model.config)
    missing = sorted(family.mapped_hf_names(hf_model.config, variant) - set(reader.names))
    if missing:
        raise MegatronPluginConfigError(
            "hf_checkpoint", path, f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}: "
            "is it of this model (and this variant)?",
        )
    return reader


def resolve_step(plugin: MegatronLMPlugin, family: ModelFamily, variant: str, hf_model) -> type:
    """The train step class: the plugin's custom one (checked against the family), else the family's."""
    step_cls = plugin.custom_train_step_class
    if step_cls is None:
        if variant not in family.trainable_variants:
            trainable = " or ".join(family.classes[v] for v in family.trainable_variants)
            raise MegatronPluginConfigError(
                "model", type(hf_model).__name__,
                f"this model has no head the default train step can compute a loss with: pass {trainable}, or "
                "set custom_train_step_class to a step that computes your loss from the hidden states",
            )
        step_cls = getattr(train_steps, family.train_step)
    else:
        # a step built on one family's step reads batches and outputs of that family's model only; one built
        # on AbstractTrainStep directly is the user's to match
        own = getattr(train_steps, family.train_step)
        for base in (train_steps.GPTTrainStep, train_steps.BertTrainStep, train_steps.T5TrainStep):
            if issubclass(step_cls, base) and not issubclass(own, base) and not issubclass(step_cls, own):
                raise MegatronPluginConfigError(
                    "custom_train_step_class", step_cls.__name__,
                    f"it is a {base.__name__}, for other models than this {family.name} model ({family.train_step}): "
                    f"subclass {family.train_step}, or pass a model the step is for",
                )
    if hasattr(step_cls, "check_kwargs"):
        step_cls.check_kwargs(dict(plugin.custom_train_step_kwargs))
    return step_cls


def with_custom_functions(step_cls: type, plugin: MegatronLMPlugin) -> type:
    """The train step class with the plugin's `custom_get_batch_function` / `custom_loss_function` in place of
    its own, as accelerate's train steps take them: `get_batch(data_iterator)` returns what the step's
    forward_step unpacks (for GPT, accelerate's tuple: tokens, labels, loss_mask, attention_mask [True =
    masked], position_ids), and `loss_func(loss_mask, output_tensor)` returns (loss, {name: value averaged over
    data-parallel ranks}). A step that builds its functions through get_batch_func / get_loss_func, as the
    guide's and ours do, picks them up; the class itself is left as it was."""
    get_batch, loss_func = plugin.custom_get_batch_function, plugin.custom_loss_function
    if get_batch is None and loss_func is None:
        return step_cls
    attrs = {"__module__": step_cls.__module__, "__doc__": step_cls.__doc__}
    if get_batch is not None:
        attrs["get_batch_func"] = lambda self, *args, **kwargs: get_batch
    if loss_func is not None:
        attrs["get_loss_func"] = lambda self, *args, **kwargs: loss_func
    return type(step_cls.__name__, (step_cls,), attrs)


def _resolved_plugin(plugin: MegatronLMPlugin, **values) -> MegatronLMPlugin:
    """A copy of the user's plugin with what prepare decided; the user's object stays as it was."""
    out = copy.copy(plugin)
    # a path set on the plugin after it was built (plugin.custom_train_step_class = "pkg.Step") imports here
    out.custom_train_step_class = resolve_train_step_class(plugin.custom_train_step_class)
    out.other_megatron_args = dict(plugin.other_megatron_args)
    out.custom_train_step_kwargs = dict(plugin.custom_train_step_kwargs)
    for key, value in values.items():
        setattr(out, key, value)
    return out


def check_graph_step(plugin: MegatronLMPlugin, step_class: type) -> None:
    """The post-training steps read coefficients that scripts change as they train (an adaptive KL, a schedule of
    beta): a full-iteration CUDA graph would replay the values it was captured with, so they are refused with it."""
    if issubclass(step_class, (train_steps.PolicyGradientTrainStep, train_steps.DPOTrainStep)):
        refuse_with_full_iteration_graph(
            plugin, step_class.__name__, "a replay keeps the coefficients it was captured with (kl_coef, beta, clip "
            "ranges, ...), which scripts change as they train: train post-training steps without the graph")


def resolve(inputs: Inputs, plugin: MegatronLMPlugin, *, world_size: int, device_type: str,
            mixed_precision: str, dynamo_plugin=None, project_dir: Optional[str] = None) -> RunSpec:
    """Check and decide everything one `prepare` needs. No collectives."""
    if plugin.megatron_dataset_flag and not inputs.indexed:
        raise MegatronPluginConfigError(
            "megatron_dataset_flag", True,
            "no MegatronLMDummyDataLoader was passed to prepare: pass it (the flag is set for you when you do), "
            "or set megatron_dataset_flag=False for torch DataLoaders",
        )
    compile_kwargs = layer_compile_kwargs(plugin, dynamo_plugin)
    check_compile(plugin, compile_kwargs, device_type)
    if device_type == "cpu":
        check_cpu_support(plugin)
    check_mixed_precision(mixed_precision, device_type)
    dtype = MIXED_PRECISION.get(mixed_precision)
    hf_model = inputs.model
    family = check_model(plugin, hf_model.config, world_size=world_size)  # the plugin's one validation
    check_fp8(plugin, device_type, mixed_precision,
              non_decoder_family=None if family.build is None else family.name)
    if plugin.fp8 and plugin.fp8_output_layer:  # its weight shard: [padded vocabulary / TP, hidden]
        dims = model_dims(family, hf_model.config, plugin.make_vocab_size_divisible_by, plugin.tp_degree)
        check_fp8_output_layer(dims.padded_vocab // plugin.tp_degree, dims.hidden)
    check_moe_training(plugin, hf_model.config)
    num_layers = family.num_layers(hf_model.config)
    if family.num_experts(hf_model.config) and plugin.tp_degree > 1 and not plugin.sequence_parallelism:
        raise MegatronPluginConfigError(
            "sequence_parallelism", False,
            f"megatron-core's MoE layer trains with tp_degree={plugin.tp_degree} only under sequence parallelism: set "
            "sequence_parallelism=True, or split the experts with expert_model_parallel_size and "
            "tp_degree=1",
        )
    dp = world_size // (plugin.tp_degree * plugin.pp_degree * plugin.context_parallel_size)
    fusion = resolve_fusion(plugin, device_type, compile_kwargs)
    check_tp_comm_overlap(plugin, device_type, compile_kwargs, fusion)
    check_full_iteration_graph(plugin, device_type, compile_kwargs, mixed_precision,
                               moe=bool(family.num_experts(hf_model.config)),
                               encoder_family=None if family.build is None else family.name)
    micro = micro_batch_size(inputs.loaders, inputs.indexed, plugin)
    # as accelerate's resolved plugin has them after prepare (its set_training_args)
    resolved = _resolved_plugin(plugin, gradient_accumulation_fusion=fusion, megatron_dataset_flag=bool(inputs.indexed),
                                data_parallel_size=dp, micro_batch_size=micro,
                                global_batch_size=micro * plugin.num_micro_batches * dp)
    check_tensorboard(resolved)
    for dl in inputs.loaders:
        check_dataloader(dl, resolved, dp)
    check_scheduler(inputs.scheduler, resolved)  # sample counts need the global batch
    check_optimizer_fields(resolved, inputs.optimizer, device_type)
    variant = family.variant_of(hf_model)
    data_sizes = inputs.indexed[0].check_for(hf_model.config, family, resolved, inputs.scheduler,
                                             len(inputs.indexed)) if inputs.indexed else None
    step_class = with_custom_functions(resolve_step(resolved, family, variant, hf_model), resolved)
    check_graph_step(resolved, step_class)
    if plugin.custom_model_provider_function is None:
        # the optimizer holds every trainable parameter (applied per chunk once they exist)
        trainable_flags(hf_model, inputs.optimizer,
                        mcore_to_hf_sources(family, hf_model.config, family.whole_plan(hf_model.config), variant))
        reader = weights_reader(hf_model, resolved, family, variant)
    else:  # the provider's modules carry their own weights and trainable flags
        reader = None
    if project_dir:
        check_writable(project_dir, "ProjectConfiguration.project_dir")
    return RunSpec(
        plugin=resolved, family=family, variant=variant, num_layers=num_layers, device_type=device_type,
        dtype=dtype, compile_kwargs=compile_kwargs, world_size=world_size, data_parallel_size=dp,
        micro_batch_size=micro, step_class=step_class, step_kwargs=dict(plugin.custom_train_step_kwargs),
        reader=reader, data_sizes=data_sizes,
        patches=patches.for_run(device_type, wgrad_fusion=fusion and device_type == "cuda", rotary=family.rotary),
    )
