"""Batches of data-parallel replicas that share MoE experts must have one shape.

With expert_model_parallel_size > 1 the ranks of an expert-parallel group belong to different data-parallel
replicas, and every MoE layer gathers the tokens of the whole group (layers/moe.py): each rank's
micro-batch must then have as many tokens as its peers', or the gather fails (gloo) or waits forever (NCCL).
Batches padded per replica to their own longest row (HF's dynamic padding) differ. This check compares the
micro-batches' shapes over the group before a step or a log-probs pass, so every rank raises the same clear
error instead. It costs one small all-gather (and, on CUDA, one host read) per call, only where the group
spans replicas.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError


def spanning_group(model) -> Optional[dist.ProcessGroup]:
    """The expert tensor x expert parallel group when `model` has MoE layers and that group holds ranks of
    other data-parallel replicas; else None (no check needed). No collective."""
    if not getattr(model.config, "num_moe_experts", None):
        return None
    group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return None
    replica = set(dist.get_process_group_ranks(parallel_state.get_model_parallel_group()))
    return None if set(dist.get_process_group_ranks(group)) <= replica else group


def check_same_shapes(engine, micro_batches, step, what: str) -> None:
    group = spanning_group(engine.model)
    if group is None or not micro_batches:
        return
    mine = torch.tensor([step.schedule_shape(mb) for mb in micro_batches], dtype=torch.long)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    # gloo takes CPU tensors; NCCL needs them on the device
    device = engine.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    gathered = [p.to(device) for p in parts]
    dist.all_gather(gathered, mine.to(device), group=group)
    shapes = [tuple(map(tuple, g.cpu().tolist())) for g in gathered]
    if any(s != shapes[0] for s in shapes):
        raise MegatronPluginConfigError(
            what, f"micro-batches of (rows, tokens) {sorted(set(shapes))} on the ranks of one expert-parallel group",
            "with expert_model_parallel_size > 1 the data-parallel ranks of an expert-parallel group route their "
            "tokens together: pad every batch to one length (e.g. the tokenizer's padding='max_length', or a "
            "collator padding to a fixed max_length), or use expert_model_parallel_size=1",
        )
