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
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .rng_fork import dropout_call
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
        self.sequence_parallel = False  # set by mark_sequence_parallel
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
        if self.split_input:
            return dropout_call(self.dropout, x, dropout_p=self.dropout.p, on_cuda=x.is_cuda,
                                sequence_parallel=self.sequence_parallel)
        return self.dropout(x)

    def up(self, h: torch.Tensor) -> torch.Tensor:
        B = self.lora_B.to(h.dtype) if h.dtype != self.lora_B.dtype else self.lora_B
        return F.linear(h, B) * self.scaling


def mark_sequence_parallel(adapter: LoRAAdapter) -> None:
    """Under SP the replicated parameter sees only this rank's sequence: mark it for the engines' TP
    reduction of such gradients (as megatron-core marks the norms)."""
    whole = adapter.lora_A if adapter.parallel == "column" else adapter.lora_B
    whole.sequence_parallel = True
    adapter.split_input = True
    adapter.sequence_parallel = True


def adapters_of(linear: nn.Module) -> Dict[str, LoRAAdapter]:
    """The enabled adapters on `linear` (empty when it has none)."""
    adapters = getattr(linear, "lora_adapters", None)
    if not adapters:
        return {}
    return {k: a for k, a in adapters.items() if a.enabled}


def _tp_size(linear) -> int:
    group = getattr(linear, "tp_group", None)
    return 1 if group is None else group.size()


def _up_weight(linear, adapters: Sequence[LoRAAdapter], dtype) -> torch.Tensor:
    """One [local output rows, sum of ranks] weight doing every adapter's up-projection at once: each adapter's
    scaled B in its part's rows of `linear`'s fused output (QKV per KV group, [gate; up] per rank), zeros in
    the others. One GEMM of h (the adapters' downs side by side) by it gives the summed delta already laid out
    as the base output, so no delta is built per part and scattered into place: one pass over the large
    output instead of one per part, forward and backward."""
    def scaled(a):
        B = a.lora_B.to(dtype) if a.lora_B.dtype != dtype else a.lora_B
        return B if a.scaling == 1.0 else B * a.scaling

    Bs = [scaled(a) for a in adapters]
    if all(a.part is None for a in adapters):
        return Bs[0] if len(Bs) == 1 else torch.cat(Bs, dim=1)
    names = QKV_PARTS if any(a.part in QKV_PARTS for a in adapters) else GATE_UP_PARTS
    sizes, groups = linear.lora_part_sizes, linear.lora_part_groups
    rows = sum(sizes)
    blocks, start = [], 0
    for name, n in zip(names, sizes):
        cols = []
        for a, B in zip(adapters, Bs):
            if a.part is None:  # a whole adapter: its rows of this part in every group
                cols.append(B.view(groups, rows, a.r)[:, start:start + n])
            elif a.part == name:
                cols.append(B.view(groups, n, a.r))
            else:
                cols.append(B.new_zeros(groups, n, a.r))
        blocks.append(torch.cat(cols, dim=-1))
        start += n
    return torch.cat(blocks, dim=1).reshape(groups * rows, -1)


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


def _column_down(x: torch.Tensor, adapters: Sequence[LoRAAdapter], over_tp) -> torch.Tensor:
    """Every adapter's h over the whole output, side by side ([..., sum of ranks]). Adapters on one input
    without dropout (q, k and v; gate and up) share one GEMM with their A's stacked and one collective."""
    if len(adapters) > 1 and not any(a.training and isinstance(a.dropout, nn.Dropout) for a in adapters):
        A = torch.cat([a.lora_A for a in adapters], dim=0)
        h = F.linear(x, A.to(x.dtype) if A.dtype != x.dtype else A)
    else:
        hs = [a.down(x) for a in adapters]
        h = hs[0] if len(hs) == 1 else torch.cat(hs, dim=-1)
    # every rank's B uses the whole h: its gradient is their sum
    return h if over_tp is None else over_tp(h)


def _column_delta(linear, x: torch.Tensor, adapters: Dict[str, LoRAAdapter], traced: bool) -> torch.Tensor:
    over_tp = _collectives(linear, traced)[0] if _tp_size(linear) > 1 else None
    adapters = list(adapters.values())
    h = _column_down(x, adapters, over_tp)
    return F.linear(h, _up_weight(linear, adapters, h.dtype))


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


class _FrozenLinearWithUp(torch.autograd.Function):
    """out = [x | h] [W | U]^T (+ bias): a frozen weight W and the adapters' up-projection U in one GEMM. The
    output is written once instead of twice and read once more to add them (the largest tensors of a LoRA
    step: the MLP's gate/up output is 8x its input), and the backward's input gradients [dx | dh] come from
    one GEMM reading the output gradient once. Only U gets a weight gradient (W is frozen); [W | U] is built
    again in backward rather than kept."""

    @staticmethod
    def forward(ctx, x, h, weight, up, bias):
        ctx.save_for_backward(x, h, weight, up)
        ctx.has_bias = bias is not None
        return F.linear(torch.cat([x, h], dim=-1), torch.cat([weight, up], dim=1), bias)

    @staticmethod
    def backward(ctx, grad):
        x, h, weight, up = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            grad_x, grad_h = (grad @ torch.cat([weight, up], dim=1)).split([x.shape[-1], h.shape[-1]], dim=-1)
        else:  # nothing before needs it (the first layer of a frozen base)
            grad_x, grad_h = None, grad @ up
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_up = g2.t() @ h.reshape(-1, h.shape[-1])
        grad_bias = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad_x, grad_h, None, grad_up, grad_bias


def fused_column_forward(linear: nn.Module, x: torch.Tensor):
    """A column linear's (output, output bias) with its adapters' up-projection inside the base GEMM
    (`_FrozenLinearWithUp`); None where that does not apply: adapters off, a trainable base weight, TP > 1
    (the adapters' collectives sit between their down and up), an expert linear, autocast (the CPU engine's
    bf16, whose casts the function would not see), and where copying [W | U] costs more than it saves: without
    gradients (evaluation, log-probs, generation) or with fewer tokens than input features (decoding)."""
    adapters = adapters_of(linear)
    weight = getattr(linear, "weight", None)
    if (not adapters or weight is None or weight.requires_grad or not torch.is_grad_enabled()
            or x.numel() < x.shape[-1] * x.shape[-1] or _tp_size(linear) > 1
            or getattr(linear, "explicit_expert_comm", False) or torch.is_autocast_enabled(x.device.type)
            or next(iter(adapters.values())).parallel != "column"):
        return None
    adapters = list(adapters.values())
    h = _column_down(x, adapters, None)
    bias = linear.bias if getattr(linear, "bias", None) is not None and not linear.skip_bias_add else None
    up = _up_weight(linear, adapters, x.dtype)
    weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
    out = _FrozenLinearWithUp.apply(x, h, weight, up, bias)
    return out, (linear.bias if linear.skip_bias_add else None)


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
