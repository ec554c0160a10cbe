"""Collectives mcore only offers on CUDA (its gathers allocate on `torch.cuda.current_device()`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def all_reduce_in_place(tensors, group, op=dist.ReduceOp.SUM) -> None:
    """All-reduce a list of tensors (gradients) as one flat buffer, the results copied back in one foreach launch
    per dtype (layers/foreach_ops.copy_): one collective and a few launches, however many tensors."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from .foreach_ops import copy_

    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, op=op, group=group)
    copy_(list(tensors), list(_unflatten_dense_tensors(flat, tensors)))


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def gather_tensor_parallel_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' slices of the last dimension (e.g. vocab-parallel logits), on any
    device; the backward hands each rank its own slice of the gradient."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return x
    return _GatherLastDim.apply(x, group)


class _AllGatherLastDim(_GatherLastDim):
    """All-gather along the last dimension whose backward sums every rank's gradient (reduce-scatter):
    for tensors that each rank goes on to use differently."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


@torch.compiler.disable
def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """mcore's `all_gather_last_dim_from_tensor_parallel_region`, on any device (eager under torch.compile,
    as the TP linears are)."""
    group = group or parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return x
    return _AllGatherLastDim.apply(x, group)


class _ScatterDim(torch.autograd.Function):
    """This rank's slice of a tensor every TP rank holds whole; the backward gathers the slices' grads."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=dim)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


def scatter_to_tensor_parallel_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This TP rank's part of `x` along `dim` (e.g. its attention heads of a position bias), on any device."""
    group = group or parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return x
    return _ScatterDim.apply(x, dim, group)
