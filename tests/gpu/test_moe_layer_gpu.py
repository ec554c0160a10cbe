"""The MoE layer on CUDA in bf16: the grouped-GEMM experts against megatron-core's loop over the experts,
and a dropless expert-parallel-free forward + backward that never waits on the GPU (no host sync).

    python -m pytest -q tests/gpu/test_moe_layer_gpu.py
"""

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.test_moe_layer import H, S, _config, _copy_weights, _hf_block, _start

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _layer(family="qwen3_moe"):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config(family)
    layer = build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1)
    _copy_weights(layer, _hf_block(family), family)
    return layer.cuda().bfloat16()


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _grouped_vs_loop_worker():
    from megatron.core.transformer.moe.experts import SequentialMLP

    layer = _layer()
    experts = layer.experts
    torch.manual_seed(0)
    counts = torch.tensor([40, 0, 17, 64, 3, 25, 9, 50])
    n = int(counts.sum())
    x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(n, device="cuda")
    probe = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        xx = x.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        out = fn(xx)
        (out.float() * probe.float()).sum().backward()
        grads = [e.linear_fc1.weight.grad for e in experts.local_experts]
        return out.detach(), xx.grad, [None if g is None else g.clone() for g in grads]

    assert experts._can_group(x)
    grouped = run(lambda xx: experts(xx, counts.cuda(), probs)[0])
    loop = run(lambda xx: SequentialMLP.forward(experts, xx, counts, probs)[0])
    # with gradient_accumulation_fusion and DDP's fp32 main_grad: weight gradients accumulate there
    weights = [e.linear_fc1.weight for e in experts.local_experts]
    for w in weights + [e.linear_fc2.weight for e in experts.local_experts]:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
    experts.config.gradient_accumulation_fusion = True
    fused = run(lambda xx: experts(xx, counts.cuda(), probs)[0])
    fused_dw = [w.main_grad.clone() for w in weights]

    # the engine's path: weights stacked before the forward (one autograd leaf per projection), the stacked
    # gradient added into main_grad by the leaf's hook; the per-expert weights stay out of the graph
    from megatron_plugin.layers.moe import stack_experts_each_forward

    stack_experts_each_forward(experts)  # as the engine hooks its model
    seen = []

    def stacked_run(xx):
        out = experts(xx, counts.cuda(), probs)[0]
        seen.append(experts._stacks is None and all(t.requires_grad and t.is_leaf for t in experts._stack_store[0]))
        return out

    for w in weights + [e.linear_fc2.weight for e in experts.local_experts]:
        w.main_grad.zero_()
    stacked = run(stacked_run)
    stacked_dw = [w.main_grad.clone() for w in weights]
    stacked_grad_none = all(w.grad is None for w in weights)
    # without main_grad the stacked gradient lands in each weight's .grad
    for w in weights + [e.linear_fc2.weight for e in experts.local_experts]:
        del w.main_grad
    plain = run(stacked_run)
    return dict(out=_rel(grouped[0], loop[0]), dx=_rel(grouped[1], loop[1]),
                dw=max(_rel(a, b) for a, b in zip(grouped[2], loop[2]) if b.abs().max() > 0),
                fused_dw=max(_rel(a, b) for a, b in zip(fused_dw, loop[2]) if b.abs().max() > 0),
                stacked_out=_rel(stacked[0], loop[0]), stacked_dx=_rel(stacked[1], loop[1]),
                stacked_dw=max(_rel(a, b) for a, b in zip(stacked_dw, loop[2]) if b.abs().max() > 0),
                plain_dw=max(_rel(a, b) for a, b in zip(plain[2], loop[2]) if b.abs().max() > 0),
                stacked_grad_none=0.0 if stacked_grad_none else 1.0, stacks_dropped=0.0 if all(seen) else 1.0,
                empty_expert_dw=float(grouped[2][1].abs().max()) + float(fused_dw[1].abs().max())
                + float(stacked_dw[1].abs().max()))


def test_grouped_gemm_matches_the_loop_in_bf16():
    (res,) = run_on_ranks(_grouped_vs_loop_worker, 1)
    assert res.pop("empty_expert_dw") == 0.0, res
    assert all(v < 2e-2 for v in res.values()), res


def _no_sync_worker():
    from megatron.core.transformer.moe.experts import SequentialMLP

    layer = _layer()
    layer.train()
    torch.manual_seed(1)
    x = torch.randn(S * 16, 4, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x)[0].sum().backward()  # warm-up: lazy initializations may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = layer(x)
        out.float().sum().backward()
        stats = layer.router.stats
        try:  # the check is live: megatron-core's loop reads the token counts back to the host
            SequentialMLP.forward(layer.experts, x[:8, 0], torch.tensor([8] + [0] * 7, device="cuda"),
                                  torch.ones(8, device="cuda"))
            loop_synced = False
        except RuntimeError:
            loop_synced = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return dict(counts=float(stats.counts.sum()), tokens=float(stats.tokens), finite=bool(out.isfinite().all()),
                loop_synced=loop_synced)


def test_dropless_forward_backward_has_no_host_sync():
    (res,) = run_on_ranks(_no_sync_worker, 1)
    assert res == dict(counts=S * 16 * 4 * 2.0, tokens=S * 16 * 4.0, finite=True, loop_synced=True), res
