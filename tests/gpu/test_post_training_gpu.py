"""Post-training on the GPU engine (mcore schedules, DDP, distributed optimizer): log-probs against HF
through pipeline stages, policy training against HF, offload/reload bit for bit with the device memory
given back, and weights streamed out of TP and PP models.

    python -m pytest -q tests/gpu/test_post_training_gpu.py
"""

import os

import pytest
import torch

from tests import test_post_training as T
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

LAYOUTS = {
    "single": dict(tp=1),
    "tp2_sp": dict(tp=2, sequence_parallelism=True),
    "pp2": dict(tp=1, pp_degree=2),
    "pp2_distopt": dict(tp=1, pp_degree=2, use_distributed_optimizer=True),
}


def _log_probs_gpu(name, layout):
    layout = dict(LAYOUTS[layout])
    tp = layout.pop("tp")
    _, model, _, _ = T.prepare(name, tp, micro=2, num_micro=2, **layout)
    ref_model = T.build(name)  # fp32 on the CPU
    batch = T._batch_for(name, ref_model.config.vocab_size)
    out = {}
    for temperature in (1.0, 0.7):
        lp, ent = model.compute_log_probs(batch, temperature=temperature, entropy=True)
        with torch.no_grad():
            ref_lp, ref_ent = T.hf_token_log_probs(ref_model, batch, temperature)
        lp, ent = lp.cpu(), ent.cpu()
        on = ref_lp != 0
        out[temperature] = {"lp": (lp - ref_lp).abs().max().item(), "ent": (ent - ref_ent).abs()[on].max().item(),
                            "scale": ref_lp.abs().max().item(), "shape": tuple(lp.shape) == tuple(ref_lp.shape)}
    return out


def _check_log_probs(results, where):
    for rank, res in enumerate(results):
        for temperature, r in res.items():
            scale = max(1.0, r["scale"])
            assert r["shape"], (where, rank)
            # fp32 on the GPU: cuBLAS sums in another order than the CPU reference
            assert r["lp"] < 5e-5 * scale and r["ent"] < 5e-5 * scale, (where, rank, temperature, r)


@pytest.mark.parametrize("name", ["llama", "tied", "t5_v1_1", "bert"])
def test_log_probs_match_hf_single_gpu(name):
    _check_log_probs(run_on_ranks(_log_probs_gpu, 1, name, "single"), name)


@two_gpus
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_log_probs_match_hf_2gpu(layout):
    _check_log_probs(run_on_ranks(_log_probs_gpu, 2, "llama", layout), layout)


def _train(name, steps, offload, optimizer, layout, precision=None):
    layout = dict(LAYOUTS[layout])
    if precision:
        layout["mixed_precision"] = precision
    return T._policy_train_worker(name, steps, offload, optimizer, layout)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_offload_reload_is_bit_identical_single_gpu(precision):
    (plain,) = run_on_ranks(_train, 1, "llama", 6, False, "adamw", "single", precision)
    (parked,) = run_on_ranks(_train, 1, "llama", 6, True, "adamw", "single", precision)
    assert plain["losses"] == parked["losses"]
    assert all(torch.equal(plain["streamed"][k], parked["streamed"][k]) for k in plain["streamed"])
    # every kind moved, every parameter emptied, the memory given back, running refused, reloaded after
    assert parked["checks"] == [(True, True, True, False)] * 6, parked["checks"]
    assert plain["stream_equals_state_dict"]
    if precision is None:
        ref_losses, _ = T.hf_policy_train("llama", 6)
        for step, ((loss, _, _), ref) in enumerate(zip(plain["losses"], ref_losses)):
            assert abs(loss - ref) <= 1e-3 * max(1.0, abs(ref)), (step, loss, ref)


@two_gpus
def test_offload_reload_is_bit_identical_pp2_distopt():
    plain = run_on_ranks(_train, 2, "llama", 4, False, "adamw", "pp2_distopt", "bf16")
    parked = run_on_ranks(_train, 2, "llama", 4, True, "adamw", "pp2_distopt", "bf16")
    for a, b in zip(plain, parked):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["streamed"][k], b["streamed"][k]) for k in a["streamed"])
        assert b["checks"] == [(True, True, True, False)] * 4, b["checks"]


@two_gpus
@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_streamed_weights_after_training_match_hf_2gpu(layout):
    got = run_on_ranks(_train, 2, "qwen3", 4, False, "sgd", layout)
    ref_losses, ref_state = T.hf_policy_train("qwen3", 4, "sgd")
    start = T.build("qwen3").state_dict()
    for res in got:
        assert res["stream_equals_state_dict"]
        for step, ((loss, _, _), ref) in enumerate(zip(res["losses"], ref_losses)):
            assert abs(loss - ref) <= 1e-3 * max(1.0, abs(ref)), (step, loss, ref)
        assert set(res["streamed"]) == set(ref_state)
        for k, v in res["streamed"].items():
            moved = (ref_state[k] - start[k]).abs().max().item()
            assert (v - ref_state[k]).abs().max().item() <= 1e-2 * max(moved, 1e-3), (k, moved)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_reference_weights_swap_single_gpu(precision):
    """snapshot_weights / use_weights on the GPU engine (pinned host memory, mcore's parameter buffers)."""
    layout = {"mixed_precision": precision}
    T.check_reference_runs(*[run_on_ranks(T._reference_worker, 1, swap, 1, layout) for swap in (False, True)])


@two_gpus
def test_reference_weights_swap_pp2_distopt():
    layout = {"pp_degree": 2, "use_distributed_optimizer": True, "mixed_precision": "bf16"}
    T.check_reference_runs(*[run_on_ranks(T._reference_worker, 2, swap, 1, layout) for swap in (False, True)])
