"""save_state: a save that dies part-way leaves the previous checkpoint as the one the tracker names
(the native format's `latest`, torch_dist's `latest_checkpointed_iteration.txt`), and it loads: model and
iteration come back as saved. A save of an older iteration into a folder that holds a newer checkpoint
keeps the newer one, and says so. (Several ranks: test_checkpoint_reliability.)"""

import logging
import os
import shutil

import pytest
import torch

from tests.errors import check_refusal, refusal
from tests.spawn import run_on_ranks
from tests.training import failing_save, model_weights, prepared_gpt2


# ckpt_format -> (the tracker file, what it holds for iteration 2)
TRACKERS = {"megatron_plugin": ("latest", "iter_0000002"), "torch_dist": ("latest_checkpointed_iteration.txt", "2")}


def _crash_worker(ckpt, fmt):
    acc, engine, batches = prepared_gpt2(steps_before=2, ckpt_format=fmt)
    acc.save_state(ckpt)
    saved = model_weights(engine)
    engine(**next(batches))  # the weights move on past the checkpoint

    with failing_save(ckpt_format=fmt):  # writes its files, then the process "dies"
        crashed = refusal(acc.save_state, ckpt)
    with open(os.path.join(ckpt, TRACKERS[fmt][0])) as f:
        latest = f.read().strip()
    before = engine.model.module.state_dict()
    moved = any(not torch.equal(before[k], v) for k, v in saved.items())
    meta = acc.load_state(ckpt)
    now = engine.model.module.state_dict()
    return {
        "crashed": crashed,
        "latest": latest,
        "iteration": meta["iteration"],
        "engine_iteration": engine.iteration,
        "moved": moved,
        "restored": all(torch.equal(now[k], v) for k, v in saved.items()),
    }


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, fmt):
    # One rank, its save failing after its files: the error is clear and the tracker is untouched
    # (two ranks, one failing or killed: test_checkpoint_reliability).
    (res,) = run_on_ranks(_crash_worker, 1, str(tmp_path / "ckpt"), fmt)
    check_refusal(res["crashed"], "save_state(output_dir)", "rank 0", "OSError: disk full (simulated)")
    assert res["latest"] == TRACKERS[fmt][1] and res["iteration"] == 2 and res["engine_iteration"] == 2
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000002", TRACKERS[fmt][0]]  # the staging folder went
    assert res["moved"] and res["restored"]



def _older_over_newer_worker(root, fmt):
    acc, engine, batches = prepared_gpt2(steps_before=2, ckpt_format=fmt)
    old_dir, ckpt = os.path.join(root, "old"), os.path.join(root, "ckpt")
    acc.save_state(old_dir)
    at2 = model_weights(engine)
    engine(**next(batches))
    engine(**next(batches))
    acc.save_state(ckpt)  # iteration 4
    at4 = model_weights(engine)
    acc.load_state(old_dir)  # back at iteration 2, as a run resumed from an older checkpoint
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("megatron_plugin.engine.checkpoint")
    logger.addHandler(handler)
    try:
        written = acc.save_state(ckpt)  # iteration 2 into the folder holding iteration 4
    finally:
        logger.removeHandler(handler)
    with open(os.path.join(ckpt, TRACKERS[fmt][0])) as f:
        latest = f.read().strip()
    entries = sorted(os.listdir(ckpt))
    newer = acc.load_state(os.path.join(ckpt, "iter_0000004"))["iteration"], engine.iteration
    newer_equal = all(torch.equal(v, at4[k]) for k, v in model_weights(engine).items())
    latest_meta = acc.load_state(ckpt)["iteration"], engine.iteration
    latest_equal = all(torch.equal(v, at2[k]) for k, v in model_weights(engine).items())
    return {"written": os.path.basename(written), "latest": latest, "entries": entries, "newer": newer,
            "newer_equal": newer_equal, "latest_meta": latest_meta, "latest_equal": latest_equal,
            "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING],
            "differ": any(not torch.equal(v, at4[k]) for k, v in at2.items())}


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_saving_an_older_iteration_keeps_the_newer_checkpoint(tmp_path, fmt):
    (res,) = run_on_ranks(_older_over_newer_worker, 1, str(tmp_path), fmt)
    ckpt = str(tmp_path / "ckpt")
    assert res["written"] == "iter_0000002" and res["latest"] == TRACKERS[fmt][1]  # the tracker names it
    assert res["entries"] == sorted(["iter_0000002", "iter_0000004", TRACKERS[fmt][0]])  # the newer one is kept
    assert res["newer"] == (4, 4) and res["newer_equal"] and res["differ"]
    assert res["latest_meta"] == (2, 2) and res["latest_equal"]
    (message,) = res["warnings"]
    for words in (ckpt, "iter_0000004 of iteration 4", "is kept", "iter_0000002 of iteration 2",
                  os.path.join(ckpt, "iter_0000004")):
        assert words in message, (words, message)


# -- checkpoints across machines: a folder that is not shared ---------------------------------------------
# Two ranks that are given different folders see what two machines with local disks see: rank 1 cannot see
# the files rank 0 writes. The real code path runs: only the path differs by rank (`_sees` is wrapped to count
# probes, not changed).

def _unshared_worker(root, fmt):
    import torch.distributed as dist

    from megatron_plugin.engine.checkpointing import shared

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    acc, engine, batches = prepared_gpt2(steps_before=2, ckpt_format=fmt)
    ckpt = os.path.join(root, "ckpt")
    local = ckpt if rank == 0 else os.path.join(root, f"local{rank}")  # this "machine's" own folder
    probes = []
    real_sees = shared._sees
    shared._sees = lambda *a: probes.append(a[0]) or real_sees(*a)
    try:
        acc.save_state(ckpt)  # shared: passes, probed once
        acc.save_state(ckpt)  # the same folder again: no probe
        saved = model_weights(engine)
        probes_after_shared = len(probes)
        listing = sorted(os.listdir(ckpt))
        with open(os.path.join(ckpt, TRACKERS[fmt][0])) as f:
            tracker = f.read()
        save_refused = refusal(acc.save_state, local)
        refused_again = refusal(acc.save_state, local)  # a refused folder is not cached as good
        # a first save into new folders, one per "machine": rank 0 makes its folder for the probe only
        fresh = os.path.join(root, f"fresh{rank}")
        fresh_refused = refusal(acc.save_state, fresh)
        listing_after = sorted(os.listdir(ckpt))
        with open(os.path.join(ckpt, TRACKERS[fmt][0])) as f:
            tracker_after = f.read()
        engine(**next(batches))  # training goes on after the refusal
        load_missing = refusal(acc.load_state, local)  # rank 1's folder does not exist
        other = ckpt if rank == 0 else os.path.join(root, f"other{rank}")
        if rank != 0:  # this "machine" has a folder there, but a stale copy: no complete checkpoint
            shutil.copytree(ckpt, other)
            os.remove(os.path.join(other, TRACKERS[fmt][0]))
        load_other = refusal(acc.load_state, other)
        load_ok = acc.load_state(ckpt)["iteration"]
        restored = all(torch.equal(v, saved[k]) for k, v in model_weights(engine).items())
    finally:
        shared._sees = real_sees
    return {"probes": probes_after_shared, "listing": listing, "listing_after": listing_after,
            "tracker_same": tracker == tracker_after, "save_refused": save_refused, "refused_again": refused_again,
            "load_missing": load_missing, "load_other": load_other, "load_ok": load_ok, "restored": restored,
            "local": local, "fresh": fresh, "fresh_refused": fresh_refused}


@pytest.mark.parametrize("fmt", sorted(TRACKERS))
def test_unshared_folder_is_refused_before_anything_is_written(tmp_path, fmt):
    import socket

    results = run_on_ranks(_unshared_worker, 2, str(tmp_path), fmt, env={"MEGATRON_PLUGIN_SHARED_DIR_WAIT_S": "0.2"})
    host = socket.gethostname()
    for rank, res in enumerate(results):
        assert res["probes"] == 1  # the second save into the folder that passed probes nothing
        assert res["listing"] == res["listing_after"] and res["tracker_same"]  # the checkpoint there is intact
        # one checkpoint (the native format names the second save of iteration 2 iter_0000002_1) and the
        # tracker: the probe file went
        assert len(res["listing"]) == 2 and res["listing"][0].startswith("iter_0000002")
        assert res["listing"][1] == TRACKERS[fmt][0]
        for got, folder in ((res["save_refused"], res["local"]), (res["refused_again"], res["local"]),
                            (res["fresh_refused"], res["fresh"])):
            check_refusal(got, "save_state(output_dir)", folder, f"1 of 2 ranks (hosts: {host} (rank 1))",
                          "do not see the files rank 0", "must be shared by every machine", "pass a shared path")
        for got in (res["load_missing"], res["load_other"]):
            check_refusal(got, "load_state input_dir", "not visible on hosts", f"{host} (rank 1)",
                          os.path.abspath(str(tmp_path / "ckpt")), "must be shared by every machine")
        assert res["load_ok"] == 2 and res["restored"]
    # rank 1 wrote nothing into its own folders; rank 0 removed the one it made for its probe
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "other1"]
