"""The plugin's optimizer fields on the CUDA engine (megatron-core's optimizer):

- optimizer_cpu_offload (with the distributed optimizer, as megatron-core needs): its HybridDeviceOptimizer
  holds the Adam states and fp32 master weights on the CPU and trains like the GPU optimizer;
- scale_lr_cond/lr_mult and no_wd_decay_cond become megatron-core's config_overrides: the groups it forms
  carry the selected parameters' learning rate and weight decay, and an lr_mult of 0 freezes them bit for bit;
- without a scheduler, the groups train with mcore's no-weight-decay rule already applied.

    python -m pytest -q tests/gpu/test_optimizer_fields_gpu.py
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader

from tests.gpu.workers import MICRO, NUM_MICRO, dataset, gpu_model
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, WARMUP, LR = 8, 2, 1e-3


def _prepare(fields, precision, scheduler=True):
    return _prepare_with_accelerator(fields, precision, scheduler)[1:]


def _prepare_with_accelerator(fields, precision, scheduler=True):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=NUM_MICRO, **fields),
                      mixed_precision=precision)
    hf = gpu_model()
    loader = DataLoader(dataset(STEPS * MICRO * NUM_MICRO), batch_size=MICRO, drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.01)
    extra = [MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)] if scheduler else []
    engine, opt, *_, loader = acc.prepare(hf, opt, *extra, loader)
    return acc, engine, opt, loader


def offload_run(offload=False, overlap=False):
    """bf16 with the distributed optimizer: losses, and where the optimizer keeps its state."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    fields = dict(use_distributed_optimizer=True, optimizer_cpu_offload=offload, overlap_cpu_optimizer_d2h_h2d=overlap,
                  no_save_optim=offload)
    engine, opt, loader = _prepare(fields, "bf16")
    engine.train()
    losses = [engine(**batch).loss.item() for batch in loader]
    inner = [o.optimizer for o in engine.optimizer.chained_optimizers]
    hybrid = [o for o in inner if isinstance(o, HybridDeviceOptimizer)]
    states = [t for o in inner for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
    return {
        "losses": losses,
        "hybrid": len(hybrid) == len(inner),
        "gpu_sub_optimizers": sum(o.gpu_optimizer is not None for o in hybrid),
        "state_devices": sorted({t.device.type for t in states}),
        "state_tensors": len(states),
        "cpu_sub_optimizers": sum(len(o.cpu_optimizers) for o in hybrid),
    }


def test_optimizer_cpu_offload_keeps_state_on_cpu_and_trains_like_the_gpu_optimizer():
    (base,) = run_on_ranks(offload_run, 1)
    (off,) = run_on_ranks(offload_run, 1, True)
    (overlap,) = run_on_ranks(offload_run, 1, True, True)
    assert not base["hybrid"] and base["state_devices"] == ["cuda"], base
    for run in (off, overlap):
        # Megatron-LM's --optimizer-offload-fraction 1.0: every state and master weight on the CPU
        assert run["hybrid"] and run["gpu_sub_optimizers"] == 0 and run["state_devices"] == ["cpu"], run
        assert run["state_tensors"] > 0
        for step, (a, b) in enumerate(zip(run["losses"], base["losses"])):
            # the same fp32 Adam update on another device: bf16 noise only (4e-5 seen on an H100)
            assert abs(a - b) <= 2e-3 * abs(b), (step, run["losses"], base["losses"])
    assert overlap["cpu_sub_optimizers"] > off["cpu_sub_optimizers"]  # one CPU optimizer per parameter, to overlap
    assert base["losses"][-1] < base["losses"][0] - 0.1


def conditions_run(scheduler=True):
    """fp32, mcore's FP32 optimizer (its groups hold the model's parameters): group settings per parameter,
    the learning rates of every step, and the weights before and after."""
    fields = dict(lr_mult=0.0, scale_lr_cond=lambda name, p: name.startswith("decoder.layers.0."),
                  no_wd_decay_cond=lambda name, p: p.dim() == 1 or name.endswith("linear_fc2.weight"))
    engine, opt, loader = _prepare(fields if scheduler else {}, "no", scheduler=scheduler)
    names = {id(p): n for n, p in engine.model.module.named_parameters()}
    groups = [dict(names=[names[id(p)] for p in g["params"]], dims=[p.dim() for p in g["params"]],
                   max_lr=g.get("max_lr"), lr=g["lr"], weight_decay=g["weight_decay"], wd_mult=g.get("wd_mult", 1.0))
              for g in opt.param_groups]
    if not scheduler:
        return {"groups": groups}
    before = {n: p.detach().cpu().clone() for n, p in engine.model.module.named_parameters()}
    lrs = [[g["lr"] for g in opt.param_groups]]
    engine.train()
    for batch in loader:
        engine(**batch)
        lrs.append([g["lr"] for g in opt.param_groups])
    after = {n: p.detach().cpu().clone() for n, p in engine.model.module.named_parameters()}
    return {"groups": groups, "lrs": lrs, "before": before, "after": after}


def test_conditions_form_megatron_core_groups():
    (run,) = run_on_ranks(conditions_run, 1)
    seen = []
    for gi, g in enumerate(run["groups"]):
        for name, dim in zip(g["names"], g["dims"]):
            seen.append(name)
            scaled = name.startswith("decoder.layers.0.")
            assert g["max_lr"] == (0.0 if scaled else LR), (name, g)
            assert g["weight_decay"] == (0.0 if dim == 1 or name.endswith("linear_fc2.weight") else 0.01), (name, g)
        for step, lrs in enumerate(run["lrs"]):  # linear warmup, then linear decay to 0 (Megatron's formula)
            ref = LR * step / WARMUP if step <= WARMUP else LR * (1 - (step - WARMUP) / (STEPS - WARMUP))
            assert math.isclose(lrs[gi], ref * g["max_lr"] / LR, rel_tol=1e-12, abs_tol=1e-15), (gi, step, lrs)
    assert sorted(seen) == sorted(run["before"])
    frozen = [n for n in run["before"] if n.startswith("decoder.layers.0.")]
    assert frozen and all(torch.equal(run["before"][n], run["after"][n]) for n in frozen)
    assert all(not torch.equal(run["before"][n], run["after"][n]) for n in run["before"] if n not in frozen)


def test_without_a_scheduler_groups_train_with_mcores_weight_decay_rule():
    (run,) = run_on_ranks(conditions_run, 1, False)
    assert {g["wd_mult"] for g in run["groups"]} == {0.0, 1.0}
    for g in run["groups"]:
        # biases and norms (wd_mult 0) get none: before, every group decayed until a scheduler stepped
        assert g["weight_decay"] == 0.01 * g["wd_mult"] and g["lr"] == LR, g
        assert (g["wd_mult"] == 0.0) == all(d == 1 for d in g["dims"]), g



def offload_resume_run(ckpt, fmt, resume):
    """optimizer_cpu_offload saves with no_save_optim (required): train 4 steps and save; a new run loads the
    weights (the optimizer restarts). Returns the weights after the save or after the load."""
    fields = dict(use_distributed_optimizer=True, optimizer_cpu_offload=True, no_save_optim=True, ckpt_format=fmt)
    acc, engine, opt, loader = _prepare_with_accelerator(fields, "bf16")
    engine.train()
    if resume:
        acc.load_state(ckpt)
    else:
        for b in list(loader)[:4]:
            engine(**b)
        acc.save_state(ckpt)
    return {n: p.detach().cpu().clone() for n, p in engine.model.module.named_parameters()}


@pytest.mark.parametrize("fmt", ["torch_dist", "megatron_plugin"])
def test_optimizer_cpu_offload_saves_weights_without_its_state(tmp_path, fmt):
    ckpt = str(tmp_path / "ckpt")
    (saved,) = run_on_ranks(offload_resume_run, 1, ckpt, fmt, False)
    (loaded,) = run_on_ranks(offload_resume_run, 1, ckpt, fmt, True)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_optimizer_cpu_offload_without_no_save_optim_is_refused():
    from megatron_plugin import MegatronPluginConfigError

    with pytest.raises(MegatronPluginConfigError, match="optimizer_cpu_offload=True: checkpoints of the CPU-offloaded"):
        _prepare(dict(use_distributed_optimizer=True, optimizer_cpu_offload=True), "bf16")


def direct_copies_run(mcores_loops):
    """bf16 with the distributed optimizer, STEPS steps: losses and every weight afterwards, with the engine's
    direct shard copies (engine/gpu._distopt_direct_copies) or with megatron-core's own per-weight loops."""
    import torch.distributed as dist

    engine, opt, loader = _prepare(dict(use_distributed_optimizer=True, gradient_clipping=1.0), "bf16")
    inner = engine.optimizer.chained_optimizers
    names = ("_copy_model_grads_to_main_grads", "_copy_main_params_to_model_params")
    installed = all(name in o.__dict__ for o in inner for name in names)
    if mcores_loops:
        for o in inner:
            for name in names:
                o.__dict__.pop(name)
    engine.train()
    losses = [engine(**batch).loss.item() for batch in loader]
    weights = {n: p.detach().float().cpu() for n, p in engine.named_parameters()}
    return {"losses": losses, "weights": weights, "installed": installed, "dp": dist.get_world_size()}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.two_gpus)], ids=["dp1", "dp2"])
def test_distributed_optimizer_direct_copies_train_as_mcores_loops_bit_for_bit(world):
    ours = run_on_ranks(direct_copies_run, world, False)
    mcore = run_on_ranks(direct_copies_run, world, True)
    for a, b in zip(ours, mcore):
        assert a["installed"] and a["dp"] == world, a["installed"]
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert a["losses"][-1] < a["losses"][0] - 0.1, a["losses"]
        assert a["weights"].keys() == b["weights"].keys()
        for name, w in a["weights"].items():
            assert torch.equal(w, b["weights"][name]), name
