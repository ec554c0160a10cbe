"""The start-up layout report over NCCL (issue 33): the hostnames gathered with all_gather_object on the
GPU group, the table on rank 0 only; a world of one reports nothing.

    python -m pytest -q tests/gpu/test_multinode_report_gpu.py
"""

import socket

import pytest
import torch

from megatron_plugin.placement import tp_warning
from tests.spawn import run_on_ranks
from tests.test_multinode_config import _report_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus


def test_one_gpu_reports_nothing():
    ((logged, rank),) = run_on_ranks(_report_worker, 1, 1)
    assert (logged, rank) == ([], 0)


@two_gpus
def test_report_over_nccl_on_rank_0():
    host = socket.gethostname()
    (logged0, _), (logged1, _) = run_on_ranks(_report_worker, 2, 2)  # each GPU plays its own machine
    assert logged1 == []
    assert logged0 == [
        ("INFO", "\n".join([
            "Megatron layout: 2 processes on 2 machine(s); TP=2 x CP=1 x PP=1 x DP=1 (megatron-core rank order tp-cp-dp-pp)",
            f"  machines (ranks): {host}#0: 0 | {host}#1: 1",
            f"  TP groups (1 of 2, 1 spanning machines): [0@{host}#0 1@{host}#1]",
        ])),
        ("WARNING", tp_warning(2, 1, 2)),
    ]
