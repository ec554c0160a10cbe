"""Training through accelerator.prepare matches plain HF + torch step for step (CPU, fp32)."""

import pytest

from tests.spawn import run_on_ranks
from tests.training import megatron_losses, reference_losses

STEPS = 20


@pytest.mark.parametrize(
    "tp,world,micro,num_micro",
    [(2, 2, 4, 1), (1, 2, 2, 2)],
    ids=["tp2_dp1", "tp1_dp2_2micro"],
)
def test_losses_match_hf_every_step(tp, world, micro, num_micro):
    global_batch = micro * num_micro * (world // tp)
    ref = reference_losses(STEPS, global_batch)
    per_rank = run_on_ranks(megatron_losses, world, tp, STEPS, micro, num_micro)
    assert ref[-1] < ref[0]  # the run learns something, so the comparison means something
    for rank, got in enumerate(per_rank):
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"rank {rank} step {step}: megatron {a} vs HF {b}"
