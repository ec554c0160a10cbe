"""LoRA adapters on our tensor-parallel linears, exact under TP and SP (peft's LoRA, issue 29).

One `LoRAAdapter` stands for one HF target module (peft's `lora_A` / `lora_B` of e.g. `q_proj`) on one of
our linears; a linear holds its adapters as `linear.lora_adapters`, an `nn.ModuleDict` keyed by the HF leaf
name, and `layers/linear.py` adds `lora_delta(linear, x)` to the base output.

Tensor parallelism, kept exact and cheap (the collectives move [s, b, r] tensors, never activations):
- column-parallel linear: A whole [r, in] (replicated), B split with the output [out_local, r]. Without SP,
  h = A x is copied into the TP region (its gradient is summed over TP, so A's gradient is whole on
  every rank); with SP, h is computed on the local sequence and gathered (the gradient reduce-scattered),
  so A's gradient is this rank's sequence only: A is marked `sequence_parallel`, reduced like the norms.
- row-parallel linear: A split with the input [r, in_local], B whole [out, r]. h = A_local x_local is
  summed over TP (all-reduce; with SP reduce-scattered over the sequence like the base output, B then
  marked `sequence_parallel`), then B h is added after the base's own reduction.
- A fused linear (Megatron's QKV grouped per KV head, [q of the group's heads, k, v] per group; gate/up
  as [gate shard; up shard]) with adapters on some of its parts gets each part's output placed into its
  rows, zeros in the others: an adapter on `q_proj` touches exactly the query rows.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .sp_comm import gather_first_dim, reduce_scatter_first_dim

# Parts of a fused output, in the order Megatron lays them out per group (QKV) or per rank (gate/up).
QKV_PARTS = ("q", "k", "v")
GATE_UP_PARTS = ("gate", "up")


class LoRAAdapter(nn.Module):
    """peft's LoRA for one HF module on one of our linears: `scaling * B(A(dropout(x)))`.

    `lora_A` [r, in_local] and `lora_B` [out_local, r] are this TP rank's shards (see the module doc).
    `part`: which part of a fused output it writes ('q', 'k', 'v', 'gate', 'up'), None for the whole.
    `parallel`: 'column' or 'row', the kind of linear it sits on."""

    def __init__(self, r: int, in_features: int, out_features: int, scaling: float, dropout: float = 0.0, *,
                 parallel: str, part: Optional[str] = None, dtype=torch.float32, device=None):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel={parallel!r}")
        self.r, self.scaling, self.parallel, self.part = r, float(scaling), parallel, part
        self.lora_A = nn.Parameter(torch.zeros(r, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, dtype=dtype, device=device))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        self.split_input = parallel == "row"
        # the split parameter carries megatron-core's TP attributes (grad norm, optimizer sharding)
        split, whole = (self.lora_B, self.lora_A) if parallel == "column" else (self.lora_A, self.lora_B)
        split.tensor_model_parallel, split.partition_stride = True, 1
        split.partition_dim = 0 if parallel == "column" else 1
        whole.tensor_model_parallel, whole.partition_dim, whole.partition_stride = False, -1, 1

    def reset_parameters(self):
        """peft's default init: A Kaiming-uniform (a=sqrt(5)), B zero (the model starts as the base)."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def extra_repr(self) -> str:
        return (f"r={self.r}, A={tuple(self.lora_A.shape)}, B={tuple(self.lora_B.shape)}, scaling={self.scaling}, "
                f"parallel={self.parallel}, part={self.part}")

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's h = A dropout(x), before any collective."""
        return F.linear(self._drop(x), self.lora_A.to(x.dtype) if x.dtype != self.lora_A.dtype else self.lora_A)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """peft's dropout of the adapter's input. An input split over TP ranks (a row linear's features, a
        column linear's sequence under SP) takes its mask from megatron-core's model-parallel RNG stream on
        CUDA, as mcore's own dropouts there do; a replicated one from the default stream, alike on every TP
        rank."""
        if not (self.training and isinstance(self.dropout, nn.Dropout)):
            return x
        if self.split_input and x.is_cuda and _tp_world_size() > 1:  # the fork: a graph break when compiled
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker()
            if tracker.is_initialized():
                with tracker.fork():
                    return self.dropout(x)
        return self.dropout(x)

    def up(self, h: torch.Tensor) -> torch.Tensor:
        B = self.lora_B.to(h.dtype) if h.dtype != self.lora_B.dtype else self.lora_B
        return F.linear(h, B) * self.scaling


def _tp_world_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


def mark_sequence_parallel(adapter: LoRAAdapter) -> None:
    """Under SP the replicated parameter sees only this rank's sequence: mark it for the engines' TP
    reduction of such gradients (as megatron-core marks the norms)."""
    whole = adapter.lora_A if adapter.parallel == "column" else adapter.lora_B
    whole.sequence_parallel = True
    adapter.split_input = True


def adapters_of(linear: nn.Module) -> Dict[str, LoRAAdapter]:
    """The enabled adapters on `linear` (empty when it has none)."""
    adapters = getattr(linear, "lora_adapters", None)
    if not adapters:
        return {}
    return {k: a for k, a in adapters.items() if a.enabled}


def _tp_size(linear) -> int:
    group = getattr(linear, "tp_group", None)
    return 1 if group is None else group.size()


def _place(linear, parts: Dict[Optional[str], torch.Tensor]) -> torch.Tensor:
    """The outputs of part adapters ([..., rows of that part on this rank]) laid into the fused rows of
    `linear`'s local output, zeros where no adapter writes."""
    if None in parts:
        whole = parts.pop(None)
        return whole if not parts else whole + _place(linear, parts)
    names = QKV_PARTS if next(iter(parts)) in QKV_PARTS else GATE_UP_PARTS
    sizes = linear.lora_part_sizes  # rows of each part per group (QKV) or per rank (gate/up)
    groups = linear.lora_part_groups
    lead = next(iter(parts.values())).shape[:-1]
    like = next(iter(parts.values()))
    pieces = []
    for name, n in zip(names, sizes):
        t = parts.get(name)
        pieces.append(like.new_zeros(*lead, groups, n) if t is None else t.reshape(*lead, groups, n))
    return torch.cat(pieces, dim=-1).reshape(*lead, -1)


class _CopyTraced(torch.autograd.Function):
    """Identity forward, gradient summed over TP: mcore's copy-to-TP-region with `compiled_linear`'s op,
    which a compiled graph calls without breaking."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        from .compiled_linear import _all_reduce_op

        return _all_reduce_op(grad, ctx.group), None


class _GatherTraced(torch.autograd.Function):
    """All-gather over the sequence, gradient reduce-scattered, with `compiled_linear`'s ops."""

    @staticmethod
    def forward(ctx, x, group):
        from .compiled_linear import _gather_seq_op

        ctx.group = group
        return _gather_seq_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        from .compiled_linear import _reduce_scatter_seq_op

        return _reduce_scatter_seq_op(grad, ctx.group), None


def _collectives(linear, traced: bool):
    """(column's h over TP, row's h over TP) for this linear: mcore's / sp_comm's autograd collectives,
    or with `traced` (inside a compiled layer whose linears run as `compiled_linear` ops) the same sums
    as ops the compiled graph calls in place."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               reduce_from_tensor_model_parallel_region)

    sp = bool(getattr(linear, "sequence_parallel", False))
    if traced:
        from .compiled_linear import group_name, tp_reduce

        name = group_name(linear.tp_group)
        column = (lambda h: _GatherTraced.apply(h, name)) if sp else (lambda h: _CopyTraced.apply(h, name))
        return column, lambda h: tp_reduce(h, name, scatter_seq=sp)
    group = linear.tp_group
    if sp:
        return (lambda h: gather_first_dim(h, group)), (lambda h: reduce_scatter_first_dim(h, group))
    return (lambda h: copy_to_tensor_model_parallel_region(h.contiguous(), group=group),
            lambda h: reduce_from_tensor_model_parallel_region(h.contiguous(), group=group))


def _column_downs(x: torch.Tensor, adapters: Sequence[LoRAAdapter], over_tp) -> List[torch.Tensor]:
    """Each adapter's h over the whole output. Adapters on one input without dropout (q, k and v; gate and
    up) share one GEMM with their A's stacked and one collective: fewer, larger kernels for the same sums."""
    if len(adapters) > 1 and not any(a.training and isinstance(a.dropout, nn.Dropout) for a in adapters):
        A = torch.cat([a.lora_A for a in adapters], dim=0)
        h = F.linear(x, A.to(x.dtype) if A.dtype != x.dtype else A)
        if over_tp is not None:
            h = over_tp(h)
        return list(h.split([a.r for a in adapters], dim=-1))
    hs = [a.down(x) for a in adapters]
    # every rank's B uses the whole h: its gradient is their sum
    return hs if over_tp is None else [over_tp(h) for h in hs]


def _column_delta(linear, x: torch.Tensor, adapters: Dict[str, LoRAAdapter], traced: bool) -> torch.Tensor:
    over_tp = _collectives(linear, traced)[0] if _tp_size(linear) > 1 else None
    parts = {}
    for a, h in zip(adapters.values(), _column_downs(x, list(adapters.values()), over_tp)):
        y = a.up(h)
        parts[a.part] = parts[a.part] + y if a.part in parts else y
    return _place(linear, parts)


def _row_delta(linear, x: torch.Tensor, adapters: Dict[str, LoRAAdapter], traced: bool) -> torch.Tensor:
    over_tp = _collectives(linear, traced)[1] if _tp_size(linear) > 1 else None
    out = None
    for a in adapters.values():
        h = a.down(x)
        if over_tp is not None:
            h = over_tp(h)
        y = a.up(h)
        out = y if out is None else out + y
    return out


def lora_delta(linear: nn.Module, x: torch.Tensor, traced: bool = False) -> Optional[torch.Tensor]:
    """What the enabled adapters on `linear` add to its output for input `x` (the linear's own input:
    the local sequence under SP for a column linear, the TP-split features for a row linear), laid out as
    the base output after its reduction; None when no adapter is on and enabled. `traced`: TP collectives
    as `compiled_linear`'s ops (for a compiled layer whose linears run as ops)."""
    adapters = adapters_of(linear)
    if not adapters:
        return None
    kind = next(iter(adapters.values())).parallel
    return (_column_delta if kind == "column" else _row_delta)(linear, x, adapters, traced)


def set_fused_layout(linear: nn.Module, part_sizes: Sequence[int], groups: int) -> None:
    """Tell `linear` how its local output rows split into parts: `groups` repeats of `part_sizes` rows
    (QKV: local KV groups x [q rows, k rows, v rows] of one group; gate/up: 1 x [gate rows, up rows])."""
    linear.lora_part_sizes = tuple(int(n) for n in part_sizes)
    linear.lora_part_groups = int(groups)


def attach(linear: nn.Module, name: str, adapter: LoRAAdapter) -> LoRAAdapter:
    """Put `adapter` on `linear` under the HF leaf name `name` (e.g. 'q_proj')."""
    if getattr(linear, "lora_adapters", None) is None:
        linear.lora_adapters = nn.ModuleDict()
    if name in linear.lora_adapters:
        raise ValueError(f"{name!r} already has an adapter on this linear")
    linear.lora_adapters[name] = adapter
    return adapter


def iter_adapters(module: nn.Module) -> Iterator[Tuple[str, LoRAAdapter]]:
    """(qualified name, adapter) for every adapter under `module`."""
    for name, m in module.named_modules():
        if isinstance(m, LoRAAdapter):
            yield name, m


def set_lora_enabled(module: nn.Module, enabled: bool) -> None:
    """Switch every adapter under `module` on or off (off: the base model, peft's `disable_adapter`)."""
    for _, a in iter_adapters(module):
        a.enabled = bool(enabled)


@contextlib.contextmanager
def lora_disabled(module: nn.Module):
    """Run `module` as its base model inside the block (the KL reference without a weight snapshot), as
    peft's `with model.disable_adapter():`; each adapter's previous switch is restored after."""
    adapters = [a for _, a in iter_adapters(module)]
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield module
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was
