"""Faults a run meets in the field: one rank killed (SIGKILL: the OOM killer, a preempted node) in the middle of
a step under `accelerate launch` ends every rank promptly, with a report naming the rank that was lost."""
import os
import re
import time

import pytest

from tests.launch import CONFIGS, ROOT, accelerate_launch

KILL_SCRIPT = os.path.join(ROOT, "tests", "scripts", "kill_rank.py")


@pytest.mark.parametrize("config,victim,where", [
    ("cpu_dp2.yaml", 1, "before"),  # its peer waits in the step's first collective (the batch check)
    ("cpu_tp2.yaml", 0, "forward"),  # the rendezvous store's rank, dead inside a tensor-parallel forward
])
def test_sigkill_of_one_rank_ends_every_rank_naming_it(config, victim, where):
    with pytest.raises(AssertionError) as failed:  # accelerate_launch raises on a non-zero exit, with the output
        accelerate_launch(os.path.join(CONFIGS, config), KILL_SCRIPT, victim, where, timeout=120)
    ended = time.time()
    out = str(failed.value)
    killed = re.search(rf"KILLED {victim} AT (\d+\.\d+)", out)
    assert killed, out[-3000:]
    # measured: about 0.5 s (gloo sees the peer's socket reset; the launcher then sends the rest SIGTERM)
    assert ended - float(killed.group(1)) < 60, ended - float(killed.group(1))
    assert "failed (1):" in out.splitlines()[0] and "finished" not in out, out[-3000:]
    # torch elastic's report: the root cause is the lost rank, killed by signal 9
    root = out[out.index("Root Cause"):]
    assert re.search(rf"rank\s*: {victim} \(local_rank: {victim}\)", root), root
    assert re.search(r"exitcode\s*: -9 .*SIGKILL", root), root
    # and the survivor ended too (its gloo collective failed on the closed connection, or the launcher's SIGTERM)
    survivor = 1 - victim
    assert re.search(rf"rank\s*: {survivor} \(local_rank: {survivor}\)\s*exitcode\s*: (-15|1) ", out), out[-3000:]
