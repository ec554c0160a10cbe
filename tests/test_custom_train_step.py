"""The seed's GPTTrainStepWithCustomLoss runs unchanged and trains like the same loss in plain HF."""

import torch
import torch.nn.functional as F

from tests.seed_custom_step import GPTTrainStepWithCustomLoss
from tests.spawn import run_on_ranks
from tests.models import GPT2_CONFIGS
from tests.training import megatron_losses, reference_losses, token_dataset

# tokens that occur in the first steps' samples, so the weighting is not a no-op
_first = token_dataset(8, GPT2_CONFIGS["tied"]["vocab_size"])
KEYTOKENS = sorted({int(_first[i]["input_ids"][j]) for i in (0, 2, 5) for j in (1, 4)})
ALPHA = 0.25
STEPS = 6


def weighted_loss(batch, logits):
    ids = batch["input_ids"]
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    per_sample = per_token.view(ids.shape[0], -1).mean(dim=1)
    weights = 1.0 + ALPHA * torch.stack([(ids == k).float() for k in KEYTOKENS]).sum(dim=[0, 2])
    return (per_sample * weights).mean()


def test_seed_custom_loss_under_tp2():
    ref = reference_losses(STEPS, 4, loss_fn=weighted_loss)
    got = run_on_ranks(
        megatron_losses, 2, 2, STEPS, 4, 1, 1.0, GPTTrainStepWithCustomLoss, {"keytoken_ids": KEYTOKENS, "alpha": ALPHA}
    )
    plain = reference_losses(STEPS, 4)
    assert abs(ref[0] - plain[0]) > 1e-3  # the weighting changes the loss, so this test sees it
    for rank_losses in got:
        for step, (a, b) in enumerate(zip(rank_losses, ref)):
            assert abs(a - b) / b < 1e-4, f"step {step}: {a} vs {b}"
