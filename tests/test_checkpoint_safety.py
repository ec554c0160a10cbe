"""save_state: a save that dies part-way leaves the previous checkpoint as the one `latest` names,
and it loads: model and iteration come back as saved."""

import os

import torch

from tests.spawn import run_on_ranks
from tests.training import prepared_gpt2


def _crash_worker(ckpt):
    import megatron_plugin.engine.checkpointing.native_save as ckpt_mod

    acc, engine, batches = prepared_gpt2(steps_before=2)
    acc.save_state(ckpt)
    saved = {k: v.clone() for k, v in engine.model.module.state_dict().items() if not k.endswith("_extra_state")}
    engine(**next(batches))  # the weights move on past the checkpoint

    real_save = ckpt_mod.save_file

    def dying_save(tensors, path, *args, **kwargs):  # writes its file, then the process "dies"
        real_save(tensors, path, *args, **kwargs)
        raise OSError("disk full (simulated)")

    ckpt_mod.save_file = dying_save
    try:
        acc.save_state(ckpt)
        crashed = False
    except OSError:
        crashed = True
    finally:
        ckpt_mod.save_file = real_save
    with open(os.path.join(ckpt, "latest")) as f:
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


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    # One rank: a real crash kills every rank, which a test can't do to a multi-rank group cleanly;
    # the files are left as a killed save leaves them.
    (res,) = run_on_ranks(_crash_worker, 1, str(tmp_path / "ckpt"))
    assert res["crashed"]
    assert res["latest"] == "iter_0000002" and res["iteration"] == 2 and res["engine_iteration"] == 2
    assert res["moved"] and res["restored"]
