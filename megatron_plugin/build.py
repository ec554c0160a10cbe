"""The second stage of `prepare`: from a checked `RunSpec`, the process groups, this rank's model chunks
carrying the HF weights, the train step and the engine. Collective: every rank runs it."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, Optional

import torch

from . import patches
from .data.indexed import MegatronBatches, consumed_samples
from .engine.checkpointing.collective import agree
from .engine.cpu import CPUEngine
from .engine.distributed import start
from .engine.gpu import MegatronCoreEngine
from .engine.lora import LoraRun, load_fp32_masters, lora_chunks, lora_optimizer
from .engine.optimizer import SUPPORTED, rebuild_optimizer, trainable_flags
from .engine.recompute import hook_embeddings_for_recompute
from .engine.scheduler import build_scheduler
from .engine.tensorboard import TensorBoardLogger
from .errors import MegatronPluginConfigError
from .layers.fp8 import attach_fp8
from .layout import Layout
from .models.convert import mcore_to_hf_sources
from .models.fields import sequence_lengths
from .models.modeling import MegatronModel
from .resolve import Inputs, RunSpec


def megatron_args(spec: RunSpec, model: MegatronModel) -> SimpleNamespace:
    """The `megatron_args` a train step is built with (Megatron-LM's `get_args()` stand-in): the resolved
    plugin's settings plus what prepare derived."""
    plugin, config = spec.plugin, model.hf_config
    args = SimpleNamespace(**{k: getattr(plugin, k) for k in plugin.__dataclass_fields__})
    args.micro_batch_size = spec.micro_batch_size
    args.global_batch_size = plugin.global_batch_size
    args.data_parallel_size = spec.data_parallel_size
    args.padded_vocab_size = model.dims.padded_vocab
    args.model_variant = model.variant
    args.decoder_start_token_id = getattr(config, "decoder_start_token_id", None)
    args.pad_token_id = getattr(config, "pad_token_id", None)
    args.vocab_size = config.vocab_size
    args.eod_token = getattr(config, "eos_token_id", None)
    # Megatron-LM's names: seq_length, encoder_seq_length and (T5) decoder_seq_length
    args.__dict__.update(sequence_lengths(plugin, model.family, config))
    return args


def build_chunks(spec: RunSpec, inputs: Inputs, lora: Optional[LoraRun] = None) -> List[MegatronModel]:
    """This rank's model chunks (one per virtual pipeline stage) with the HF weights, frozen where the HF
    model's parameters are; for a PeftModel (`lora`), the base frozen and its adapters attached."""
    # a damaged file may be read by some ranks only (pipeline stages read different tensors): every
    # rank raises the error, so none waits in a collective
    if spec.plugin.custom_model_provider_function is not None:
        def provided():
            chunks = MegatronModel.chunks_from_provider(inputs.model, spec.plugin)
            check_provided_precision(chunks[0].config, spec)
            return chunks

        return agree(provided)
    if lora is not None:
        return agree(lambda: lora_chunks(spec, lora))
    chunks = agree(lambda: MegatronModel.chunks_from_hf(inputs.model, spec.plugin, params_dtype=spec.params_dtype,
                                                        reader=spec.reader))
    for chunk in chunks:
        sources = mcore_to_hf_sources(chunk.family, chunk.hf_config, chunk.plan, chunk.variant)
        flags = trainable_flags(inputs.model, inputs.optimizer, sources)
        for name, param in chunk.module.named_parameters():
            param.requires_grad_(flags[name])
    return chunks


def check_provided_precision(config, spec: RunSpec) -> None:
    """A provider's TransformerConfig decides its parameters' dtype; on CUDA it must be the one accelerate's
    mixed_precision asks for (megatron-core's Float16Module and optimizer read it from the config)."""
    if spec.device_type != "cuda":
        return
    want = {torch.bfloat16: (True, False), torch.float16: (False, True)}.get(spec.dtype, (False, False))
    if (bool(config.bf16), bool(config.fp16)) != want:
        raise MegatronPluginConfigError(
            "custom_model_provider_function", f"a module with TransformerConfig(bf16={config.bf16}, fp16={config.fp16})",
            f"accelerate's mixed_precision is {spec.dtype or 'no'}: build the provider's TransformerConfig with "
            f"bf16={want[0]}, fp16={want[1]} (and params_dtype to match)",
        )


def build_engine(spec: RunSpec, inputs: Inputs, chunks: List[MegatronModel], layout: Layout,
                 lora: Optional[LoraRun] = None):
    """The CUDA engine (megatron-core's DDP, optimizer and schedules) or the CPU one (torch collectives)."""
    model = chunks[0]
    step_args = megatron_args(spec, model)
    step = spec.step_class(step_args, **spec.step_kwargs)
    if spec.device_type == "cuda":
        engine = MegatronCoreEngine(chunks, inputs.optimizer, inputs.scheduler, spec.plugin, step, layout.device,
                                    spec.dtype, compile_kwargs=spec.compile_kwargs)
        if lora is not None:  # the masters were copied from bf16 adapters: start them from peft's fp32 values
            load_fp32_masters(engine, lora)
    else:
        if model.provided:
            inner = provided_module_optimizer(inputs.optimizer, model.module, spec.plugin)
        elif lora is not None:
            inner = lora_optimizer(inputs.optimizer, lora, model, plugin=spec.plugin)
        else:
            sources = mcore_to_hf_sources(model.family, model.hf_config, model.plan, model.variant)
            inner = rebuild_optimizer(inputs.optimizer, inputs.model, sources, dict(model.module.named_parameters()),
                                      plugin=spec.plugin)
        sched = build_scheduler(inputs.scheduler, inner, spec.plugin) if inputs.scheduler else None
        engine = CPUEngine(chunks, inner, sched, spec.plugin, step, layout.device, autocast_dtype=spec.dtype)
    engine.megatron_args = step_args
    engine.lora = lora.built() if lora is not None else None
    engine.tensorboard = TensorBoardLogger(spec.plugin) if spec.plugin.tensorboard_dir is not None else None
    if getattr(engine, "config", None) is None:  # HF scripts read model.config of what prepare returned
        engine.config = model.hf_config
    return engine


def provided_module_optimizer(user_opt: torch.optim.Optimizer, module: torch.nn.Module, plugin) -> torch.optim.Optimizer:
    """The CPU engine's optimizer over a custom_model_provider_function's module, whose parameters have no HF
    names to find the user's parameter groups by: grouped as megatron-core's get_megatron_optimizer groups them
    on the CUDA engine (its _get_param_groups), from the user's optimizer's class and largest learning rate and
    weight decay: no decay for biases and 1-D parameters (or where no_wd_decay_cond says), lr * lr_mult where
    scale_lr_cond says."""
    groups = user_opt.param_groups
    hyper = {k: groups[0][k] for k in SUPPORTED[type(user_opt)] if k in groups[0]}
    lr = max(g["lr"] for g in groups)
    wd = max(g.get("weight_decay", 0.0) for g in groups)
    no_wd, scale = plugin.no_wd_decay_cond, plugin.scale_lr_cond
    buckets = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        decay = not no_wd(name, p) if no_wd is not None else not (name.endswith(".bias") or p.dim() == 1)
        scaled = bool(scale(name, p)) if scale is not None else False
        buckets.setdefault((decay, scaled), []).append(p)
    param_groups = [dict(hyper, params=params, weight_decay=wd if decay else 0.0,
                         lr=lr * plugin.lr_mult if scaled else lr, **({"lr_mult": plugin.lr_mult} if scaled else {}))
                    for (decay, scaled), params in sorted(buckets.items())]
    if not param_groups:
        raise MegatronPluginConfigError("custom_model_provider_function", "a module without trainable parameters",
                                        "return a module with parameters that require grad")
    return type(user_opt)(param_groups)


def indexed_iterators(spec: RunSpec, inputs: Inputs, layout: Layout) -> list:
    """The train, validation and test iterators (as many as prepare was given the MegatronLMDummyDataLoader) of
    Megatron indexed data: megatron-core's GPTDataset over the loader's data_path, or the datasets of the
    plugin's custom_megatron_datasets_provider_function, Megatron-LM's train_valid_test_datasets_provider:
    `provider(train_val_test_num_samples) -> (train, valid, test)`, sized in samples as Megatron-LM sizes them;
    their samples are megatron-core GPTDataset's ({'tokens', 'labels', 'loss_mask'[, 'position_ids']}) or
    Megatron-LM's GPT datasets' ({'text': seq_length + 1 token ids}). Collective."""
    if not inputs.indexed:
        return []
    loader, wanted = inputs.indexed[0], len(inputs.indexed)
    provider = spec.plugin.custom_megatron_datasets_provider_function
    if provider is None:
        # megatron-core writes the sample indices on rank 0 first, the others read them
        return loader.build(spec.data_sizes, spec.plugin, layout, layout.device, wanted)
    sizes, g = spec.data_sizes, spec.plugin.global_batch_size
    evals = sizes["train_iters"] // sizes["eval_interval"] + 1
    samples = [sizes["train_iters"] * g, evals * sizes["eval_iters"] * g, sizes["eval_iters"] * g]
    samples = [n if i < wanted else 0 for i, n in enumerate(samples)]
    datasets = agree(lambda: _provided_datasets(provider, samples, wanted))
    a = loader.dataset_args
    consumed = consumed_samples(spec.plugin)  # each split's sampler starts there, as Megatron-LM's
    return [MegatronBatches(datasets[i], a["micro_batch_size"], spec.plugin.num_micro_batches, layout.dp_size,
                            layout.dp_rank, layout.device, a["num_workers"], cyclic=i > 0,
                            positions=a["reset_position_ids"], split=("train", "valid", "test")[i], consumed=consumed[i])
            for i in range(wanted)]


def _provided_datasets(provider, samples: list, wanted: int) -> list:
    setting = "custom_megatron_datasets_provider_function"
    got = provider(samples)
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        raise MegatronPluginConfigError(setting, type(got).__name__, "return (train, valid, test) datasets (None for "
                                                                     "a split not used)")
    out = []
    for i, dataset in enumerate(got[:wanted]):
        split = ("train", "valid", "test")[i]
        if dataset is None or len(dataset) == 0:
            raise MegatronPluginConfigError(setting, f"no {split} dataset",
                                            f"prepare was given the loader {wanted} times: return a {split} dataset")
        out.append(_MegatronSamples(dataset))
        out[-1][0]  # a sample of a kind we cannot read is refused here, on every rank alike
    return out


class _MegatronSamples(torch.utils.data.Dataset):
    """A provider's dataset, with the samples MegatronBatches reads: tokens, labels, loss_mask (position_ids)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample = self.dataset[i]
        if isinstance(sample, dict) and "tokens" in sample and "labels" in sample:
            out = {k: torch.as_tensor(v) for k, v in sample.items() if k in ("tokens", "labels", "loss_mask", "position_ids")}
            out.setdefault("loss_mask", torch.ones_like(out["labels"], dtype=torch.float))
            return out
        if isinstance(sample, dict) and "text" in sample:  # Megatron-LM's GPT samples: seq_length + 1 ids
            text = torch.as_tensor(sample["text"]).long()
            return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(len(text) - 1)}
        raise MegatronPluginConfigError(
            "custom_megatron_datasets_provider_function", f"a sample of type {type(sample).__name__}"
            + (f" with keys {sorted(sample)}" if isinstance(sample, dict) else ""),
            "samples must be dicts with 'tokens', 'labels' and 'loss_mask' (megatron-core's GPTDataset) or with "
            "'text' (seq_length + 1 token ids, Megatron-LM's GPT datasets)",
        )


def build(spec: RunSpec, inputs: Inputs, timeout=None, lora: Optional[LoraRun] = None):
    """-> (engine, layout, the indexed-data iterators: train, validation, test as many as were asked for).
    `timeout` (a timedelta: accelerate's InitProcessGroupKwargs) also bounds megatron-core's groups. `lora`:
    the PeftModel's adapters and base weights (engine/lora.peft_inputs)."""
    patches.install(*spec.patches)
    # whole minutes (megatron-core's unit), rounded up: never shorter than the user's timeout
    minutes = max(1, math.ceil(timeout.total_seconds() / 60)) if timeout is not None else 30
    layout = start(spec.plugin, spec.num_layers, timeout_minutes=minutes)
    chunks = build_chunks(spec, inputs, lora)
    hook_embeddings_for_recompute(chunks, spec.plugin)  # a frozen embedding under recompute (engine/recompute.py)
    # before the engine, which collects the FP8 states (their weights quantized once a step)
    attach_fp8([c.module for c in chunks], spec.plugin)
    iterators = indexed_iterators(spec, inputs, layout)
    return build_engine(spec, inputs, chunks, layout, lora), layout, iterators
