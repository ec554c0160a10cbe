"""Context parallelism (CP): a micro-batch's sequence split over the CP ranks, and what attention, the
loss and the outputs need back from the other ranks.

Layout (megatron-core's `get_batch_on_this_cp_rank`): a sequence of length s is cut into 2*CP chunks of
L = s / (2*CP); CP rank r holds chunks r and 2*CP-1-r, concatenated (2L tokens). Under a causal mask the
late chunks see more keys than the early ones; pairing one of each gives every rank the same work.

The split happens once per micro-batch (`shard_sequence`); the local `input_ids` then carries a
`SequenceShard` (attribute `SHARD`) that says where its tokens are in the whole sequence and keeps the
WHOLE padding mask and position ids, from which the model builds its queries' masks over every key.
Attention gathers keys and values (`gather_sequence`); the engine gathers outputs (`unshard`) and sums
token counts (`tokens_over_context_parallel`). At CP=1 every function here hands back what it was given.

The collectives run on gloo (CPU) and NCCL: gloo has no reduce-scatter (all-reduce + slice there), and
nothing on the CPU path touches torch.cuda.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

import torch
import torch.distributed as dist

from ..errors import MegatronPluginConfigError

# the attribute under which a sharded `input_ids` carries its SequenceShard (as layers/masks.KNOWN on masks)
SHARD = "_megatron_plugin_cp_shard"


def check_context_parallel(cp_size) -> None:
    """Raise, naming the setting, unless `cp_size` is a whole number >= 1."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise MegatronPluginConfigError("context_parallel_size", cp_size,
                                        "pass a whole number >= 1 (1: no context parallelism)")


def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """Refuse a sequence the 2*CP chunks cannot split evenly (the engine does not pad)."""
    if seq_len % (2 * cp_size):
        raise MegatronPluginConfigError(
            "context_parallel_size", cp_size,
            f"the sequence length {seq_len} is not a multiple of 2*context_parallel_size = {2 * cp_size}: pad "
            f"sequences to a multiple of {2 * cp_size}, e.g. pad_to_multiple_of={2 * cp_size} in the collator",
        )


def cp_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of CP rank `cp_rank`'s tokens ([2L] long): chunk r, then chunk 2*CP-1-r."""
    check_context_parallel(cp_size)
    check_sequence_length(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat((first, torch.arange(last * chunk, (last + 1) * chunk, device=device)))


@dataclasses.dataclass(eq=False)  # holds tensors: compared by identity
class SequenceShard:
    """Where a CP rank's tokens sit in the whole sequence, and the whole sequence's masks for its keys."""

    cp_size: int
    cp_rank: int
    group: object  # the CP process group (None only in one-process tests of the layout)
    seq_len: int  # the WHOLE sequence's length
    index: torch.Tensor  # cp_index(seq_len, cp_size, cp_rank) on the batch's device
    attention_mask: Optional[torch.Tensor] = None  # WHOLE [b, s] HF padding mask
    position_ids: Optional[torch.Tensor] = None  # WHOLE [b, s]


def shard_of(tensor) -> Optional[SequenceShard]:
    """The SequenceShard a sharded `input_ids` carries, or None (CP=1, or a tensor not from shard_sequence)."""
    return getattr(tensor, SHARD, None)


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group(check_initialized=False)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def shard_sequence(micro_batch: Dict[str, object], cp_size: int, cp_rank: int,
                   input_key: str = "input_ids") -> Dict[str, object]:
    """This CP rank's part of a micro-batch. CP=1: the same object, untouched. CP>1: a new dict in which
    every tensor whose dim 1 is as long as `micro_batch[input_key]`'s sequence is cut to this rank's
    tokens (`cp_index`, along dim 1): input ids, labels, masks, position ids ... are all LOCAL; the local
    input ids carry the SequenceShard (with the WHOLE attention_mask and position_ids). Anything else
    passes as it is."""
    check_context_parallel(cp_size)
    if cp_size == 1:
        return micro_batch
    ids = micro_batch.get(input_key)
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise MegatronPluginConfigError(
            "context_parallel_size", cp_size,
            f"context parallelism splits the batch's {input_key!r} [batch, sequence] along the sequence: pass it "
            "(or use context_parallel_size=1)",
        )
    s = ids.shape[1]
    index = cp_index(s, cp_size, cp_rank, device=ids.device)
    out = {}
    for key, value in micro_batch.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == s:
            value = value.index_select(1, index)
        out[key] = value
    whole = {k: micro_batch.get(k) for k in ("attention_mask", "position_ids")}
    whole = {k: v if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == s else None for k, v in whole.items()}
    setattr(out[input_key], SHARD, SequenceShard(cp_size, cp_rank, _cp_group(), s, index, **whole))
    return out


# -- gathering along the sequence -----------------------------------------------------------------

def _global_from_gathered(cp_size: int) -> list:
    # rank-major gathered chunks are [r0: c0, c(2CP-1) | r1: c1, c(2CP-2) | ...]; global chunk c is at
    # 2c (first half of rank c) or 2(2CP-1-c)+1 (second half of rank 2CP-1-c)
    return [2 * c if c < cp_size else 2 * (2 * cp_size - 1 - c) + 1 for c in range(2 * cp_size)]


def _gathered_from_global(cp_size: int) -> list:
    order = _global_from_gathered(cp_size)
    inverse = [0] * len(order)
    for c, j in enumerate(order):
        inverse[j] = c
    return inverse


def _reorder_chunks(x: torch.Tensor, order: list) -> torch.Tensor:
    """x [n * L, ...] as n chunks along dim 0, in the order given (one copy). Views and a cat, not an
    index tensor: building one on the GPU from a list would wait for the stream at every layer."""
    chunks = x.chunk(len(order))
    return torch.cat([chunks[j] for j in order])


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    x = x.contiguous()
    if x.is_cuda:
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    x = x.contiguous()
    if x.is_cuda:
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    x = x.clone()
    dist.all_reduce(x, group=group)  # gloo has no reduce-scatter
    return x.chunk(size)[dist.get_rank(group)].contiguous()


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group, put in global sequence order. The backward, with
    `reduce_grad`, sums every rank's gradient of this rank's rows (reduce-scatter: each rank's consumer
    differs, as attention's queries over gathered keys and values); without, it takes this rank's rows
    of its own gradient (every rank consumes the gathered tensor the same way)."""

    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        size = dist.get_world_size(group)
        return _reorder_chunks(_all_gather_rows(x, group), _global_from_gathered(size))

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        grad = _reorder_chunks(grad.contiguous(), _gathered_from_global(size))
        if ctx.reduce_grad:
            return _reduce_scatter_rows(grad, ctx.group), None, None
        return grad.chunk(size)[rank].contiguous(), None, None


ShardOrSize = Union[SequenceShard, int, None]


def _group_of(shard_or_cp: ShardOrSize):
    size = shard_or_cp.cp_size if isinstance(shard_or_cp, SequenceShard) else shard_or_cp
    if size == 1:
        return None
    group = shard_or_cp.group if isinstance(shard_or_cp, SequenceShard) else _cp_group()
    if group is None and size is not None:
        # gathering nothing would hand back a part as if it were the whole sequence
        raise RuntimeError(f"context parallel size {size} without megatron-core's CP group: initialize it first "
                           "(parallel_state.initialize_model_parallel(context_parallel_size=...))")
    return group


@torch.compiler.disable
def gather_sequence(t: torch.Tensor, shard_or_cp: ShardOrSize, dim: int, reduce_grad: bool = True) -> torch.Tensor:
    """A LOCAL tensor (this rank's 2L positions along `dim`) -> the whole sequence along `dim`, in global
    order, with autograd. `shard_or_cp`: the micro-batch's SequenceShard, or the CP size (1: `t` itself,
    no collective; >1 or None: megatron-core's CP group).

    The backward is exact for either kind of consumer, chosen by `reduce_grad`:
    - True (attention's keys and values): each rank uses the gathered tensor for different queries, so
      this rank's rows get the SUM of every rank's gradient (reduce-scatter);
    - False (e.g. a loss that every rank computes identically from gathered logits): every rank's
      gradient is the same, so this rank keeps its own rows of it (summing would count it CP times)."""
    group = _group_of(shard_or_cp)
    if _size(group) == 1:
        return t
    dim = dim % t.dim()
    if dim == 0:
        return _GatherSequence.apply(t, group, reduce_grad)
    return _GatherSequence.apply(t.movedim(dim, 0), group, reduce_grad).movedim(0, dim)


def unshard(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Outputs in sequence order: the whole sequence along `dim` from this rank's LOCAL part, without
    autograd (returned logits, per-token log-probs). CP=1 (or no CP group): `t` itself."""
    with torch.no_grad():
        return gather_sequence(t.detach(), None, dim)


def tokens_over_context_parallel(count: torch.Tensor) -> torch.Tensor:
    """A token count (a tensor on the count's device) summed over the CP group, without autograd. CP=1:
    `count` itself, no collective."""
    group = _cp_group()
    if _size(group) == 1:
        return count
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return total
