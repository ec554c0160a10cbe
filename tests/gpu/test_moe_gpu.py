"""MoE training on one GPU in bf16 (the grouped-GEMM experts) through accelerator.prepare: a tiny Qwen3-MoE
tracks HF's fp32 run (LM + load-balancing loss) within bf16's tolerance for 5 steps, its losses fall, and
its experts learn what HF's learn, with and without the fused weight gradient (whose unzeroed gradient
buffers must not reach the experts: engine/grad_buffers.py).

    python -m pytest -q tests/gpu/test_moe_gpu.py
"""

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import tiny_moe
from tests.spawn import run_on_ranks
from tests.training import token_dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, MICRO, LR, AUX = 5, 4, 3e-3, 0.05


def _model():
    return tiny_moe("qwen3_moe", output_router_logits=True, router_aux_loss_coef=AUX)


def _expert_deltas(after, before):
    return torch.cat([(after[k].float() - before[k].float()).flatten() for k in sorted(before) if ".experts." in k])


def _hf_reference():
    """HF fp32 on the GPU, the same batches, AdamW, clipping at 1 (the plugin's default)."""
    from megatron_plugin.models.moe_names import checkpoint_state_dict

    hf = _model().cuda().train()
    before = {k: v.clone() for k, v in checkpoint_state_dict(hf).items()}
    data = token_dataset(STEPS * MICRO, hf.config.vocab_size)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        batch = {k: torch.stack([d[k] for d in data[step * MICRO:(step + 1) * MICRO]]).cuda() for k in data[0]}
        loss = hf(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _expert_deltas(checkpoint_state_dict(hf), before)


def _run_steps(engine, loader):
    """STEPS training steps: each one's loss and logged metrics (the router losses, tokens per expert)."""
    engine.train()
    losses, metrics = [], []
    for batch in loader:
        out = engine(**batch)
        losses.append(out.loss.item())
        metrics.append({k: v.tolist() for k, v in engine.metrics.items()})
        if len(losses) == STEPS:
            break
    return losses, metrics


def _megatron_worker(wgrad_fusion, compiled=False):
    import megatron_plugin.layers.moe as moe
    from megatron_plugin import Accelerator, MegatronLMPlugin
    from megatron_plugin.models.moe_names import checkpoint_state_dict

    grouped_calls = [0]
    real = moe.grouped_expert_mlp

    def counted(*args, **kwargs):
        grouped_calls[0] += 1
        return real(*args, **kwargs)

    moe.grouped_expert_mlp = counted
    try:
        hf = _model()
        before = {k: v.clone() for k, v in checkpoint_state_dict(hf).items()}
        plugin = MegatronLMPlugin(gradient_clipping=1.0, gradient_accumulation_fusion=wgrad_fusion,
                                  torch_compile=compiled)
        acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
        opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0)
        loader = DataLoader(token_dataset(STEPS * MICRO, hf.config.vocab_size), batch_size=MICRO, shuffle=False)
        engine, opt, loader = acc.prepare(hf, opt, loader)
        losses, metrics = _run_steps(engine, loader)
        after = {name: t.float().cpu() for name, t in engine.iter_hf_weights()}
        deltas = _expert_deltas(after, {k: v for k, v in before.items() if k in after})
        return {"losses": losses, "metrics": metrics, "grouped_calls": grouped_calls[0], "deltas": deltas}
    finally:
        moe.grouped_expert_mlp = real


@pytest.mark.parametrize("wgrad_fusion,compiled", [(False, False), (True, False), (True, True)],
                         ids=["unfused", "fused_wgrad", "compiled"])
def test_moe_bf16_grouped_training_tracks_hf_fp32(wgrad_fusion, compiled):
    """compiled: the engine's MoE path (layers compiled with Inductor's C++ wrapper, stacked expert weights)."""
    ref_losses, ref_deltas = _hf_reference()
    (res,) = run_on_ranks(_megatron_worker, 1, wgrad_fusion, compiled)
    losses = res["losses"]
    assert res["grouped_calls"] > 0, res  # the experts ran as grouped GEMMs
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / b < 3e-2, (losses, ref_losses)
    for m in res["metrics"]:
        assert abs(m["loss"] - (m["lm loss"] + AUX * m["load_balancing_loss"])) < 1e-3 * m["loss"], m
        assert all(k in m for k in ("tokens per expert/layer 1", "tokens per expert/layer 2")), sorted(m)
    deltas = res["deltas"]
    cos = float(torch.nn.functional.cosine_similarity(deltas, ref_deltas.cpu(), dim=0))
    assert deltas.abs().max() > 0 and cos > 0.9, (cos, deltas.abs().max())  # the experts learn as HF's do


def _layout_worker(plugin_kwargs, micro, num_micro, aux, precision="bf16"):
    """One run of the tiny Qwen3-MoE (bf16 unless told) under a parallel layout: each step's loss and metrics, and the
    trained weights (whole, on every rank). Rows are laid out so that every layout sees the same micro-batches:
    rank r of a data-parallel group of `dp` takes rows [step * 4 + r * micro, ...) of each step's 4."""
    import os

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from megatron_plugin.models.moe_names import checkpoint_state_dict
    from tests.training import sft_dataset

    world = int(os.environ["WORLD_SIZE"])
    hf = tiny_moe("qwen3_moe", output_router_logits=aux > 0, router_aux_loss_coef=aux)
    before = {k: v.clone() for k, v in checkpoint_state_dict(hf).items()}
    plugin = MegatronLMPlugin(gradient_clipping=1.0, num_micro_batches=num_micro, **plugin_kwargs)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision=precision)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0)
    # padded SFT rows: under PP the later stages slice the padding mask themselves (train_steps/moe.py)
    loader = DataLoader(sft_dataset(STEPS * 4, hf.config.vocab_size), batch_size=micro, shuffle=False)
    engine, opt, loader = acc.prepare(hf, opt, loader)
    losses, metrics = _run_steps(engine, loader)
    after = {name: t.float().cpu() for name, t in engine.iter_hf_weights()}
    acc.end_training()
    # what training changed, tensor by tensor in one order (the experts included)
    deltas = {k: (after[k] - before[k].float()).flatten() for k in sorted(after)}
    return {"losses": losses, "metrics": metrics, "deltas": deltas, "world": world}


def _assert_layout_tracks(results, one):
    for res in results:
        assert len(res["losses"]) == STEPS and one["losses"][-1] < one["losses"][0], (res["losses"], one["losses"])
        for a, b in zip(res["losses"], one["losses"]):
            assert abs(a - b) / b < 2e-2, (res["losses"], one["losses"])
        assert res["deltas"].keys() == one["deltas"].keys()
        # bf16 on both sides, summed in other orders: AdamW's updates point the same way (a wrongly reduced
        # gradient, e.g. an expert's, would turn or scale its tensor's update)
        for k, d in res["deltas"].items():
            ref = one["deltas"][k]
            assert ref.norm() > 0, k  # every tensor trains here
            cos = float(torch.nn.functional.cosine_similarity(d, ref, dim=0))
            assert cos > 0.95 and 0.9 < (d.norm() / ref.norm()).item() < 1.1, (k, cos, d.norm(), ref.norm())


@pytest.mark.two_gpus
def test_moe_ep2_tracks_one_gpu():
    """EP = 2 on two GPUs (each holds half the experts; the dense part data-parallel over both, micro-batches of
    2) against one GPU accumulating the same two micro-batches a step: the load-balancing loss is per
    micro-batch in both, so the runs differ only by bf16 rounding."""
    (one,) = run_on_ranks(_layout_worker, 1, {}, 2, 2, AUX)
    results = run_on_ranks(_layout_worker, 2, {"expert_model_parallel_size": 2}, 2, 1, AUX)
    _assert_layout_tracks(results, one)
    for res in results:
        for step, (m, ref) in enumerate(zip(res["metrics"], one["metrics"])):
            # every token's top-k picks counted once over the expert-parallel ranks, as on one GPU; from the
            # same weights (the first step) the same picks, later bf16 may move a token near a tie
            got, want = m["tokens per expert/layer 1"], ref["tokens per expert/layer 1"]
            assert sum(got) == sum(want) and (step > 0 or got == want), (step, got, want)


@pytest.mark.two_gpus
def test_moe_pp2_tracks_one_gpu():
    """PP = 2 with MoE layers on both stages (no aux loss: prepare refuses its coefficient with pipeline stages),
    padded rows, two micro-batches a step, against one GPU."""
    (one,) = run_on_ranks(_layout_worker, 1, {}, 2, 2, 0.0)
    results = run_on_ranks(_layout_worker, 2, {"pp_degree": 2}, 2, 2, 0.0)
    _assert_layout_tracks(results, one)
