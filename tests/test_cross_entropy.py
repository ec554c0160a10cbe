"""Our vocab-parallel cross-entropy against torch's on the unpadded logits: loss and logits gradient,
with padded vocabulary rows, ignored labels (-100) and TP=1/2."""

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_on_ranks

TRUE_VOCAB, PADDED = 37, 48


def _worker(tp):
    from megatron.core import parallel_state

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.layers.cross_entropy import vocab_parallel_cross_entropy
    from megatron_plugin.engine.distributed import initialize

    initialize(MegatronLMPlugin(tp_degree=tp))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, PADDED, generator=g) * 4  # [s, b, vocab]
    target = torch.randint(0, TRUE_VOCAB, (5, 3), generator=g)
    target[1, 2] = -100
    weights = torch.rand(5, 3, generator=g)

    rank = parallel_state.get_tensor_model_parallel_rank()
    width = PADDED // tp
    local = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, TRUE_VOCAB)
    (loss * weights).sum().backward()

    full = logits[..., :TRUE_VOCAB].clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, TRUE_VOCAB), target.reshape(-1), reduction="none", ignore_index=-100)
    ref = ref.view(5, 3)
    (ref * weights * (target != -100)).sum().backward()
    keep = target != -100
    ref_grad = torch.cat([full.grad, torch.zeros(5, 3, PADDED - TRUE_VOCAB)], -1)[..., rank * width : (rank + 1) * width]
    return {
        "loss_err": (loss[keep] - ref[keep]).abs().max().item(),
        "grad_err": (local.grad - ref_grad * keep.unsqueeze(-1)).abs()[keep].max().item(),
        "pad_grad": local.grad[..., max(TRUE_VOCAB - rank * width, 0):].abs().max().item() if rank == tp - 1 else 0.0,
        "finite": bool(torch.isfinite(loss).all()),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_matches_torch_cross_entropy(tp):
    for r in run_on_ranks(_worker, tp, tp):
        assert r["finite"]
        assert r["loss_err"] < 1e-5, r
        assert r["grad_err"] < 1e-6, r
        assert r["pad_grad"] == 0.0, r
