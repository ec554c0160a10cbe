"""Checkpoints under the faults a real run meets.

- load_state refuses a checkpoint of another model (other layer count, MLP width, family, variant) before
  anything is loaded, naming each setting that differs, on the same-layout path and the resharding path;
  the same model in another TP layout, or with settings that shape no weight (dropout), still loads.
- A rank failing part-way through save_state stops every rank with one clear error (none is left waiting
  in a collective), and a rank killed part-way leaves the tracker (the native format's `latest`,
  torch_dist's `latest_checkpointed_iteration.txt`) naming the previous checkpoint: a fresh load gets it
  back bit for bit, with its iteration. Both formats.
"""

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

from checkpoint_utils import convert_hf_to_megatron
from tests.errors import check_refusal, refusal
from tests.models import tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks
from tests.training import failing_save, model_weights, optimizer_for, token_dataset


def _prepared(tp, seed, ckpt_format="torch_dist"):
    """A tiny 2-layer GPT-2 (`seed`: its initial weights) prepared at `tp` on every process."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2("tied", seed=seed)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp, ckpt_format=ckpt_format))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=10), DataLoader(token_dataset(24, 1000), batch_size=4)
    )
    engine.train()
    return acc, engine, iter(loader)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- a checkpoint of another model -----------------------------------------------------------------------
# name -> (the HF model the checkpoint is converted from, its TP size); the run is 2-layer GPT-2 at TP=2,
# so a TP=2 checkpoint takes the same-layout path and a TP=1 one the resharding path
OTHERS = {
    "layers_tp2": (lambda: tiny_gpt2("tied", n_layer=3), 2),  # the issue: it loaded, and training went on
    "layers_ffn_tp1": (lambda: tiny_gpt2("tied", n_layer=3, n_inner=128), 1),
    "llama_tp2": (lambda: tiny_llama("llama"), 2),
    "base_tp2": (lambda: tiny_gpt2("tied", lm_head=False), 2),
}
SAME = {
    "same_tp2": (lambda: tiny_gpt2("tied", seed=1), 2),
    "same_dropout_tp1": (lambda: tiny_gpt2("tied", seed=2, attn_pdrop=0.1, resid_pdrop=0.1), 1),
}


def _load_other_models(root):
    acc, engine, _ = _prepared(tp=2, seed=5)
    before = model_weights(engine)
    out = {name: refusal(acc.load_state, os.path.join(root, name)) for name in OTHERS}
    out["untouched"] = _same(model_weights(engine), before) and engine.iteration == 0
    for name in SAME:
        got = refusal(acc.load_state, os.path.join(root, name))
        source = SAME[name][0]().state_dict()
        loaded = engine.hf_state_dict()
        out[name] = (got, all(torch.equal(loaded[k], source[k]) for k in loaded))
    return out


def test_a_checkpoint_of_another_model_is_refused_naming_the_settings(tmp_path):
    for name, (make, tp) in {**OTHERS, **SAME}.items():
        make().save_pretrained(tmp_path / "hf" / name)
        convert_hf_to_megatron(str(tmp_path / "hf" / name), str(tmp_path / name), tp=tp, progress=False)
    fix = "load it into a model built from the checkpoint's config"
    for res in run_on_ranks(_load_other_models, 2, str(tmp_path)):  # every rank refuses alike
        check_refusal(res["layers_tp2"], "load_state", str(tmp_path / "layers_tp2"),
                      "num_hidden_layers: checkpoint 3, this model 2", fix)
        check_refusal(res["layers_ffn_tp1"], "load_state", str(tmp_path / "layers_ffn_tp1"),
                      "num_hidden_layers: checkpoint 3, this model 2", "intermediate_size: checkpoint 128, this model 256", fix)
        assert "hidden_size" not in res["layers_ffn_tp1"][1]  # only what differs is named
        check_refusal(res["llama_tp2"], "load_state", "family: checkpoint llama, this model gpt2", fix)
        check_refusal(res["base_tp2"], "load_state", "variant: checkpoint base, this model lm", fix)
        assert res["untouched"]  # refused before anything was loaded
        # the same model loads, resharded or not, whatever its settings that shape no weight
        assert res["same_tp2"] == (None, True) and res["same_dropout_tp1"] == (None, True)


# -- a rank failing or dying inside save_state -----------------------------------------------------------
# ckpt_format -> (the tracker file, what it holds for iteration 2, how a failed save's error names it)
TRACKERS = {"megatron_plugin": ("latest", "iter_0000002", "latest"),
            "torch_dist": ("latest_checkpointed_iteration.txt", "2", "tracker")}


def _dying_save(root, how, fmt):
    import torch.distributed as dist

    acc, engine, batches = _prepared(tp=2, seed=0, ckpt_format=fmt)
    rank = dist.get_rank()
    engine(**next(batches))
    engine(**next(batches))
    ckpt = os.path.join(root, "ckpt")
    acc.save_state(ckpt)
    torch.save(model_weights(engine), os.path.join(root, f"saved{rank}.pt"))
    engine(**next(batches))  # the weights move on past the checkpoint

    with failing_save(how, active=rank == 1, ckpt_format=fmt):  # rank 1 writes its shards, then fails or dies
        got = refusal(acc.save_state, ckpt)
    with open(os.path.join(ckpt, TRACKERS[fmt][0])) as f:
        latest = f.read().strip()
    return {"refusal": got, "latest": latest, "entries": sorted(os.listdir(ckpt)), "iteration": engine.iteration}


def _fresh_load(root):
    import torch.distributed as dist

    acc, engine, _ = _prepared(tp=2, seed=5)  # other initial weights: the load must replace them
    meta = acc.load_state(os.path.join(root, "ckpt"))
    saved = torch.load(os.path.join(root, f"saved{dist.get_rank()}.pt"))
    return {"iteration": meta["iteration"], "engine_iteration": engine.iteration,
            "restored": _same(model_weights(engine), saved)}


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_a_rank_failing_mid_save_stops_every_rank_and_the_previous_checkpoint_loads(tmp_path, fmt):
    tracker, names, said = TRACKERS[fmt]
    for res in run_on_ranks(_dying_save, 2, str(tmp_path), "raise", fmt):  # returns: no rank hangs
        check_refusal(res["refusal"], "save_state(output_dir)", str(tmp_path / "ckpt"), "rank 1",
                      "OSError: disk full (simulated)", said, "iter_0000002")
        assert res["latest"] == names and res["iteration"] == 3
        assert res["entries"] == sorted(["iter_0000002", tracker])  # the half-written checkpoint is cleared away
    for res in run_on_ranks(_fresh_load, 2, str(tmp_path)):
        assert res == {"iteration": 2, "engine_iteration": 2, "restored": True}


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_to_load(tmp_path, fmt):
    tracker, names, _ = TRACKERS[fmt]
    with pytest.raises(AssertionError, match="died|failed"):  # the launcher sees the lost rank
        run_on_ranks(_dying_save, 2, str(tmp_path), "exit", fmt)
    entries = sorted(os.listdir(tmp_path / "ckpt"))
    assert "iter_0000002" in entries and "iter_0000003" not in entries
    assert (tmp_path / "ckpt" / tracker).read_text().strip() == names
    for res in run_on_ranks(_fresh_load, 2, str(tmp_path)):  # fresh processes, as a relaunched job
        assert res == {"iteration": 2, "engine_iteration": 2, "restored": True}


# -- context parallelism: a resumed run gets its optimizer and RNG states back ------------------------------
def _cp_prepared(cp, seed, fmt):
    """A tiny GPT-2 with dropout (the next step's loss reads the RNG) at context_parallel_size=`cp` over every
    process (the rest data parallel); this rank's batches."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2("tied", seed=seed, resid_pdrop=0.1, embd_pdrop=0.1)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(context_parallel_size=cp, ckpt_format=fmt))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=10), DataLoader(token_dataset(24, 1000), batch_size=4)
    )
    engine.train()
    return acc, engine, list(loader)


def _rng_now(engine):
    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "model": engine.rng.state_dict()}


def _equal(a, b):
    import numpy as np

    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _cp_save(root, name, cp, fmt):
    """Two steps, save_state, then the uninterrupted third step: its loss. This rank's RNG and optimizer
    states at the save go to a file for the loads to compare with."""
    import torch.distributed as dist

    acc, engine, batches = _cp_prepared(cp, 0, fmt)
    for b in batches[:2]:
        engine(**b)
    acc.save_state(os.path.join(root, name))
    torch.save({"rng": _rng_now(engine), "optimizer": engine.optimizer.state_dict()["state"]},
               os.path.join(root, f"{name}_rank{dist.get_rank()}.pt"))
    return engine(**batches[2]).loss.item()


def _cp_load(root, name, cp, fmt):
    """A fresh prepare (other initial weights) at context_parallel_size=`cp`, load_state, then the third step.
    Compared with the state the save left on this rank (rank 0's where the checkpoint had more processes)."""
    import warnings

    import torch.distributed as dist

    acc, engine, batches = _cp_prepared(cp, 5, fmt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(os.path.join(root, name))
    saved = torch.load(os.path.join(root, f"{name}_rank{dist.get_rank()}.pt"), weights_only=False)
    return {"iteration": engine.iteration, "rng": _equal(_rng_now(engine), saved["rng"]),
            "optimizer": len(saved["optimizer"]) > 0 and _equal(engine.optimizer.state_dict()["state"], saved["optimizer"]),
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("load_state: ")],
            "loss": engine(**batches[2]).loss.item()}


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_a_cp2_run_resumes_with_its_optimizer_and_rng_and_loads_at_cp1_as_a_dp_change_does(tmp_path, fmt):
    root = str(tmp_path)
    uninterrupted = run_on_ranks(_cp_save, 2, root, "cp2", 2, fmt)  # TP=1 CP=2 DP=1
    assert uninterrupted[0] == uninterrupted[1]
    run_on_ranks(_cp_save, 2, root, "dp2", 1, fmt)  # TP=1 CP=1 DP=2: the data-parallel change to compare with
    if fmt == "megatron_plugin":
        with open(os.path.join(root, "cp2", "iter_0000002", "meta.json")) as f:
            meta = json.load(f)
        assert (meta["world_size"], meta["cp"], meta["dp"]) == (2, 2, 1)

    # the same layout: optimizer (exp_avg, exp_avg_sq, step) and every RNG stream bit for bit, the same next loss
    for rank, res in enumerate(run_on_ranks(_cp_load, 2, root, "cp2", 2, fmt)):
        assert res["warnings"] == [], (rank, res["warnings"])
        assert res["rng"] and res["optimizer"] and res["iteration"] == 2, (rank, res)
        assert res["loss"] == uninterrupted[rank], (rank, res["loss"], uninterrupted[rank])

    # one process (CP=1 DP=1): the CP=2 checkpoint loads as the DP=2 one does. The optimizer's state, replicated
    # over DP x CP, loads; the RNG streams, one per rank, do not, with a warning
    at_cp1, at_dp1 = (run_on_ranks(_cp_load, 1, root, name, 1, fmt)[0] for name in ("cp2", "dp2"))
    for res in (at_cp1, at_dp1):
        assert res["optimizer"] and not res["rng"] and res["iteration"] == 2, res
        assert len(res["warnings"]) == 1 and "holds RNG states of" in res["warnings"][0], res["warnings"]
        assert "start from the plugin's seed" in res["warnings"][0] and "2 processes" in res["warnings"][0]
    assert "cp=2" in at_cp1["warnings"][0] or "context_parallel_size=2" in at_cp1["warnings"][0]
