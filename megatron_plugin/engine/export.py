"""HF-named weights out of the running TP/PP model, one tensor at a time.

`iter_hf_weights` walks the model in order, stage by stage: the stage that holds a tensor all-gathers it
over its TP ranks and converts it (vocabulary padding removed, fused QKV / gate-up split back), then, with
pipeline stages, broadcasts it to the other stages. Every rank of a model replica sees every tensor,
named and shaped as in the HF model that was prepared (MoE experts one tensor per expert, under the names
HF checkpoints use, gathered over the expert-parallel ranks too); none holds more than one at a time. It feeds
`save_model` (sharded safetensors written by global rank 0), `get_state_dict`, and weight pushes into
inference engines (`engine.iter_hf_weights()`).
"""

from __future__ import annotations

import os
from typing import Iterator, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..fs import check_writable
from ..models.convert import _mcore_state, hf_tensor_headers, iter_hf_tensors
from ..models.modeling import experts_laid_apart
from .checkpointing.collective import agree
from .hf_io import HFShardWriter, parse_size


def iter_hf_weights(engine, grads: bool = False, merge_lora: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank; collective: every rank of the
    replica must consume it to the end. With `grads`, the parameters' gradients. A tensor may share
    memory with the live parameter (TP=1, no conversion): copy it if you keep it past the next step. A LoRA
    model yields its base weights, or with `merge_lora` the weights with the adapters merged in (what a
    rollout engine without LoRA needs)."""
    _plan_check(engine, "iter_hf_weights")  # here, not at the first tensor: the generator below starts late
    merge = None
    if merge_lora:
        if getattr(engine, "lora", None) is None or grads:
            raise MegatronPluginConfigError(
                "iter_hf_weights(merge_lora)", True,
                "it merges a LoRA model's adapters into its weights: leave it out for a model without adapters or "
                "with grads=True",
            )
        from .lora import lora_merger

        merge = lora_merger(engine)  # collective, so here rather than at the generator's first step
    return _iter_hf_weights(engine, grads, merge)


def _iter_hf_weights(engine, grads: bool, merge=None) -> Iterator[Tuple[str, torch.Tensor]]:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunks = list(engine.chunks)
    vpp = len(chunks)
    first = chunks[0]
    strip = len(first.family.prefix(first.variant))
    pp_group = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None
    for stage in range(pp * vpp):
        owner, index = stage % pp, stage // pp
        if owner == pp_rank:
            chunk = chunks[index]
            headers = hf_tensor_headers(chunk.family, chunk.hf_config, chunk.plan, chunk.dims, chunk.variant, tp,
                                        _mcore_state(chunk.module))
            tensors = iter_hf_tensors(chunk.module, chunk.family, chunk.hf_config, chunk.plan, chunk.dims,
                                      variant=chunk.variant, grads=grads)
        else:
            headers, tensors = None, None
        if pp > 1:
            box = [headers]
            dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            headers = box[0]
        for name, shape, dtype in headers:
            if tensors is not None:
                got, tensor = next(tensors)
                assert got == name, (got, name)
            else:
                tensor = torch.empty(shape, dtype=dtype, device=engine.device)
            if pp > 1:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            yield name[strip:], (tensor if merge is None else merge(name[strip:], tensor))


def _plan_check(engine, what: str):
    """Refuse `what` before any collective: for anything but the prepared model, or for model chunks that a
    custom_model_provider_function built and the mapping tables do not describe."""
    if getattr(engine, "chunks", None) is None:
        raise MegatronPluginConfigError("model", type(engine).__name__, "pass the model accelerator.prepare returned")
    for chunk in engine.chunks:
        chunk.check_maps_to_hf(what)


def save_model(engine, save_directory: str, max_shard_size="10GB", safe_serialization: bool = True,
               what: str = "save_model", merge_lora: bool = False) -> str:
    """Write the model as an HF checkpoint (config, sharded safetensors, index) that `from_pretrained`
    loads. Collective over every rank; only global rank 0 writes, one shard in memory at a time. A model
    prepared from a peft PeftModel writes its PEFT adapter folder instead (`PeftModel.from_pretrained(base,
    dir)` loads it), or with `merge_lora` the full HF weights with the adapters merged in (peft's
    merge_and_unload, then save_pretrained)."""
    _plan_check(engine, what)
    if not safe_serialization:
        raise MegatronPluginConfigError("safe_serialization", False, "save_model writes safetensors only: pass True")
    parse_size(max_shard_size)
    lora = getattr(engine, "lora", None)
    if merge_lora and lora is None:
        raise MegatronPluginConfigError(f"{what}(merge_lora)", True,
                                        "the model has no LoRA adapters to merge: leave merge_lora out")
    rank = dist.get_rank()
    directory = os.path.abspath(save_directory)
    agree(lambda: check_writable(directory, f"{what}(save_directory)") if rank == 0 else None)
    if lora is not None and not merge_lora:
        from .lora import save_adapter_folder

        return save_adapter_folder(engine, directory)
    merge = None
    if merge_lora:
        from .lora import lora_merger

        # on every rank, before the replica filter below: the adapters' fp32 masters (bf16 runs) may be sharded
        # over the data-parallel ranks (distributed optimizer), which put them back together
        merge = lora_merger(engine, masters=True)
    writer = None
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        writer = HFShardWriter(directory, max_shard_size)
    # every data-parallel replica walks its own copy; only replica 0's tensors are written. With experts laid
    # out apart (split over expert-parallel ranks or another expert TP size), whose groups span ranks of
    # different replicas, the experts are gathered over those: every replica walks then, with its peers
    first_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0  # CP ranks: replicas too
    if first_replica or any(experts_laid_apart(chunk.plan) for chunk in engine.chunks):
        for name, tensor in _iter_hf_weights(engine, False, merge):
            if writer is not None:
                writer.add(name, tensor)
    if writer is not None:
        writer.finish()
        model = engine.model
        config = model.hf_config
        config.architectures = [model.family.classes[model.variant]]
        config.save_pretrained(directory)
    dist.barrier()
    return directory


def full_state_dict(engine) -> dict:
    """The whole model's HF state dict on every rank (gathered over TP, broadcast over PP stages)."""
    _plan_check(engine, "get_state_dict")
    return {name: tensor.clone() for name, tensor in iter_hf_weights(engine)}


def save_pretrained(engine, save_directory: str, is_main_process: bool = True, state_dict=None, push_to_hub: bool = False,
                    max_shard_size="10GB", variant=None, save_function=None, safe_serialization: bool = True,
                    merge_lora: bool = False, **kwargs) -> str:
    """`unwrap_model(model).save_pretrained(dir, ...)` as HF scripts call it: the HF checkpoint
    `accelerator.save_model` writes, which `from_pretrained` loads. Collective: every rank calls it, as
    scripts do when they pass `is_main_process=accelerator.is_main_process` (accepted, like
    `save_function=accelerator.save`: global rank 0 writes, safetensors). A script that calls it on the main
    process only leaves the other ranks out of the gather."""
    if state_dict is not None:
        raise MegatronPluginConfigError(
            "save_pretrained(state_dict)", type(state_dict).__name__,
            "the weights are gathered from the tensor- and pipeline-parallel model: leave state_dict out "
            "(accelerator.get_state_dict(model) gives the full HF state dict if you need it)",
        )
    if push_to_hub:
        raise MegatronPluginConfigError("save_pretrained(push_to_hub)", True,
                                        "write the folder, then upload it with huggingface_hub")
    if variant is not None or kwargs.get("distributed_checkpoint"):
        name = "variant" if variant is not None else "distributed_checkpoint"
        raise MegatronPluginConfigError(f"save_pretrained({name})", variant if variant is not None else True,
                                        "not supported for the Megatron model: leave it out")
    # HF's options that change nothing in what is written here
    unknown = sorted(set(kwargs) - {"token", "save_peft_format", "save_original_format", "distributed_checkpoint",
                                    "selected_adapters", "save_embedding_layers"})
    if unknown:
        raise MegatronPluginConfigError(f"save_pretrained({unknown[0]})", kwargs[unknown[0]],
                                        "not supported for the Megatron model: leave it out")
    return save_model(engine, save_directory, max_shard_size, safe_serialization, what="save_pretrained",
                      merge_lora=merge_lora)
