"""save_state: a save that dies part-way leaves the previous checkpoint as the one the tracker names
(the native format's `latest`, torch_dist's `latest_checkpointed_iteration.txt`), and it loads: model and
iteration come back as saved. A save of an older iteration into a folder that holds a newer checkpoint
keeps the newer one, and says so. (Several ranks: test_checkpoint_reliability.)"""

import logging
import os

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
