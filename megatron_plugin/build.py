"""The second stage of `prepare`: from a checked `RunSpec`, the process groups, this rank's model chunks
carrying the HF weights, the train step and the engine. Collective: every rank runs it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

from . import patches
from .engine.checkpointing.collective import agree
from .engine.cpu import CPUEngine
from .engine.distributed import start
from .engine.gpu import MegatronCoreEngine
from .engine.optimizer import rebuild_optimizer, trainable_flags
from .engine.scheduler import build_scheduler
from .layout import Layout
from .models.convert import mcore_to_hf_sources
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
    args.seq_length = plugin.seq_length or model.family.max_positions(config)
    return args


def build_chunks(spec: RunSpec, inputs: Inputs) -> List[MegatronModel]:
    """This rank's model chunks (one per virtual pipeline stage) with the HF weights, frozen where the HF
    model's parameters are."""
    # a damaged file may be read by some ranks only (pipeline stages read different tensors): every
    # rank raises the error, so none waits in a collective
    chunks = agree(lambda: MegatronModel.chunks_from_hf(inputs.model, spec.plugin, params_dtype=spec.params_dtype,
                                                        reader=spec.reader))
    for chunk in chunks:
        sources = mcore_to_hf_sources(chunk.family, chunk.hf_config, chunk.plan, chunk.variant)
        flags = trainable_flags(inputs.model, inputs.optimizer, sources)
        for name, param in chunk.module.named_parameters():
            param.requires_grad_(flags[name])
    return chunks


def build_engine(spec: RunSpec, inputs: Inputs, chunks: List[MegatronModel], layout: Layout):
    """The CUDA engine (megatron-core's DDP, optimizer and schedules) or the CPU one (torch collectives)."""
    model = chunks[0]
    step_args = megatron_args(spec, model)
    step = spec.step_class(step_args, **spec.step_kwargs)
    if spec.device_type == "cuda":
        engine = MegatronCoreEngine(chunks, inputs.optimizer, inputs.scheduler, spec.plugin, step, layout.device,
                                    spec.dtype, compile_kwargs=spec.compile_kwargs)
    else:
        sources = mcore_to_hf_sources(model.family, model.hf_config, model.plan, model.variant)
        inner = rebuild_optimizer(inputs.optimizer, inputs.model, sources, dict(model.module.named_parameters()))
        sched = build_scheduler(inputs.scheduler, inner, spec.plugin) if inputs.scheduler else None
        engine = CPUEngine(chunks, inner, sched, spec.plugin, step, layout.device, autocast_dtype=spec.dtype)
    engine.megatron_args = step_args
    return engine


def build(spec: RunSpec, inputs: Inputs):
    """-> (engine, layout, the indexed-data iterators: train, validation, test as many as were asked for)."""
    patches.install(*spec.patches)
    layout = start(spec.plugin, spec.num_layers)
    chunks = build_chunks(spec, inputs)
    # collective: megatron-core writes the sample indices on rank 0 first, the others read them
    iterators = (inputs.indexed[0].build(spec.data_sizes, spec.plugin, layout, layout.device, len(inputs.indexed))
                 if inputs.indexed else [])
    return build_engine(spec, inputs, chunks, layout), layout, iterators
