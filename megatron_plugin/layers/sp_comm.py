"""Sequence-parallel collectives along the first (sequence) dimension on any device. megatron-core's
allocate their outputs on `torch.cuda.current_device()` (or its CUDA buffer), and gloo has no
reduce-scatter; on CPU these run as all-gather and all-reduce + slice, with the same autograd."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_rows(x: torch.Tensor, group, split_sizes=None) -> torch.Tensor:
    """All-gather along dim 0 without autograd; `split_sizes` (rows per rank) for uneven parts, which
    gloo's all_gather cannot take: each part is padded to the largest and the padding cut off."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    if split_sizes is None:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)
    longest = max(split_sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, split_sizes)], dim=0)


def reduce_scatter_rows(x: torch.Tensor, group, split_sizes=None) -> torch.Tensor:
    """Sum over ranks and keep this rank's rows, without autograd (all-reduce + slice: gloo has no
    reduce-scatter); `split_sizes` (rows per rank) for uneven parts."""
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    rank = dist.get_rank(group)
    if split_sizes is None:
        return x.chunk(dist.get_world_size(group), dim=0)[rank].contiguous()
    start = sum(split_sizes[:rank])
    return x[start:start + split_sizes[rank]].contiguous()


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0. The backward, with `reduce_grad`, sums every rank's gradient of this rank's
    rows (reduce-scatter); without, it keeps this rank's rows of the gradient (the gathered tensor's
    consumer ran the same on every rank, as mcore's `tensor_parallel_output_grad=False`)."""

    @staticmethod
    def forward(ctx, x, group, reduce_grad=True):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_rows(grad, ctx.group), None, None
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=0)[rank].contiguous(), None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Sum over ranks, keep this rank's rows; the backward all-gathers the rows' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad, ctx.group), None


def _tp_if_none(group):
    # as mcore's mappings: no group means the tensor-parallel one
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def gather_first_dim(x: torch.Tensor, group, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """mcore's `gather_from_sequence_parallel_region` (all-gather along dim 0; backward reduce-scatter, or
    with `tensor_parallel_output_grad=False` this rank's rows of the gradient) on any device: on CUDA
    mcore's own, elsewhere through collectives gloo has."""
    if x.is_cuda:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(x, group=group, tensor_parallel_output_grad=tensor_parallel_output_grad)
    group = _tp_if_none(group)
    if dist.get_world_size(group) == 1:
        return x
    return _GatherFirstDim.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """mcore's `reduce_scatter_to_sequence_parallel_region` (backward all-gather) on any device."""
    if x.is_cuda:
        from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region

        return reduce_scatter_to_sequence_parallel_region(x, group=group)
    group = _tp_if_none(group)
    if dist.get_world_size(group) == 1:
        return x
    return _ReduceScatterFirstDim.apply(x, group)
