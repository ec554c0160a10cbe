"""Megatron's full-iteration CUDA graph (other_megatron_args cuda_graph_impl='local', cuda_graph_scope='full_iteration';
engine/full_graph.py) trains as the eager step does: the same losses and grad norms step by step, on one GPU and
at TP = 2 + SP and DP = 2 with the distributed optimizer, compiled and eager layers, FP8 linears (tensor-wise and
delayed scaling), with dropout drawn from the default stream and from megatron-core's tracker (SP), and through a
checkpoint round trip.

    python -m pytest -q tests/gpu/test_full_graph_gpu.py
"""

from functools import partial

import pytest
import torch

from tests.gpu.workers import full_graph_run
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

CASES_1GPU = {
    "gpt2_compiled": dict(),
    "gpt2_eager": dict(compile=False),
    "llama_compiled": dict(family="llama"),
    "gpt2_compiled_dropout": dict(dropout=0.1),
    # the seeds set again after the capture (a second prepare in the process): the replays must draw from the
    # re-seeded streams as the eager steps do (distributed.keep_generators)
    "gpt2_compiled_dropout_reseeded": dict(dropout=0.1, reseed_at=5),
    # FP8 (SM89 and later): each replay quantizes the weights anew; delayed scaling settles after the first step
    # (a new code path: eager once more, then captured)
    "gpt2_fp8_tensorwise_compiled": dict(fp8_recipe="tensorwise"),
    "llama_fp8_delayed_compiled": dict(family="llama", fp8_recipe="delayed"),
    "gpt2_fp8_delayed_eager": dict(fp8_recipe="delayed", compile=False),
    # eager current scaling: each use's scale falls back to a Python 1.0 (layers/fp8.amax_to_scale), which must not
    # become a host-to-device copy inside the capture
    "gpt2_fp8_tensorwise_eager": dict(fp8_recipe="tensorwise", compile=False),
}
CASES_2GPU = {
    "tp2_sp_compiled_dropout": dict(tp=2, sp=True, dropout=0.1),
    "llama_tp2_sp_compiled": dict(tp=2, sp=True, family="llama"),
    "dp2_distopt_compiled": dict(distopt=True),
    # TP without SP: attention dropout draws from megatron-core's tracker through a fork outside torch.compile
    # (layers/rng_fork.in_tracker_fork), captured with the graph-safe tracker's generators
    "tp2_compiled_dropout": dict(tp=2, dropout=0.1),
    "tp2_compiled_dropout_reseeded": dict(tp=2, dropout=0.1, reseed_at=5),
    # FP8 at TP = 2 + SP: the linears run outside the compiled graphs (their collectives), eager casts included
    "tp2_sp_fp8_tensorwise_compiled": dict(tp=2, sp=True, fp8_recipe="tensorwise"),
}


def _compare(kwargs, nproc, tmp_path):
    if kwargs.get("fp8_recipe") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs SM89 or later")
    steps = 10
    eager = run_on_ranks(partial(full_graph_run, graph=False, steps=steps, save_dir=str(tmp_path / "eager"), **kwargs),
                         nproc)[0]
    graph = run_on_ranks(partial(full_graph_run, graph=True, steps=steps, save_dir=str(tmp_path / "graph"), **kwargs),
                         nproc)[0]
    # captured once after 2 eager steps (the checkpoint load copies into the same weights and buffers: no new
    # capture), replayed every step after
    assert graph["captures"] == 1 and graph["replays"] == steps - 2, graph
    # the same kernels on the same data in the same order: bit for bit the eager step (a graph captured on another
    # stream than the gradient accumulators' came out 1.3% off at DP = 2, 2026-11-30: engine/full_graph.py).
    # Compiled tensor-wise FP8 linears are not the same kernels run to run: two runs' first steps, eager in both,
    # differed by 7e-5 in loss (two H200s, 2026-11-30), so those are held to the order of the scaling's rounding
    # (compiled delayed scaling came out exact)
    varies = kwargs.get("fp8_recipe") == "tensorwise" and kwargs.get("compile", True)
    loss_tol, norm_tol = (2e-3, 1e-2) if varies else (0, 0)
    torch.testing.assert_close(graph["losses"], eager["losses"], rtol=loss_tol, atol=0)
    torch.testing.assert_close(graph["norms"], eager["norms"], rtol=norm_tol, atol=0)
    assert graph["rng_moved"] == eager["rng_moved"]  # a replay advances the dropout stream as the eager step does
    if kwargs.get("dropout"):
        assert graph["rng_moved"]
    # the same workers take the next task: their teardown (destroy_process_group) came back, which NCCL does only
    # once the graphs holding its communicators' work are gone (full_graph.release_all; before it the next task
    # never started, 2026-11-30)
    assert run_on_ranks(abs, nproc, -3) == [3] * nproc


@pytest.mark.parametrize("name", list(CASES_1GPU))
def test_full_iteration_graph_trains_as_the_eager_step(name, tmp_path):
    _compare(CASES_1GPU[name], 1, tmp_path)


@two_gpus
@pytest.mark.parametrize("name", list(CASES_2GPU))
def test_full_iteration_graph_trains_as_the_eager_step_2gpu(name, tmp_path):
    _compare(CASES_2GPU[name], 2, tmp_path)
