"""layers/wgrad.py: the weight-gradient GEMM that accumulates into the fp32 main_grad (apex's
`fused_weight_gradient_mlp_cuda` on torch). Its bf16 path (cuBLAS fp32 output) is checked on GPU
against the unfused path (tests/gpu: test_gradient_accumulation_fusion_*); here its fp32 path and its
installation into Megatron-Core."""

import torch

from megatron_plugin.layers import wgrad


def test_fp32_wgrad_accumulates_into_main_grad():
    g = torch.Generator().manual_seed(0)
    grad_output = torch.randn(64, 24, generator=g)
    total_input = torch.randn(64, 16, generator=g)
    main_grad = torch.randn(24, 16, generator=g)
    expected = main_grad.double() + 2 * grad_output.double().t() @ total_input.double()
    storage = main_grad.data_ptr()
    for _ in range(2):  # two micro-batches
        wgrad.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == storage  # in place: DDP's buffer, not a new tensor
    assert (main_grad.double() - expected).abs().max().item() < 1e-4


def test_install_supplies_the_extension_to_megatron_core():
    from megatron.core.tensor_parallel import layers

    wgrad.install()
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is not None
    assert wgrad.install() is False  # installed once; apex's own would also be left alone
