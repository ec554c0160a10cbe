"""Per-token log-probabilities (and entropy) of a batch, forward only, vocab-parallel.

The train step says how a batch becomes logits and which token each position scores
(`forward_logits`); here those logits become token-aligned log p(token) without the vocabulary ever
being gathered: each TP rank reduces its own slice, and a few numbers per position cross ranks.

`LogProbs` is the engine's `compute_log_probs`. How the micro-batches run forward only and how their
rows reach every rank is the engine's (`run_forward_only`, `gather_rows`): the CUDA engine runs them
through the pipeline schedule and sends the last stage's rows to the other stages. Under context
parallelism each CP rank scores its part of the sequence and the rows are gathered whole (`unshard`)
before the shift to the tokens, so every CP rank returns the whole [b, s].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import torch
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.context_parallel import unshard
from .expert_group import check_same_shapes


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise MegatronPluginConfigError(
            "temperature", temperature, "pass a positive number (1.0: the model's own distribution; RL passes its sampling temperature)"
        )
    return float(temperature)


def _loss(targets, shift, true_vocab, temperature, entropy, output):
    from train_steps.utils import per_token_log_probs, shift_to_tokens

    if parallel_state.get_context_parallel_world_size() == 1:
        result = per_token_log_probs(output, targets, shift, true_vocab, temperature, entropy)
        log_probs, ent = result if entropy else (result, None)
    else:
        # this CP rank's positions are two chunks of the sequence: a value moves `shift` places to its
        # token across the chunks' edges only once the whole sequence is in order
        result = per_token_log_probs(output, targets, 0, true_vocab, temperature, entropy)
        log_probs, ent = (None if t is None else shift_to_tokens(unshard(t, 1), shift)
                          for t in (result if entropy else (result, None)))
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


class LogProbs:
    """Per-token log-probabilities (and entropy) of a batch under an engine's model, forward only."""

    def __init__(self):
        self._family_step = None  # the family's own step, for log-probs when the user's step has no logits

    def compute(self, engine, batch, temperature: float = 1.0, entropy: bool = False):
        """See `MegatronEngine.compute_log_probs`."""
        engine.check_ready("compute_log_probs", swapped_ok=True)
        if not isinstance(batch, Mapping):
            raise MegatronPluginConfigError(
                "compute_log_probs(batch)", type(batch).__name__,
                "pass the batch as model(**batch) takes it: a dict of tensors, {'input_ids': ..., 'attention_mask': ..., "
                "'labels': ...}",
            )
        temperature = check_temperature(temperature)
        if not isinstance(entropy, bool):
            raise MegatronPluginConfigError("entropy", entropy, "pass True or False")
        step = self.logits_step(engine)
        micro_batches = engine.micro_batches(batch, step)
        engine.check_batch(batch, step, micro_batches, need_loss=False)
        check_same_shapes(engine, micro_batches, step, "compute_log_probs(batch)")
        forward_step = log_prob_forward_step(step, engine.model.hf_config.vocab_size, temperature, entropy)
        was_training = engine.training
        with engine.manual_gc.quiet():
            engine.train(False)
            try:
                with engine.post_training.busy(), engine.rng.active(), torch.no_grad():
                    collected = engine.run_forward_only(micro_batches, forward_step, step)
            finally:
                engine.train(was_training)
        log_probs = engine.gather_rows(collected, "log_probs")
        return (log_probs, engine.gather_rows(collected, "entropy")) if entropy else log_probs

    def logits_step(self, engine):
        """The train step to ask for logits: the user's, if it (or its base class) defines
        `forward_logits` for plain batches (input_ids first), else the family's own step."""
        from train_steps.base import AbstractTrainStep

        model = engine.model
        family = model.family
        if model.variant not in family.trainable_variants:
            raise MegatronPluginConfigError(
                "model", family.classes.get(model.variant, model.variant),
                "log-probabilities need the model's LM head: prepare a model with one (e.g. ...ForCausalLM)",
            )
        handler = engine.train_step_handler
        if type(handler).forward_logits is not AbstractTrainStep.forward_logits and handler.input_key == "input_ids":
            return handler
        if self._family_step is None:
            import train_steps

            self._family_step = getattr(train_steps, family.train_step)(engine.megatron_args)
        return self._family_step
