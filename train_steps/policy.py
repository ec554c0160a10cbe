"""Policy-gradient post-training (GRPO / PPO-clip) as a train step.

The loop around it is the user's, as in verl: sample responses (`model.megatron_generate`), score them,
compute advantages, take the log-probs of the sampling policy (`model.compute_log_probs(batch)`), then
`model(**batch)` steps on this loss. Everything is token-aligned: position t of `old_log_probs`,
`advantages`, `ref_log_probs` and `labels` is about token t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from transformers.utils import ModelOutput

from megatron_plugin.errors import MegatronPluginConfigError

from .gpt import IGNORE_INDEX, GPTTrainStep
from .utils import (avg_losses_across_data_parallel_group, context_parallel_size, count_on_first_context_parallel_rank,
                    per_token_log_probs, per_token_loss_result, shift_to_tokens, sum_across_data_parallel_group,
                    whole_sequence, whole_sequence_no_grad)

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class PolicyOutput(ModelOutput):
    """`loss` of the step; `metrics`: every value the loss function logged, averaged over micro-batches
    and data-parallel ranks."""

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    metrics: Optional[dict] = None


def aggregate_parts(per_token, mask, how: str):
    """(sum, count) whose ratio aggregates `per_token` over a micro-batch. token-mean: over every loss token;
    seq-mean-token-mean: per sequence, then over the sequences that have loss tokens; seq-mean-token-sum:
    summed per sequence (Dr. GRPO), then so. Added over micro-batches and data-parallel ranks
    (calculate_per_token_loss), the same ratio aggregates the global batch: every token (token-mean) or every
    sequence (the seq-mean kinds) weighs the same."""
    if how == "token-mean":
        return (per_token * mask).sum(), mask.sum()
    per_seq = (per_token * mask).sum(-1)
    counts = mask.sum(-1)
    if how == "seq-mean-token-mean":
        per_seq = per_seq / counts.clamp_min(1.0)
    rows = (counts > 0).float()
    return (per_seq * rows).sum(), rows.sum()


def check_number(name, value, low=0.0, inclusive=True):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (value == low and not inclusive):
        raise MegatronPluginConfigError(f"custom_train_step_kwargs[{name!r}]", value,
                                        f"pass a finite number {'>=' if inclusive else '>'} {low}")


def check_known(cls, kwargs, known):
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise MegatronPluginConfigError("custom_train_step_kwargs", unknown, f"{cls.__name__} takes {sorted(known)}")


NONFINITE_FIX = {"advantages": "check the advantage computation (e.g. GRPO's division by a group's reward std of 0: "
                               "add an epsilon)"}


def check_per_token(batch, key, rows, tokens, allow_per_row=False):
    """An error for a missing, misshapen or non-finite per-token tensor of the batch, else None."""
    t = batch.get(key)
    if not torch.is_tensor(t):
        return None
    shapes = [(rows, tokens)] + ([(rows,)] if allow_per_row else [])
    if tuple(t.shape) not in shapes:
        return MegatronPluginConfigError(
            f"batch[{key!r}]", tuple(t.shape),
            f"it must be {' or '.join(str(s) for s in shapes)}: one value per token of input_ids"
            + (" (or one per sequence)" if allow_per_row else "")
        )
    if not t.is_floating_point():
        return MegatronPluginConfigError(f"batch[{key!r}]", t.dtype, "pass floating-point values")
    if not torch.isfinite(t).all():
        return MegatronPluginConfigError(f"batch[{key!r}]", "contains nan or inf",
                                         NONFINITE_FIX.get(key, "check how it was computed"))
    if key.endswith("log_probs") and (t > 1e-3).any():
        return MegatronPluginConfigError(
            f"batch[{key!r}]", f"a value of {t.max().item():.4g} > 0",
            "log-probabilities are <= 0: pass model.compute_log_probs(batch), not probabilities"
        )
    return None


class PolicyGradientTrainStep(GPTTrainStep):
    """GRPO / PPO-clip on causal LMs (GPT-2, the Llama family).

    Batch: `input_ids`, `attention_mask`, `labels` (the tokens, -100 where no loss: prompt and padding;
    without labels, every non-padding token after the first), `old_log_probs` [b, s] (the sampling policy's,
    from `model.compute_log_probs(batch, temperature=...)`), `advantages` [b, s] or [b] (one per sequence,
    as GRPO gives), and `ref_log_probs` [b, s] when `kl_coef > 0`.

    Per token: max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range_high)) with r = exp(log p - old), plus
    `kl_coef` * k3 KL to the reference (exp(ref - log p) - (ref - log p) - 1), minus `entropy_coef` * entropy;
    aggregated by `loss_aggregation` over each micro-batch, then averaged over micro-batches and
    data-parallel ranks like GPTTrainStep's loss; with `calculate_per_token_loss`, aggregated over the global
    batch (every token, or with the seq-mean kinds every sequence, weighs the same), the metrics too. Logs 'loss', 'pg loss', 'clip fraction', 'ppo kl'
    (E[old - new]), 'kl' and 'entropy' when used; the step's output has `.loss` and `.metrics`.
    Set the model's dropout to 0 (as RL recipes do), so the ratio is exactly 1 on the sampling policy.

    With an MoE model the router losses join 'loss' as in GPTTrainStep (train_steps/moe.py), and the
    attention mask reaches the routers.

    Context parallelism: each CP rank's per-token log-probs (and entropy) are gathered into whole sequences,
    and the loss is computed from them alike on every CP rank, so aggregations per sequence and the
    token alignment are those of one rank; the gradients (the CP ranks' parts added) equal it too.

    `custom_train_step_kwargs`: clip_range (0.2), clip_range_high (default: clip_range; DAPO's clip-higher
    uses e.g. 0.28), kl_coef (0), entropy_coef (0), temperature (1.0; the sampling temperature) and
    loss_aggregation ('token-mean', 'seq-mean-token-mean' as GRPO's paper, 'seq-mean-token-sum').
    """

    model_output_class = PolicyOutput
    loss_log_key = "loss"
    KWARGS = ("clip_range", "clip_range_high", "kl_coef", "entropy_coef", "temperature", "loss_aggregation")

    def __init__(self, megatron_args, clip_range=0.2, clip_range_high=None, kl_coef=0.0, entropy_coef=0.0,
                 temperature=1.0, loss_aggregation="token-mean", **kwargs):
        self.check_kwargs(dict(clip_range=clip_range, clip_range_high=clip_range_high, kl_coef=kl_coef,
                               entropy_coef=entropy_coef, temperature=temperature,
                               loss_aggregation=loss_aggregation, **kwargs))
        self.clip_low = clip_range
        self.clip_high = clip_range if clip_range_high is None else clip_range_high
        self.kl_coef = kl_coef
        self.entropy_coef = entropy_coef
        self.temperature = temperature
        self.loss_aggregation = loss_aggregation
        super().__init__(megatron_args)
        self.name = "PolicyGradientTrainStep"
        self.true_vocab = megatron_args.vocab_size

    @classmethod
    def check_kwargs(cls, kwargs):
        check_known(cls, kwargs, cls.KWARGS)
        check_number("clip_range", kwargs.get("clip_range", 0.2), 0.0, inclusive=False)
        if kwargs.get("clip_range_high") is not None:
            check_number("clip_range_high", kwargs["clip_range_high"], 0.0, inclusive=False)
        check_number("kl_coef", kwargs.get("kl_coef", 0.0))
        check_number("entropy_coef", kwargs.get("entropy_coef", 0.0))
        check_number("temperature", kwargs.get("temperature", 1.0), 0.0, inclusive=False)
        how = kwargs.get("loss_aggregation", "token-mean")
        if how not in AGGREGATIONS:
            raise MegatronPluginConfigError("custom_train_step_kwargs['loss_aggregation']", how,
                                            f"use one of {list(AGGREGATIONS)}")

    def check_batch(self, batch):
        ids = batch.get("input_ids")
        rows, tokens = ids.shape[:2]
        needed = ["old_log_probs", "advantages"] + (["ref_log_probs"] if self.kl_coef else [])
        for key in needed:
            if not torch.is_tensor(batch.get(key)):
                how = {
                    "old_log_probs": "model.compute_log_probs(batch) with the policy that sampled the responses, "
                                     "before this update",
                    "advantages": "the per-token (or per-sequence) advantages, e.g. GRPO's group-normalized rewards",
                    "ref_log_probs": "model.compute_log_probs(batch) of the reference model (or set kl_coef=0)",
                }[key]
                return MegatronPluginConfigError(f"batch[{key!r}]", "missing",
                                                 f"{type(self).__name__} needs it: add {how}")
        for key in ("old_log_probs", "ref_log_probs", "advantages"):
            error = check_per_token(batch, key, rows, tokens, allow_per_row=key == "advantages")
            if error is not None:
                return error
        return None

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            data = next(data_iterator)
            output, targets, shift = self.forward_logits(data, model)
            return output, self.with_router_losses(model, partial(self.loss_func, data, targets, shift))

        return forward_step

    def _whole_sequence_inputs(self, data, targets, shift, output_tensor, with_entropy):
        """Under context parallelism: (log-probs, entropy, targets, the batch's per-token tensors) of the whole
        sequences, token-aligned, identical on every CP rank (train_steps/utils.py: a loss computed alike on
        every CP rank; its gradient reaches each rank's own positions)."""
        result = per_token_log_probs(output_tensor, targets, 0, self.true_vocab, self.temperature, with_entropy)
        local = result if with_entropy else (result, None)
        log_probs, entropy = (None if t is None else shift_to_tokens(whole_sequence(t), shift) for t in local)
        data = {**data, **{k: whole_sequence_no_grad(data[k]) for k in ("old_log_probs", "ref_log_probs", "advantages")
                           if torch.is_tensor(data.get(k)) and data[k].dim() == 2}}
        return log_probs, entropy, whole_sequence_no_grad(targets), data

    def get_loss_func(self, *args, **kwargs):
        def loss_func(data, targets, shift, output_tensor):
            with_entropy = self.entropy_coef > 0
            cp = context_parallel_size() > 1
            if cp:
                log_probs, entropy, targets, data = self._whole_sequence_inputs(data, targets, shift, output_tensor,
                                                                                with_entropy)
            else:
                result = per_token_log_probs(output_tensor, targets, shift, self.true_vocab, self.temperature,
                                             with_entropy)
                log_probs, entropy = result if with_entropy else (result, None)
            mask = shift_to_tokens((targets != IGNORE_INDEX).float(), shift)
            on = mask > 0
            old = data["old_log_probs"].float()
            adv = data["advantages"].float()
            if adv.dim() == 1:
                adv = adv[:, None]
            log_ratio = torch.where(on, log_probs - old, 0.0)
            ratio = log_ratio.exp()
            pg1 = -adv * ratio
            pg2 = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            pg = torch.maximum(pg1, pg2)
            per_token = pg
            how = self.loss_aggregation
            # (sum, count) pairs: their ratio is each value over the micro-batch, their sums over the global batch
            parts = {"pg loss": aggregate_parts(pg, mask, how),
                     "clip fraction": aggregate_parts((pg2 > pg1).float(), mask, "token-mean"),
                     "ppo kl": aggregate_parts(-log_ratio, mask, "token-mean")}
            if self.kl_coef:
                d = torch.where(on, data["ref_log_probs"].float() - log_probs, 0.0)
                kl = d.exp() - d - 1.0
                per_token = per_token + self.kl_coef * kl
                parts["kl"] = aggregate_parts(kl, mask, "token-mean")
            if entropy is not None:
                per_token = per_token - self.entropy_coef * entropy
                parts["entropy"] = aggregate_parts(entropy, mask, "token-mean")
            total, count = aggregate_parts(per_token, mask, how)
            parts = {"loss": (total, count), **parts}
            if self.per_token_loss:
                logs = dict(zip(parts, sum_across_data_parallel_group(parts.values(), replicated_over_context_parallel=cp)))
                return per_token_loss_result(total, count_on_first_context_parallel_rank(count), logs)
            means = [s / c.clamp_min(1.0) for s, c in parts.values()]
            return means[0], dict(zip(parts, avg_losses_across_data_parallel_group(means)))

        return loss_func
