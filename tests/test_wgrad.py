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


class _Block(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(24, 16) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(24) * 0.1) if bias else None
        self.proj = torch.nn.Parameter(torch.randn(16, 24) * 0.1)

    def forward(self, x, linear):
        h = torch.nn.functional.gelu(linear(torch.nn.functional.layer_norm(x, (16,)), self.weight, self.bias))
        return x + linear(h, self.proj, None)


def test_fused_linear_compiled_accumulates_into_main_grad():
    """What a compiled layer runs with gradient_accumulation_fusion (layers/linear.py): Inductor compiles
    the block with the linears as opaque ops; over two micro-batches main_grad gathers the weight
    gradients of plain autograd, autograd hands the hook the placeholder, and input/bias gradients match."""
    torch.manual_seed(0)
    for bias in (True, False):
        fused, plain = _Block(bias), _Block(bias)
        plain.load_state_dict(fused.state_dict())
        weights = [fused.weight, fused.proj]
        for w in weights:
            w.main_grad = torch.zeros_like(w)
        fused.proj.zero_out_wgrad = True  # as mcore marks a weight tied to the embedding
        step = torch.compile(fused.forward, backend="inductor", fullgraph=True)  # fullgraph: no graph break
        for _ in range(2):
            x = torch.randn(3, 5, 16)
            xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            step(xf, wgrad.fused_linear).square().sum().backward()
            plain(xp, torch.nn.functional.linear).square().sum().backward()
            assert (xf.grad - xp.grad).abs().max().item() < 1e-5
        for w, ref in ((fused.weight, plain.weight), (fused.proj, plain.proj)):
            assert w.grad_added_to_main_grad
            assert (w.main_grad - ref.grad).abs().max().item() < 1e-5
        assert torch.equal(fused.proj.grad, torch.zeros_like(fused.proj))  # the hook adds nothing for it
        if bias:
            assert (fused.bias.grad - plain.bias.grad).abs().max().item() < 1e-5


def test_fused_linear_without_main_grad_says_so():
    w = torch.nn.Parameter(torch.randn(4, 4))
    out = wgrad.fused_linear(torch.randn(2, 4), w)
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "main_grad" in str(e)
    else:
        raise AssertionError("a fused linear without main_grad trained silently")
