"""torch_dist checkpoints on the GPU engine (megatron-core's DDP and optimizer, bf16), with the distributed
optimizer, whose state is written per parameter in the model's shape (`fully_reshardable`) and so reshards
across TP/DP like the weights.

    python -m pytest -q tests/gpu/test_megatron_lm_checkpoint_gpu.py
"""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.gpu.workers import MICRO, dataset, gpu_model
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

BEFORE, AFTER, NUM_MICRO = 3, 3, 2


def _run(root, tp, distopt, save=False, load=False, pp=1, vpp_layers=None):
    """Llama (GQA, SwiGLU: mcore's GLU factory) in bf16. `save`: train BEFORE steps, save, record the weights,
    train AFTER more. `load`: load, compare the weights, train AFTER steps on the samples that follow."""
    import warnings

    import torch.distributed as dist

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // (tp * pp)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp, num_layers_per_virtual_pipeline_stage=vpp_layers,
                              use_distributed_optimizer=distopt, num_micro_batches=NUM_MICRO)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    hf = gpu_model("llama", seed=0 if save else 1)
    data = dataset((BEFORE + AFTER) * MICRO * NUM_MICRO)
    loader = DataLoader(data, batch_size=MICRO // dp, shuffle=False, drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=BEFORE + AFTER, warmup_num_steps=2)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)
    engine.train()
    batches = iter(loader)
    ckpt = os.path.join(root, "ckpt")
    out = {}
    if save:
        for _ in range(BEFORE):
            engine(**next(batches))
        acc.save_state(ckpt)
        weights = {k: v.cpu() for k, v in acc.get_state_dict(engine).items()}
        if dist.get_rank() == 0:
            torch.save(weights, os.path.join(root, "weights.pt"))
    if load:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            meta = acc.load_state(ckpt)
        saved = torch.load(os.path.join(root, "weights.pt"))
        now = {k: v.cpu() for k, v in acc.get_state_dict(engine).items()}
        out.update(iteration=meta["iteration"], optimizer_loaded=meta["optimizer_loaded"],
                   exact=now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved),
                   warnings=[str(w.message) for w in caught if "load_state" in str(w.message)])
        for _ in range(BEFORE):
            next(batches)
        out["losses"] = [engine(**next(batches)).loss.item()]
        stepped = {k: v.cpu() for k, v in acc.get_state_dict(engine).items()}
        # one AdamW step moves each element by about lr (a few % of a weight matrix's norm); from stale fp32
        # main weights (this run's other initial weights) a matrix would move by about its own norm
        out["largest_move"] = max(((stepped[k].float() - saved[k].float()).norm() / saved[k].float().norm()).item()
                                  for k in saved if saved[k].float().norm() > 0)
        out["losses"] += [engine(**next(batches)).loss.item() for _ in range(AFTER - 1)]
        return out
    out["losses"] = [engine(**next(batches)).loss.item() for _ in range(AFTER)]
    return out


@pytest.fixture(scope="module")
def saved_dp2_distopt(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root = str(tmp_path_factory.mktemp("distopt"))
    first = run_on_ranks(_run, 2, root, 1, True, True, False)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(os.path.join(root, "ckpt", "iter_0000003"))
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["args"].use_distributed_optimizer and common["args"].data_parallel_size == 2
    return root, first[0]["losses"]


@two_gpus
def test_distributed_optimizer_resumes_at_its_layout(saved_dp2_distopt):
    root, losses = saved_dp2_distopt
    for res in run_on_ranks(_run, 2, root, 1, True, False, True):
        assert res["exact"] and res["iteration"] == BEFORE and res["optimizer_loaded"], res
        for a, b in zip(res["losses"], losses):
            assert abs(a - b) / b < 1e-3, (res["losses"], losses)


@two_gpus
def test_distributed_optimizer_state_reshards_to_tp2(saved_dp2_distopt):
    root, losses = saved_dp2_distopt
    for res in run_on_ranks(_run, 2, root, 2, True, False, True):  # DP=2 -> TP=2 x DP=1
        assert res["exact"] and res["iteration"] == BEFORE and res["optimizer_loaded"], res
        for a, b in zip(res["losses"], losses):
            assert abs(a - b) / b < 1e-2, (res["losses"], losses)


@two_gpus
def test_weights_only_into_a_run_without_the_distributed_optimizer(saved_dp2_distopt):
    root, losses = saved_dp2_distopt
    for res in run_on_ranks(_run, 2, root, 1, False, False, True):
        assert res["exact"] and not res["optimizer_loaded"]
        assert any("use_distributed_optimizer=True" in w and "starts fresh" in w for w in res["warnings"]), res
        assert abs(res["losses"][0] - losses[0]) / losses[0] < 1e-3  # the loaded weights compute it
        assert res["largest_move"] < 0.3, res  # the optimizer's fp32 main weights followed the loaded ones


@pytest.mark.parametrize("distopt", [True, False], ids=["distributed_optimizer", "mixed_precision_optimizer"])
def test_round_trip_on_one_gpu(tmp_path, distopt):
    """megatron-core's DistributedOptimizer (fully_reshardable state) or its mixed-precision optimizer (one
    tensor per parameter and state, the step once): saved, then resumed in a fresh run; then loaded into a
    run with the other optimizer, which starts fresh from the loaded weights."""
    (first,) = run_on_ranks(_run, 1, str(tmp_path), 1, distopt, True, False)
    (res,) = run_on_ranks(_run, 1, str(tmp_path), 1, distopt, False, True)
    assert res["exact"] and res["iteration"] == BEFORE and res["optimizer_loaded"], res
    assert res["largest_move"] < 0.3, res
    for a, b in zip(res["losses"], first["losses"]):
        assert abs(a - b) / b < 1e-3, (res["losses"], first["losses"])
    (other,) = run_on_ranks(_run, 1, str(tmp_path), 1, not distopt, False, True)
    assert other["exact"] and not other["optimizer_loaded"], other
    assert any(f"use_distributed_optimizer={distopt}" in w and "starts fresh" in w for w in other["warnings"]), other
    assert abs(other["losses"][0] - first["losses"][0]) / first["losses"][0] < 1e-3
    assert other["largest_move"] < 0.3, other  # the fresh optimizer's fp32 main weights are the loaded ones


@two_gpus
def test_virtual_pipeline_checkpoint_loads_without_pipeline(tmp_path):
    """Saved with 2 pipeline stages of 2 virtual stages each (`model0`, `model1`, global layer numbers), loaded
    at TP=2 without pipeline: weights and (non-distributed) optimizer state reshard."""
    first = run_on_ranks(_run, 2, str(tmp_path), 1, False, True, False, 2, 1)
    for res in run_on_ranks(_run, 2, str(tmp_path), 2, False, False, True):
        assert res["exact"] and res["iteration"] == BEFORE and res["optimizer_loaded"], res
        assert res["largest_move"] < 0.3, res
        for a, b in zip(res["losses"], first[-1]["losses"]):  # the last stage's losses, shared by every stage
            assert abs(a - b) / b < 1e-2, (res["losses"], first[-1]["losses"])
