"""apex's `fused_weight_gradient_mlp_cuda` on torch: Megatron's gradient-accumulation fusion.

With bf16/fp16 training, Megatron-Core's DDP keeps an fp32 `main_grad` per weight. Without this
extension each linear's weight gradient is computed in bf16, allocated, and then added into
`main_grad` by a per-parameter hook: one more pass over every weight per micro-batch (2,320 add kernels
a step for GPT-2 1.5B with 4 micro-batches). With it the weight-gradient GEMM accumulates straight
into `main_grad` in fp32 (`torch.addmm(..., out_dtype=torch.float32)`, cuBLAS's beta=1 epilogue), which
is also the more accurate sum. mcore reads the extension from a module global at import; `install`
puts this module there, only where apex's own is missing.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_output[T, out]^T @ total_input[T, in]."""
    if total_input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a bf16/fp16 main_grad (grad_reduce_in_fp32=False)."""
    main_grad.addmm_(grad_output.t(), total_input)


def install() -> bool:
    """Make mcore's linears able to take `gradient_accumulation_fusion=True`. Returns whether this
    module was installed (False: apex's extension is there and stays)."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return False
    layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
    layers._grad_accum_fusion_available = True
    return True


# Inside a compiled layer the linear must not be mcore's autograd function: its backward writes into
# main_grad, a side effect the compiler cannot see, and sending it back to eager splits the layer's graph
# into resume frames that cost more than the fusion saves (BENCHMARKS.md). As custom ops the linear and its
# weight gradient are opaque nodes of the compiled graphs: no graph break, and the weight-gradient op gets
# the real parameter (with its main_grad) at run time.
@torch.library.custom_op("megatron_plugin::linear", mutates_args=())
def _linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.linear(input, weight, bias)


@_linear.register_fake
def _(input, weight, bias):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


@torch.library.custom_op("megatron_plugin::weight_grad_into_main_grad", mutates_args=())
def _weight_grad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Adds this weight's gradient into weight.main_grad and returns what autograd hands DDP's hook
    instead (the hook skips it: `grad_added_to_main_grad`), as mcore's fused path does."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("gradient_accumulation_fusion: a fused linear's weight has no main_grad (DDP's buffer)")
    go, x = grad_output.reshape(-1, grad_output.shape[-1]), input.reshape(-1, input.shape[-1])
    (wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else wgrad_gemm_accum_fp16)(x, go, main_grad)
    weight.grad_added_to_main_grad = True
    # a weight shared with the embedding (tied) also gets the lookup's gradient, which the hook adds
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


@_weight_grad.register_fake
def _(grad_output, input, weight):
    return torch.empty_like(weight)


def _setup(ctx, inputs, output):
    input, weight, bias = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
    return grad_output @ weight, _weight_grad(grad_output, input, weight), grad_bias


_linear.register_autograd(_backward, setup_context=_setup)


def fused_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """input @ weight.T + bias whose weight gradient accumulates into weight.main_grad (no TP comm)."""
    return _linear(input, weight, bias)
