"""The multi-process harness itself: a hung task reports where each rank waits."""

import time

import pytest

from tests import spawn


def _hang_in_rank_1():
    import os

    if os.environ["RANK"] == "1":
        time.sleep(60)
    return "done"


def test_a_timed_out_task_reports_each_hung_rank_stack(monkeypatch):
    monkeypatch.setattr(spawn, "TIMEOUT_S", 4)
    with pytest.raises(AssertionError) as e:
        spawn.run_on_ranks(_hang_in_rank_1, 2)
    msg = str(e.value)
    assert "_hang_in_rank_1 timed out after 4s" in msg
    # faulthandler's frame line for the sleep: file, line and function of where rank 1 waits
    rank1 = msg.split("--- rank 1 stacks ---")[1]
    assert 'test_spawn.py", line 14 in _hang_in_rank_1' in rank1, rank1
    assert spawn.run_on_ranks(abs, 2, -3) == [3, 3]  # the killed workers are replaced
