"""Where this process sits in the TP x CP x PP x DP grid, read from Megatron-Core's parallel state.

Below models and engine alike: models build their stage from it, the engine and checkpoints use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the TP x CP x PP x DP grid (dp_*: the data-parallel ranks, which read different
    data; dp_cp_rank: the replicas of a model shard, of which one writes it)."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    # rank among the replicas of this model shard: data parallel x context parallel (context-parallel ranks hold
    # the same weights and differ only in the part of each sequence they see)
    dp_cp_rank: int = 0
    # context-parallel ranks per model shard (world_size = tp_size * cp_size * pp_size * dp_size)
    cp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def current_layout(device: torch.device | None = None) -> Layout:
    ps = parallel_state
    return Layout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        cp_size=ps.get_context_parallel_world_size(),
    )
