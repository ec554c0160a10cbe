"""Per-token log-probabilities (and entropy) of a batch, forward only, vocab-parallel.

The train step says how a batch becomes logits and which token each position scores
(`forward_logits`); here those logits become token-aligned log p(token) without the vocabulary ever
being gathered: each TP rank reduces its own slice, and a few numbers per position cross ranks.
"""

from __future__ import annotations

import math
from functools import partial

from ..errors import MegatronPluginConfigError


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise MegatronPluginConfigError(
            "temperature", temperature, "pass a positive number (1.0: the model's own distribution; RL passes its sampling temperature)"
        )
    return float(temperature)


def _loss(targets, shift, true_vocab, temperature, entropy, output):
    from train_steps.utils import per_token_log_probs

    result = per_token_log_probs(output, targets, shift, true_vocab, temperature, entropy)
    log_probs, ent = result if entropy else (result, None)
    logs = {"log_probs": log_probs}
    if ent is not None:
        logs["entropy"] = ent
    # the schedules want a loss even when they run forward only
    return log_probs.sum() * 0.0, logs


def log_prob_forward_step(step, true_vocab: int, temperature: float, entropy: bool):
    """A `forward_step(data_iterator, model)` for the schedules whose loss function logs the micro-batch's
    token-aligned 'log_probs' (and 'entropy') [b, s]."""

    def forward_step(data_iterator, model):
        output, targets, shift = step.forward_logits(next(data_iterator), model)
        return output, partial(_loss, targets, shift, true_vocab, temperature, entropy)

    return forward_step
