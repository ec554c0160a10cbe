"""Context parallelism's two seams, identity today: where a micro-batch is split along the sequence over
the context-parallel ranks (`shard_sequence`, called once per micro-batch before the model) and where
attention gathers what the split took away (`gather_sequence`, called by `SDPAttention.forward` on its
keys and values). Implementing context parallelism fills in these two functions; until then both, and
`check_context_parallel` at model construction, refuse a context-parallel size other than 1 with the
same message.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..errors import MegatronPluginConfigError

_FIX = "context parallelism is not supported yet; use context_parallel_size=1"


def check_context_parallel(cp_size: int) -> None:
    """Raise, naming the setting, unless `cp_size` is 1 (the only size the seams implement)."""
    if cp_size != 1:
        raise MegatronPluginConfigError("context_parallel_size", cp_size, _FIX)


def shard_sequence(micro_batch: Dict[str, object], cp_size: int, cp_rank: int) -> Dict[str, object]:
    """This context-parallel rank's part of a micro-batch (every [batch, sequence] tensor split along the
    sequence). With one rank that is the whole micro-batch, returned as is (the same object)."""
    check_context_parallel(cp_size)
    return micro_batch


def gather_sequence(key: torch.Tensor, value: torch.Tensor, cp_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The keys and values attention needs ([s, b, groups, dim]) from this rank's part of the sequence:
    every rank's queries attend to the whole sequence's keys, so a split sequence has them gathered here.
    With one rank they are already whole and come back as they are (the same objects)."""
    check_context_parallel(cp_size)
    return key, value
