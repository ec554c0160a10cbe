"""Our vocab-parallel cross-entropy against torch's on the unpadded logits: loss and logits gradient,
with padded vocabulary rows, ignored labels (-100) and TP=1/2/4 (at TP=4 with 64 padded rows the last
rank holds padding only)."""

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_on_ranks

TRUE_VOCAB = 37


def _worker(tp, padded=48):
    from megatron.core import parallel_state

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.layers.cross_entropy import vocab_parallel_cross_entropy
    from megatron_plugin.engine.distributed import initialize

    initialize(MegatronLMPlugin(tp_degree=tp))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, padded, generator=g) * 4  # [s, b, vocab]
    target = torch.randint(0, TRUE_VOCAB, (5, 3), generator=g)
    target[1, 2] = -100
    weights = torch.rand(5, 3, generator=g)

    rank = parallel_state.get_tensor_model_parallel_rank()
    width = padded // tp
    local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, TRUE_VOCAB)
    (loss * weights).sum().backward()

    full = logits[..., :TRUE_VOCAB].clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, TRUE_VOCAB), target.reshape(-1), reduction="none", ignore_index=-100)
    ref = ref.view(5, 3)
    (ref * weights * (target != -100)).sum().backward()
    keep = target != -100
    ref_grad = torch.cat([full.grad, torch.zeros(5, 3, padded - TRUE_VOCAB)], -1)[..., rank * width : (rank + 1) * width]
    return {
        "loss_err": (loss[keep] - ref[keep]).abs().max().item(),
        "grad_err": (local.grad - ref_grad * keep.unsqueeze(-1)).abs()[keep].max().item(),
        "pad_grad": local.grad[..., max(TRUE_VOCAB - rank * width, 0):].abs().max().item() if rank == tp - 1 else 0.0,
        "finite": bool(torch.isfinite(loss).all()),
    }


@pytest.mark.parametrize("tp,padded", [(1, 48), (2, 48), (4, 64)])
def test_matches_torch_cross_entropy(tp, padded):
    for r in run_on_ranks(_worker, tp, tp, padded):
        assert r["finite"]
        assert r["loss_err"] < 1e-5, r
        assert r["grad_err"] < 1e-6, r
        assert r["pad_grad"] == 0.0, r
