"""HF-named weights out of the running TP/PP model, one tensor at a time.

`iter_hf_weights` walks the model in order, stage by stage: the stage that holds a tensor all-gathers it
over its TP ranks and converts it (vocabulary padding removed, fused QKV / gate-up split back), then, with
pipeline stages, broadcasts it to the other stages. Every rank of a model replica sees every tensor,
named and shaped as in the HF model that was prepared; none holds more than one at a time. It feeds
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
from .checkpointing.collective import agree
from .hf_io import HFShardWriter, parse_size


def iter_hf_weights(engine, grads: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank; collective: every rank of the
    replica must consume it to the end. With `grads`, the parameters' gradients. A tensor may share
    memory with the live parameter (TP=1, no conversion): copy it if you keep it past the next step."""
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
            yield name[strip:], tensor


def _plan_check(engine):
    if getattr(engine, "chunks", None) is None:
        raise MegatronPluginConfigError("model", type(engine).__name__, "pass the model accelerator.prepare returned")


def save_model(engine, save_directory: str, max_shard_size="10GB", safe_serialization: bool = True) -> str:
    """Write the model as an HF checkpoint (config, sharded safetensors, index) that `from_pretrained`
    loads. Collective over every rank; only global rank 0 writes, one shard in memory at a time."""
    _plan_check(engine)
    if not safe_serialization:
        raise MegatronPluginConfigError("safe_serialization", False, "save_model writes safetensors only: pass True")
    parse_size(max_shard_size)
    rank = dist.get_rank()
    directory = os.path.abspath(save_directory)
    agree(lambda: check_writable(directory, "save_model(save_directory)") if rank == 0 else None)
    writer = None
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        writer = HFShardWriter(directory, max_shard_size)
    # every data-parallel replica walks its own copy; only replica 0's tensors are written
    first_replica = parallel_state.get_data_parallel_rank() == 0
    if first_replica:
        for name, tensor in iter_hf_weights(engine):
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
    _plan_check(engine)
    return {name: tensor.clone() for name, tensor in iter_hf_weights(engine)}


