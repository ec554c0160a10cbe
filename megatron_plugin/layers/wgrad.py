"""apex's `fused_weight_gradient_mlp_cuda` on torch: Megatron's gradient-accumulation fusion.

With bf16/fp16 training, Megatron-Core's DDP keeps an fp32 `main_grad` per weight. Without this
extension each linear's weight gradient is computed in bf16, allocated, and then added into
`main_grad` by a per-parameter hook: one more pass over every weight per micro-batch (2,320 add kernels
a step for GPT-2 1.5B with 4 micro-batches). With it the weight-gradient GEMM accumulates straight
into `main_grad` in fp32 (`torch.addmm(..., out_dtype=torch.float32)`, cuBLAS's beta=1 epilogue), which
is also the more accurate sum. mcore reads the extension from a module global at import; `patches.py`
puts this module there, only where apex's own is missing.
"""

from __future__ import annotations

import torch


def _beta(main_grad: torch.Tensor) -> float:
    """0 for the step's first weight gradient into a main_grad that the engine left unzeroed
    (`engine/grad_buffers.py` marks it `write_first`): the GEMM then writes it whole, and neither a
    zeroing pass over the buffer nor the GEMM's read of those zeros is paid. 1 (accumulate) otherwise."""
    if getattr(main_grad, "write_first", False):
        main_grad.write_first = False
        return 0.0
    return 1.0


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_output[T, out]^T @ total_input[T, in]."""
    beta = _beta(main_grad)
    if total_input.dtype == torch.float32:
        main_grad.addmm_(grad_output.t(), total_input, beta=beta)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, beta=beta, out_dtype=torch.float32, out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same into a bf16/fp16 main_grad (grad_reduce_in_fp32=False)."""
    main_grad.addmm_(grad_output.t(), total_input, beta=_beta(main_grad))
