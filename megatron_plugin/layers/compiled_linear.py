"""Megatron's parallel linear for compiled transformer layers, with the weight gradient fused into main_grad.

Inside a compiled layer, mcore's linear autograd function is a problem twice over: its backward writes
the weight gradient into `main_grad` (gradient-accumulation fusion), a side effect the compiler cannot
see, and with TP > 1 it runs collectives into a buffer shared by every layer. Sending it back to eager
(`torch.compiler.disable`) splits each layer into resume frames whose host cost outweighs what
compiling gains (BENCHMARKS.md: 350m compiled with the split 114,807 tok/s against 163,189). Here the
linear is an autograd.Function that the compiler traces: its forward (`F.linear`, after the sequence
all-gather under SP) is compiled with the rest of the layer; its backward, and the TP collectives, are
opaque ops that the compiled graphs call as they are: no graph break, fresh buffers, and the backward
op gets the real parameter (with its main_grad) at run time.

What they compute is what mcore's `LinearWithGradAccumulationAndAsyncCommunication` and its
`reduce_from_tensor_model_parallel_region` / `reduce_scatter_to_sequence_parallel_region` compute; the
process group travels by name (ops take no Python objects).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .wgrad import wgrad_gemm_accum_fp16, wgrad_gemm_accum_fp32

# how the input gradient is combined over the TP group
DGRAD_NONE, DGRAD_ALL_REDUCE, DGRAD_REDUCE_SCATTER = 0, 1, 2

# Ops defined through torch.library.Library, and their autograd as torch.autograd.Function that the
# compiler traces: `torch.library.custom_op` and `register_autograd` each add a Python layer to every
# call (about 30 us apiece on the host), which a compiled step pays 4 times per layer per micro-batch
# in each direction. So the forward linear is plain `F.linear`, compiled with the rest of the layer, and
# only the collectives and the backward (with its side effect on main_grad) are opaque ops.
_lib = torch.library.Library("megatron_plugin", "DEF")


def _define(schema: str, impl, fake):
    name = schema.split("(")[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"megatron_plugin::{name}", fake, lib=_lib)
    return getattr(torch.ops.megatron_plugin, name).default


# for other modules of this package whose backward writes into main_grad (layers/moe.py's grouped experts)
define_op = _define


def _size(group: str) -> int:
    return _resolve_process_group(group).size() if group else 1


# The collectives below do nothing inside Inductor's codegen (`in_inductor_codegen`): the C++ wrapper's tuning run
# of a graph need not happen on every rank alike (a rank that finds the graph in Inductor's cache compiles
# nothing), and a collective there would wait for a peer that never comes. The run's values are thrown away.

def _gather_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-gather along dim 0 (the sequence, under sequence parallelism)."""
    pg = _resolve_process_group(group)
    out = x.new_empty(x.shape[0] * pg.size(), *x.shape[1:])
    if not in_inductor_codegen():
        dist.all_gather_into_tensor(out, x.contiguous(), group=pg)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    pg = _resolve_process_group(group)
    out = x.new_empty(x.shape[0] // pg.size(), *x.shape[1:])
    if not in_inductor_codegen():
        dist.reduce_scatter_tensor(out, x.contiguous(), group=pg)
    return out


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if not in_inductor_codegen():
        dist.all_reduce(out, group=_resolve_process_group(group))
    return out


_gather_seq_op = _define("tp_gather_seq(Tensor x, str group) -> Tensor", _gather_seq,
                         lambda x, group: x.new_empty(x.shape[0] * _size(group), *x.shape[1:]))
_reduce_scatter_seq_op = _define("tp_reduce_scatter_seq(Tensor x, str group) -> Tensor", _reduce_scatter_seq,
                                 lambda x, group: x.new_empty(x.shape[0] // _size(group), *x.shape[1:]))
_all_reduce_op = _define("tp_all_reduce(Tensor x, str group) -> Tensor", _all_reduce,
                         lambda x, group: x.new_empty(x.shape))


# TP communication overlapped with the GEMMs (Megatron's `tp_comm_overlap`, which needs TE's userbuffers there):
# torch's symmetric-memory ops gather (or reduce-scatter) in chunks, each chunk's GEMM running as soon as its
# part has landed. Under sequence parallelism only, where the collectives sit right before or after a GEMM.
# Off CUDA, torch's own reference of the same ops (the collective, then the GEMM) runs instead, for CPU tests.
_SYMM_MEM_GROUPS = set()


def _symm_mem(group: str, cuda: bool):
    import torch.distributed._symmetric_memory as symm_mem

    if cuda and group not in _SYMM_MEM_GROUPS:
        symm_mem.enable_symm_mem_for_group(group)
        _SYMM_MEM_GROUPS.add(group)
    return symm_mem


def _ag_matmul(a: torch.Tensor, b: torch.Tensor, group: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(a gathered along dim 0 over the group, that times b), the gather overlapped with the GEMM."""
    if in_inductor_codegen():  # see _gather_seq
        total = a.new_empty(a.shape[0] * _size(group), a.shape[1])
        return total, a.new_empty(total.shape[0], b.shape[1])
    symm_mem = _symm_mem(group, a.is_cuda)
    fused = symm_mem._fused_all_gather_matmul if a.is_cuda else symm_mem._fused_all_gather_matmul_fallback
    # return_A: the weight gradient needs the gathered input (and it keeps torch off its multicast variant)
    total, (out,) = fused(a.contiguous(), [b], 0, group, return_A=True)
    return total, out


def _matmul_rs(a: torch.Tensor, b: torch.Tensor, group: str) -> torch.Tensor:
    """(a times b) summed over the group, this rank's part of dim 0, the GEMM overlapped with the reduce-scatter."""
    if in_inductor_codegen():
        return a.new_empty(a.shape[0] // _size(group), b.shape[1])
    symm_mem = _symm_mem(group, a.is_cuda)
    fused = symm_mem._fused_matmul_reduce_scatter if a.is_cuda else symm_mem._fused_matmul_reduce_scatter_fallback
    return fused(a.contiguous(), b, "sum", 0, group)


def _ag_linear(x: torch.Tensor, weight: torch.Tensor, group: str) -> torch.Tensor:
    """A column-parallel linear's forward under SP: x [s / tp, ..., h] gathered over the sequence, times
    weight.T; the result [s, ..., out / tp]."""
    _, out = _ag_matmul(x.reshape(-1, x.shape[-1]), weight.t(), group)
    return out.view(x.shape[0] * _size(group), *x.shape[1:-1], weight.shape[0])


def _linear_rs(x: torch.Tensor, weight: torch.Tensor, group: str) -> torch.Tensor:
    """A row-parallel linear's forward under SP: x [s, ..., in / tp] times weight.T, summed over TP, this rank's
    part of the sequence [s / tp, ..., out]."""
    out = _matmul_rs(x.reshape(-1, x.shape[-1]), weight.t(), group)
    return out.view(x.shape[0] // _size(group), *x.shape[1:-1], weight.shape[0])


_ag_linear_op = _define("tp_ag_linear(Tensor x, Tensor weight, str group) -> Tensor", _ag_linear,
                        lambda x, weight, group: x.new_empty(x.shape[0] * _size(group), *x.shape[1:-1],
                                                             weight.shape[0]))
_linear_rs_op = _define("tp_linear_rs(Tensor x, Tensor weight, str group) -> Tensor", _linear_rs,
                        lambda x, weight, group: x.new_empty(x.shape[0] // _size(group), *x.shape[1:-1],
                                                             weight.shape[0]))


_VIRTUALIZED = None  # (torch._inductor.virtualized.V, its NullHandler), imported at the first call


def in_inductor_codegen() -> bool:
    """Whether Inductor is compiling a graph right now. Its C++ wrapper runs the graph once while compiling it
    (to tune its kernels), on the call's inputs or on random ones: an op with a side effect (on main_grad) or a
    collective must then do nothing. Asked several times by every TP op call, hundreds a step: the import is
    done once (it was half the call's ~4 us)."""
    global _VIRTUALIZED
    if _VIRTUALIZED is None:
        from torch._inductor.virtualized import NullHandler, V

        _VIRTUALIZED = (V, NullHandler)
    v, null = _VIRTUALIZED
    return not isinstance(v.graph, null)


def into_main_grad(weight: torch.Tensor, write) -> torch.Tensor:
    """`write(main_grad)` adds the weight's gradient into its main_grad (DDP's buffer); returns the placeholder
    gradient that DDP's hook then skips (`grad_added_to_main_grad`). Also for layers/fp8.py's weight gradient."""
    if in_inductor_codegen():
        return torch.empty_like(weight)
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("gradient_accumulation_fusion: a fused linear's weight has no main_grad (DDP's buffer)")
    write(main_grad)
    weight.grad_added_to_main_grad = True
    # a weight shared with the embedding (tied) also gets the lookup's gradient, which the hook adds
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


def accumulate_wgrad(go: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight.main_grad += go^T @ x (2-D views), through `into_main_grad`."""
    def write(main_grad):
        (wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else wgrad_gemm_accum_fp16)(x, go, main_grad)

    return into_main_grad(weight, write)


def _fused_wgrad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return accumulate_wgrad(grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1]),
                             weight)


# Without TP only the weight gradient needs an op (its write into main_grad): the input and bias
# gradients stay in the compiled graph, and the op's call costs less host time (fewer arguments, no list).
_fused_wgrad_op = _define("fused_wgrad(Tensor grad_output, Tensor input, Tensor weight) -> Tensor", _fused_wgrad,
                          lambda grad_output, input, weight: torch.empty_like(weight, memory_format=torch.contiguous_format))


def _linear_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, group: str,
                     gather_input: bool, dgrad: int, fuse_wgrad: bool, has_bias: bool,
                     need_wgrad: bool, overlap: bool = False) -> List[torch.Tensor]:
    """[grad_input, grad_weight, grad_bias]. As mcore overlaps them: the input's gather for the weight gradient
    (SP) runs while the input gradient's GEMM is computed, and the input gradient's collective while the weight
    gradient's is. With `fuse_wgrad` the weight gradient goes into
    weight.main_grad and grad_weight is what DDP's hook then skips (`grad_added_to_main_grad`). With `overlap`
    (SP's gathered input, reduce-scattered input gradient): the input gradient's GEMM and reduce-scatter run as
    one overlapped op while NCCL gathers the input for the weight gradient."""
    if overlap and gather_input and dgrad == DGRAD_REDUCE_SCATTER:
        return _overlapped_column_backward(grad_output, input, weight, group, fuse_wgrad, has_bias, need_wgrad)
    pg = _resolve_process_group(group) if group else None
    talk = not in_inductor_codegen()  # see _gather_seq
    total, gathering = _gather_for_wgrad(input, pg, need_wgrad) if gather_input else (input, None)
    # contiguous, as the fake says: the compiled caller checks strides
    grad_total = (grad_output @ weight).contiguous()
    if gathering is not None:
        gathering.wait()
    handle = None
    if dgrad == DGRAD_ALL_REDUCE:
        grad_input = grad_total
        handle = dist.all_reduce(grad_input, group=pg, async_op=True) if talk else None
    elif dgrad == DGRAD_REDUCE_SCATTER:
        grad_input = grad_total.new_empty(input.shape)
        handle = dist.reduce_scatter_tensor(grad_input, grad_total, group=pg, async_op=True) if talk else None
    else:
        grad_input = grad_total
    go = grad_output.reshape(-1, grad_output.shape[-1])
    grad_weight = _weight_grad(go, total.reshape(-1, total.shape[-1]), weight, fuse_wgrad, need_wgrad)
    grad_bias = go.sum(0) if has_bias else go.new_empty(0)
    if handle is not None:
        handle.wait()
    return [grad_input, grad_weight, grad_bias]


def _weight_grad(go: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, fuse_wgrad: bool,
                 need_wgrad: bool) -> torch.Tensor:
    """go^T @ x (2-D), into main_grad with `fuse_wgrad`; nothing for a frozen weight."""
    if not need_wgrad:
        return torch.empty_like(weight)
    return accumulate_wgrad(go, x, weight) if fuse_wgrad else go.t() @ x


def _gather_for_wgrad(input: torch.Tensor, pg, need_wgrad: bool):
    """(the input gathered over the sequence for the weight gradient, the gather's work to wait for): issued
    asynchronously, so that the input gradient's GEMM runs under it, as mcore's linear does. A frozen weight needs
    no gathered input: (input, None). Nothing is sent inside Inductor's codegen (see _gather_seq)."""
    if not need_wgrad:
        return input, None
    total = input.new_empty(input.shape[0] * pg.size(), *input.shape[1:])
    if in_inductor_codegen():
        return total, None
    return total, dist.all_gather_into_tensor(total, input.contiguous(), group=pg, async_op=True)


def _overlapped_column_backward(grad_output, input, weight, group, fuse_wgrad, has_bias, need_wgrad):
    total, gathering = _gather_for_wgrad(input, _resolve_process_group(group), need_wgrad)
    go = grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = _matmul_rs(go, weight, group).view(input.shape)
    if gathering is not None:
        gathering.wait()
    grad_weight = _weight_grad(go, total.reshape(-1, total.shape[-1]), weight, fuse_wgrad, need_wgrad)
    return [grad_input, grad_weight, go.sum(0) if has_bias else go.new_empty(0)]


def _linear_backward_fake(grad_output, input, weight, group, gather_input, dgrad, fuse_wgrad, has_bias, need_wgrad,
                          overlap=False):
    return [input.new_empty(input.shape), torch.empty_like(weight, memory_format=torch.contiguous_format),
            grad_output.new_empty(grad_output.shape[-1] if has_bias else 0)]


_linear_backward_op = _define(
    "parallel_linear_backward(Tensor grad_output, Tensor input, Tensor weight, str group, bool gather_input, "
    "int dgrad, bool fuse_wgrad, bool has_bias, bool need_wgrad, bool overlap=False) -> Tensor[]",
    _linear_backward, _linear_backward_fake)


def _linear_rs_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, group: str,
                        fuse_wgrad: bool, need_wgrad: bool) -> List[torch.Tensor]:
    """[grad_input, grad_weight] of `_linear_rs`: this rank's part of the output gradient gathered over the
    sequence, overlapped with its GEMM against the weight (the input gradient); the gathered gradient then
    gives the weight gradient."""
    go_total, grad_input = _ag_matmul(grad_output.reshape(-1, grad_output.shape[-1]), weight, group)
    grad_weight = _weight_grad(go_total, input.reshape(-1, input.shape[-1]), weight, fuse_wgrad, need_wgrad)
    return [grad_input.view(input.shape), grad_weight]


_linear_rs_backward_op = _define(
    "tp_linear_rs_backward(Tensor grad_output, Tensor input, Tensor weight, str group, bool fuse_wgrad, "
    "bool need_wgrad) -> Tensor[]", _linear_rs_backward,
    lambda grad_output, input, weight, group, fuse_wgrad, need_wgrad: [
        input.new_empty(input.shape), torch.empty_like(weight, memory_format=torch.contiguous_format)])


class _ParallelLinear(torch.autograd.Function):
    """Forward: the (gathered) input times the weight, traced into the compiled graph. Backward: one
    opaque op (`_linear_backward`), or without TP only the fused weight gradient's (`_fused_wgrad`)."""

    @staticmethod
    def forward(ctx, input, weight, bias, group, gather_input, dgrad, fuse_wgrad, overlap=False):
        ctx.save_for_backward(input, weight)
        overlap = bool(overlap and gather_input and group)
        ctx.args = (group, gather_input, dgrad, fuse_wgrad, bias is not None)
        ctx.overlap = overlap
        if overlap:
            out = _ag_linear_op(input, weight, group)
            return out + bias if bias is not None else out
        total = _gather_seq_op(input, group) if gather_input else input
        return torch.nn.functional.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group, gather_input, dgrad, fuse_wgrad, has_bias = ctx.args
        need_wgrad = ctx.needs_input_grad[1]
        if group or not fuse_wgrad:
            grad_input, grad_weight, grad_bias = _linear_backward_op(grad_output, input, weight, *ctx.args, need_wgrad,
                                                                     ctx.overlap)
        else:
            # no input gradient where nothing before needs one (a frozen base's first layer under LoRA)
            grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
            grad_weight = _fused_wgrad_op(grad_output, input, weight) if need_wgrad else None
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if has_bias else None
        return (grad_input, grad_weight if need_wgrad else None, grad_bias if has_bias else None,
                None, None, None, None, None)


class _RowLinearReduceScatter(torch.autograd.Function):
    """A row-parallel linear and its sum over TP under SP, as one overlapped op each way (`_linear_rs`,
    `_linear_rs_backward`)."""

    @staticmethod
    def forward(ctx, input, weight, group, fuse_wgrad):
        ctx.save_for_backward(input, weight)
        ctx.group, ctx.fuse_wgrad = group, fuse_wgrad
        return _linear_rs_op(input, weight, group)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        need_wgrad = ctx.needs_input_grad[1]
        grad_input, grad_weight = _linear_rs_backward_op(grad_output.contiguous(), input, weight, ctx.group,
                                                         ctx.fuse_wgrad, need_wgrad)
        return grad_input, grad_weight if need_wgrad else None, None, None


class _TPReduce(torch.autograd.Function):
    """Sum over the TP group: whole (all-reduce) or this rank's part of the sequence (reduce-scatter).
    The sum's gradient is the same on every rank: identity, or the whole sequence back from its parts."""

    @staticmethod
    def forward(ctx, x, group, scatter_seq):
        ctx.group, ctx.scatter_seq = group, scatter_seq
        return _reduce_scatter_seq_op(x, group) if scatter_seq else _all_reduce_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_gather_seq_op(grad, ctx.group) if ctx.scatter_seq else grad), None, None


def group_name(group) -> str:
    """How a TP group travels into the ops: its name, or '' for no group / one rank."""
    return group.group_name if group is not None and group.size() > 1 else ""


def parallel_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: str = "",
                    gather_input: bool = False, dgrad: int = DGRAD_NONE, fuse_wgrad: bool = False,
                    overlap: bool = False) -> torch.Tensor:
    """input @ weight.T + bias for a column- or row-parallel linear (see the module docstring); `overlap`: a
    gathered input's all-gather overlapped with the GEMM, and the input gradient's reduce-scatter with its GEMM."""
    return _ParallelLinear.apply(input, weight, bias, group, gather_input, dgrad, fuse_wgrad, overlap)


def row_linear_reduce_scatter(input: torch.Tensor, weight: torch.Tensor, group: str,
                              fuse_wgrad: bool = False) -> torch.Tensor:
    """`tp_reduce(parallel_linear(input, weight, None, group), group, scatter_seq=True)` with the reduce-scatter
    overlapped with the GEMM, and the output gradient's all-gather with the input gradient's GEMM."""
    return _RowLinearReduceScatter.apply(input, weight, group, fuse_wgrad)


def tp_reduce(x: torch.Tensor, group: str, scatter_seq: bool) -> torch.Tensor:
    return _TPReduce.apply(x, group, scatter_seq)


def column_args(kwargs) -> Tuple[bool, int]:
    """(gather_input, dgrad) from the arguments mcore hands a column-parallel linear's `_forward_impl`."""
    if kwargs.get("sequence_parallel"):
        return True, DGRAD_REDUCE_SCATTER
    return False, DGRAD_ALL_REDUCE if kwargs.get("allreduce_dgrad") else DGRAD_NONE
