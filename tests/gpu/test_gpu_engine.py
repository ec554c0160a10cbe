"""Run on the GPU machine (see README): bf16 parity per layout, 50-step loss tracking, save/resume.

    python -m pytest -q tests/gpu
"""

import math

import pytest
import torch

from functools import partial

from tests.gpu.workers import STEPS, clip_run, deferred_check_run, generate_layout, run_layout
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

LAYOUTS_2GPU = {
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "dp2_distopt": dict(distopt=True),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2_interleaved": dict(pp=2, vpp_layers=1),
    "tp2_sp_recompute": dict(tp=2, sp=True, recompute=True),
    "dp2_compiled": dict(compile="plugin"),
    "pp2_compiled_recompute": dict(pp=2, recompute=True, compile="plugin"),
    # compiled layers with TP: the TP linears run eagerly inside them (layers/linear.py)
    "tp2_compiled": dict(tp=2, compile="plugin"),
    "tp2_sp_compiled": dict(tp=2, sp=True, compile="plugin"),
    # compiled layers whose linears and TP sums are custom ops (layers/compiled_linear.py)
    "tp2_compiled_linear_ops": dict(tp=2, compile="plugin", wgrad_fusion=True),
    "tp2_sp_compiled_linear_ops": dict(tp=2, sp=True, compile="plugin", wgrad_fusion=True),
    # compiled TP layers take Inductor's C++ wrapper (the TP ops skip its tuning run: compiled_linear.
    # in_inductor_codegen); the same under the Python wrapper, which the user gets by choosing a compile mode
    "tp2_sp_compiled_python_wrapper": dict(tp=2, sp=True, compile="plugin", cpp_wrapper=False),
    # Megatron's tp_comm_overlap through torch's symmetric-memory ops (compiled_linear._ag_matmul / _matmul_rs)
    "tp2_sp_compiled_tp_comm_overlap": dict(tp=2, sp=True, compile="plugin", tp_comm_overlap=True),
    # CUDA graphs (reduce-overhead) around the eager TP linears; the fused weight gradient is off there
    "tp2_cuda_graphs": dict(tp=2, compile="cuda_graphs"),
}
# the Llama family (GQA, RoPE, SwiGLU, RMSNorm) in the layouts people train it with
LLAMA_LAYOUTS_2GPU = {
    "llama_tp2_sp": dict(tp=2, sp=True),
    "llama_pp2": dict(pp=2),
    "llama_dp2_distopt": dict(distopt=True),
    "llama_tp2_sp_compiled": dict(tp=2, sp=True, compile="plugin"),
    "llama_tp2_sp_compiled_python_wrapper": dict(tp=2, sp=True, compile="plugin", cpp_wrapper=False),
    "llama_tp2_sp_compiled_tp_comm_overlap": dict(tp=2, sp=True, compile="plugin", tp_comm_overlap=True),
    # context parallelism: each rank holds two chunks of every sequence (layers/context_parallel.py)
    "llama_cp2": dict(cp=2),
    "llama_cp2_compiled": dict(cp=2, compile="plugin"),
}


@pytest.fixture(scope="module")
def baseline():
    (losses,) = run_on_ranks(run_layout, 1)
    return losses


# BERT (post-LN, MLM + NSP; no sequence parallelism: megatron-core 0.16.1's BertLMHead refuses it, and so does
# prepare) and T5 (no pipeline stages in megatron-core 0.16.1)
ENCODER_LAYOUTS_2GPU = {
    "bert_tp2": dict(family="bert", tp=2),
    "bert_pp2": dict(family="bert", pp=2),
    "bert_dp2_distopt": dict(family="bert", distopt=True),
    "t5_tp2": dict(family="t5", tp=2),
    "t5_tp2_sp": dict(family="t5", tp=2, sp=True),
    "t5_dp2_distopt": dict(family="t5", distopt=True),
}


@pytest.fixture(scope="module")
def encoder_baselines():
    return {f: run_on_ranks(partial(run_layout, family=f), 1)[0] for f in ("bert", "t5")}


@two_gpus
@pytest.mark.parametrize("name", ["bert_tp2", "bert_pp2", "t5_tp2"])
def test_bert_t5_bf16_logits_parity_2gpu(name):
    family, layout = name.split("_")
    kwargs = {"tp2": dict(tp=2), "pp2": dict(pp=2)}[layout]
    for r in [r for r in run_on_ranks(_logits, 2, dict(kwargs, family=family)) if r["last_stage"]]:
        assert r["ours_err"] <= 2 * r["hf_bf16_err"] + 1e-3, (name, r)


def test_bert_t5_baselines_learn(encoder_baselines):
    for family, losses in encoder_baselines.items():
        assert sum(losses[-5:]) < sum(losses[:5]) * 0.9, (family, losses)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_t5_compiled_layers_track_eager_baseline(family, encoder_baselines):
    """torch_compile=True compiles the encoder's layers too (BERT has no decoder, T5 has both)."""
    (losses,) = run_on_ranks(_train, 1, dict(family=family, compile="plugin"))
    _assert_tracks(losses, encoder_baselines[family], f"{family}_compiled")


@two_gpus
@pytest.mark.parametrize("name", list(ENCODER_LAYOUTS_2GPU))
def test_bert_t5_layouts_track_single_gpu_loss(name, encoder_baselines):
    layout = ENCODER_LAYOUTS_2GPU[name]
    for losses in run_on_ranks(_train, 2, layout):
        _assert_tracks(losses, encoder_baselines[layout["family"]], name)


@pytest.fixture(scope="module")
def llama_baseline():
    (losses,) = run_on_ranks(partial(run_layout, family="llama"), 1)
    return losses


def test_single_gpu_bf16_logits():
    (res,) = run_on_ranks(_logits, 1, {})
    assert res["ours_err"] <= 2 * res["hf_bf16_err"] + 1e-3, res


def _logits(kwargs):
    return run_layout(mode="logits", **kwargs)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_t5_single_gpu_bf16_logits(family):
    (res,) = run_on_ranks(_logits, 1, dict(family=family))
    assert res["ours_err"] <= 2 * res["hf_bf16_err"] + 1e-3, res


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5"])
def test_gradient_accumulation_fusion_equals_unfused_fp32(family):
    """The weight gradients accumulated by the fused GEMM (layers/wgrad.py) are the hook-added ones:
    in fp32 the two only differ in summation order, over 5 steps of 2 micro-batches."""
    runs = {f: run_on_ranks(partial(run_layout, family=family, precision="no", steps=5, wgrad_fusion=f), 1)[0]
            for f in (True, False)}
    assert max(abs(a - b) / abs(b) for a, b in zip(runs[True], runs[False])) < 1e-5, runs


def test_gradient_accumulation_fusion_compiled_equals_unfused_fp32():
    fused = run_on_ranks(partial(run_layout, precision="no", steps=5, wgrad_fusion=True, compile="plugin"), 1)[0]
    plain = run_on_ranks(partial(run_layout, precision="no", steps=5, wgrad_fusion=False), 1)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(fused, plain)) < 1e-4, (fused, plain)


def test_clipping_on_device_equals_mcore_step_fp32():
    """The clip factor applied inside fused AdamW (engine/device_clip.py) is mcore's clip-then-step:
    fp32, clipping active on every step."""
    ours = run_on_ranks(partial(clip_run, on_device=True), 1)[0]
    mcore = run_on_ranks(partial(clip_run, on_device=False), 1)[0]
    assert ours["clip_on_device"] and not mcore["clip_on_device"]
    assert min(mcore["norms"]) > 0.05, mcore  # the clip was active
    for key in ("losses", "norms"):
        assert max(abs(a - b) / abs(b) for a, b in zip(ours[key], mcore[key])) < 1e-5, (key, ours, mcore)
    assert not any(ours["skipped"]), ours


def test_non_finite_gradient_skips_the_update_bf16():
    res = run_on_ranks(partial(clip_run, precision="bf16", inf_step=2), 1)[0]
    assert res["clip_on_device"] and res["weights_kept"], res
    assert res["skipped"] == [False, False, True, False, False, False], res
    assert res["norms"][2] == float("inf") and all(math.isfinite(x) for x in res["losses"]), res


def test_batch_check_read_after_the_forward_is_queued():
    res = run_on_ranks(deferred_check_run, 1)[0]
    assert res["deferred"] and len(res["syncs_with_mask"]) == 1 and res["syncs_without_mask"] == [], res
    assert res["input_ids_error"] and "input_ids" in res["input_ids_error"] and "1000" in res["input_ids_error"], res
    assert res["labels_error"] and "labels" in res["labels_error"], res
    assert res["input_ids_weights_kept"] and res["labels_weights_kept"], res
    assert res["empty_loss_nan"] and res["empty_skipped"] and res["empty_weights_kept"], res
    assert all(math.isfinite(x) for x in res["losses"]) and res["losses"][-1] < res["losses"][0], res


def test_single_gpu_bf16_logits_llama():
    (res,) = run_on_ranks(_logits, 1, dict(family="llama"))
    assert res["ours_err"] <= 2 * res["hf_bf16_err"] + 1e-3, res


@two_gpus
@pytest.mark.parametrize("name", ["tp2", "pp2", "dp2_distopt", "tp2_sp", "llama_tp2", "llama_pp2", "llama_tp2_sp"])
def test_bf16_logits_parity_2gpu(name):
    layout = dict(LAYOUTS_2GPU.get(name.replace("llama_", ""), {}), **({"family": "llama"} if name.startswith("llama") else {}))
    results = run_on_ranks(_logits, 2, layout)
    last = [r for r in results if r["last_stage"]]
    assert last, results
    for r in last:
        # as close to fp32 HF as HF itself is in bf16
        assert r["ours_err"] <= 2 * r["hf_bf16_err"] + 1e-3, (name, r)


def _train(kwargs):
    return run_layout(**kwargs)


def _train_and_wrapper(kwargs):
    """(losses, whether the compiled layers took Inductor's C++ wrapper): the engine sets it process-wide
    (engine/gpu.use_cpp_wrapper) and each task starts without it (tests/spawn.py)."""
    from torch._inductor import config as inductor_config

    return run_layout(**kwargs), bool(inductor_config.cpp_wrapper)


def _expected_wrapper(layout) -> bool:
    """engine/gpu.wants_cpp_wrapper for these dense layouts, unless the layout forces a wrapper: compiled in
    Inductor's default mode (the plugin's or accelerate's knob), without CP or tp_comm_overlap."""
    if "cpp_wrapper" in layout:
        return layout["cpp_wrapper"]
    return layout.get("compile") in ("plugin", "accelerate") and layout.get("cp", 1) == 1 and not layout.get("tp_comm_overlap")


def test_baseline_learns(baseline):
    assert len(baseline) == STEPS
    assert sum(baseline[-5:]) < sum(baseline[:5]) * 0.8, baseline


def test_fp16_tracks_bf16_baseline(baseline):
    (losses,) = run_on_ranks(_train, 1, dict(precision="fp16"))
    _assert_tracks(losses, baseline, "fp16")


def test_compiled_layers_track_eager_baseline(baseline):
    # compiled through accelerate's own knob, as `accelerate config` writes it
    (losses,) = run_on_ranks(_train, 1, dict(compile="accelerate"))
    _assert_tracks(losses, baseline, "compiled")


def test_compiled_layers_with_cuda_graphs_track_eager_baseline(baseline):
    # reduce-overhead: each layer's forward and backward replayed as CUDA graphs; the fused weight
    # gradient resolves to off there (plugin.check_compile)
    (losses,) = run_on_ranks(_train, 1, dict(compile="cuda_graphs"))
    _assert_tracks(losses, baseline, "cuda_graphs")


@two_gpus
@pytest.mark.parametrize("name", list(LAYOUTS_2GPU))
def test_layouts_track_single_gpu_loss(name, baseline):
    for losses, cpp_wrapper in run_on_ranks(_train_and_wrapper, 2, LAYOUTS_2GPU[name]):
        _assert_tracks(losses, baseline, name)
        assert cpp_wrapper == _expected_wrapper(LAYOUTS_2GPU[name]), (name, cpp_wrapper)


def test_llama_baseline_learns(llama_baseline):
    assert sum(llama_baseline[-5:]) < sum(llama_baseline[:5]) * 0.8, llama_baseline


@two_gpus
@pytest.mark.parametrize("name", list(LLAMA_LAYOUTS_2GPU))
def test_llama_layouts_track_single_gpu_loss(name, llama_baseline):
    for losses, cpp_wrapper in run_on_ranks(_train_and_wrapper, 2, dict(LLAMA_LAYOUTS_2GPU[name], family="llama")):
        _assert_tracks(losses, llama_baseline, name)
        assert cpp_wrapper == _expected_wrapper(LLAMA_LAYOUTS_2GPU[name]), (name, cpp_wrapper)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_frozen_parameters_stay_frozen_on_gpu(family):
    (res,) = run_on_ranks(_train, 1, dict(family=family, frozen=True, steps=10))
    assert res["frozen_names"] and res["frozen_kept"] and res["others_moved"], res


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_cuda_graphs_equal_eager_and_hf(family):
    (res,) = run_on_ranks(generate_layout, 1, 1, family)
    assert res["graphs_equal_eager"] and res["equal_hf"], res


@two_gpus
def test_generation_tp2_cuda_graphs():
    for res in run_on_ranks(generate_layout, 2, 2, "llama"):
        assert res["graphs_equal_eager"] and res["equal_hf"], res


def _assert_tracks(losses, baseline, name):
    assert len(losses) == len(baseline) == STEPS
    rel = [abs(a - b) / b for a, b in zip(losses, baseline)]
    # bf16 runs of different layouts reduce in different orders: close, not equal
    assert max(rel) < 0.03, (name, max(rel), losses, baseline)
    assert abs(sum(losses[-10:]) - sum(baseline[-10:])) / sum(baseline[-10:]) < 0.01, (name, losses, baseline)


@two_gpus
def test_save_on_tp2_then_resume(tmp_path):
    straight = run_on_ranks(_train, 2, dict(tp=2, steps=20, total_steps=20))
    first = run_on_ranks(_train, 2, dict(tp=2, steps=10, total_steps=20, save_dir=str(tmp_path / "ckpt")))
    second = run_on_ranks(_train, 2, dict(tp=2, steps=10, total_steps=20, load_dir=str(tmp_path / "ckpt")))
    for rank in range(2):
        resumed = first[rank] + second[rank]
        for a, b in zip(resumed, straight[rank]):
            assert abs(a - b) / b < 1e-3, (resumed, straight[rank])
