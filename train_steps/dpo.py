"""Direct Preference Optimization as a train step."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from megatron_plugin.errors import MegatronPluginConfigError

from .gpt import IGNORE_INDEX, GPTTrainStep
from .policy import PolicyOutput, check_known, check_number
from .utils import (avg_losses_across_data_parallel_group, context_parallel_size, count_on_first_context_parallel_rank,
                    per_token_log_probs, per_token_loss_result, sum_across_data_parallel_group,
                    sum_over_context_parallel)

SIDES = ("chosen", "rejected")


def _pad_to(t, length, value):
    return t if t.shape[1] == length else F.pad(t, (0, length - t.shape[1]), value=value)


def _labels(data, side):
    labels = data.get(f"{side}_labels")
    if labels is None:
        ids, mask = data[f"{side}_input_ids"], data.get(f"{side}_attention_mask")
        labels = ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)
    return labels


def concatenated(data):
    """chosen_* and rejected_* as one causal-LM batch (chosen rows first), padded on the right to the
    longer of the two."""
    length = max(data[f"{side}_input_ids"].shape[1] for side in SIDES)
    parts = {"input_ids": [], "attention_mask": [], "labels": []}
    for side in SIDES:
        ids = data[f"{side}_input_ids"]
        mask = data.get(f"{side}_attention_mask", torch.ones_like(ids))
        parts["input_ids"].append(_pad_to(ids, length, 0))
        parts["attention_mask"].append(_pad_to(mask, length, 0))
        parts["labels"].append(_pad_to(_labels(data, side), length, IGNORE_INDEX))
    return {k: torch.cat(v) for k, v in parts.items()}


class DPOTrainStep(GPTTrainStep):
    """DPO (sigmoid loss) on causal LMs (GPT-2, the Llama family).

    Batch: `chosen_input_ids`, `chosen_attention_mask`, `chosen_labels` (the tokens, -100 on the prompt and
    padding) and the same three `rejected_*` keys (each side padded on its own; they are padded to the
    longer one here), and `ref_chosen_logps`, `ref_rejected_logps` [b]: the reference model's summed
    log-probabilities of the labelled tokens, e.g. `model.compute_log_probs({"input_ids": ..., "attention_mask":
    ..., "labels": ...}).sum(-1)` before training.

    loss = -(1 - label_smoothing) log sigmoid(beta m) - label_smoothing log sigmoid(-beta m), with
    m = (log p(chosen) - ref_chosen) - (log p(rejected) - ref_rejected), averaged over the pairs (with
    `calculate_per_token_loss`, over the pairs of the global batch, in Megatron-LM's (sum, count, logs)). Logs
    'loss', 'reward accuracy', 'chosen reward', 'rejected reward', 'reward margin'.
    `custom_train_step_kwargs`: beta (0.1), label_smoothing (0).
    With an MoE model the router losses join 'loss' as in GPTTrainStep (train_steps/moe.py), and the
    attention masks reach the routers.
    Context parallelism: the two sides are joined (padded to the longer) before the sequence is split; each
    pair's summed log-probs are added over the CP ranks, and the loss is computed from them alike on every
    CP rank (train_steps/utils.py), so the gradients equal one rank's.
    """

    model_output_class = PolicyOutput
    loss_log_key = "loss"
    input_key = "chosen_input_ids"
    KWARGS = ("beta", "label_smoothing")

    def __init__(self, megatron_args, beta=0.1, label_smoothing=0.0, **kwargs):
        self.check_kwargs(dict(beta=beta, label_smoothing=label_smoothing, **kwargs))
        self.beta = beta
        self.label_smoothing = label_smoothing
        super().__init__(megatron_args)
        self.name = "DPOTrainStep"
        self.true_vocab = megatron_args.vocab_size

    @classmethod
    def check_kwargs(cls, kwargs):
        check_known(cls, kwargs, cls.KWARGS)
        check_number("beta", kwargs.get("beta", 0.1), 0.0, inclusive=False)
        ls = kwargs.get("label_smoothing", 0.0)
        check_number("label_smoothing", ls)
        if ls >= 0.5:
            raise MegatronPluginConfigError("custom_train_step_kwargs['label_smoothing']", ls,
                                            "pass a value in [0, 0.5)")

    # under context parallelism the two sides are joined before the split (`before_sequence_split`): the
    # model runs on these keys, this CP rank's part of the joined rows
    JOINED = ("input_ids", "attention_mask", "shift_labels")

    def before_sequence_split(self, micro_batch):
        joined = concatenated(micro_batch)
        joined["shift_labels"] = self._shifted_labels(joined)
        del joined["labels"]
        return {**micro_batch, **joined}

    def schedule_shape(self, micro_batch):
        rows = micro_batch["chosen_input_ids"].shape[0]
        if "input_ids" in micro_batch:  # joined and split over CP ranks: this rank's tokens
            return 2 * rows, micro_batch["input_ids"].shape[1]
        return 2 * rows, max(micro_batch[f"{side}_input_ids"].shape[1] for side in SIDES)

    def count_loss_tokens(self, batch):
        return sum((_labels(batch, side)[:, 1:] != IGNORE_INDEX).sum() for side in SIDES)

    def check_batch(self, batch):
        for key in ("chosen_input_ids", "rejected_input_ids", "ref_chosen_logps", "ref_rejected_logps"):
            if not torch.is_tensor(batch.get(key)):
                how = ("the reference model's summed log-probs of that side's labelled tokens: "
                       "model.compute_log_probs(...).sum(-1) before training") if key.startswith("ref") else \
                      "the tokenized prompt + response of that side"
                return MegatronPluginConfigError(f"batch[{key!r}]", "missing", f"DPOTrainStep needs it: {how}")
        rows = batch["chosen_input_ids"].shape[0]
        for side in SIDES:
            ids = batch[f"{side}_input_ids"]
            if ids.dim() != 2 or ids.shape[0] != rows:
                return MegatronPluginConfigError(f"batch['{side}_input_ids']", tuple(ids.shape),
                                                 f"pass [{rows}, tokens]: one row per pair")
            for key in (f"{side}_attention_mask", f"{side}_labels"):
                t = batch.get(key)
                if torch.is_tensor(t) and t.shape != ids.shape:
                    return MegatronPluginConfigError(
                        f"batch[{key!r}]", tuple(t.shape),
                        f"it must have the shape of {side}_input_ids, {tuple(ids.shape)}: pad both alike"
                    )
            empty = ((_labels(batch, side)[:, 1:] != IGNORE_INDEX).sum(-1) == 0).nonzero()
            if len(empty):
                return MegatronPluginConfigError(
                    f"batch['{side}_labels']", f"row {int(empty[0])} has no labelled token",
                    "each pair needs response tokens on both sides (were they cut by max_length?)"
                )
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            t = batch[key]
            if tuple(t.shape) != (rows,) or not t.is_floating_point() or not torch.isfinite(t).all():
                return MegatronPluginConfigError(f"batch[{key!r}]", f"{t.dtype} {tuple(t.shape)}",
                                                 f"pass [{rows}] finite floats: one summed log-prob per pair")
            if (t > 1e-3).any():
                return MegatronPluginConfigError(
                    f"batch[{key!r}]", f"a value of {t.max().item():.4g} > 0",
                    "summed log-probabilities are <= 0: pass model.compute_log_probs(...).sum(-1)"
                )
        return None

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            data = next(data_iterator)
            joined = {k: data[k] for k in self.JOINED} if "input_ids" in data else concatenated(data)
            output, targets, shift = self.forward_logits(joined, model)
            return output, self.with_router_losses(model, partial(self.loss_func, data, targets, shift))

        return forward_step

    def get_loss_func(self, *args, **kwargs):
        def loss_func(data, targets, shift, output_tensor):
            # under CP the values stay at the positions that score them (a shift within this rank's two chunks
            # would drop the last one's): their sum is this rank's part of the row's, added over the CP ranks
            # (alike on every CP rank); the shift only moves values along the row, the last position scores nothing
            cp = context_parallel_size() > 1
            log_probs = per_token_log_probs(output_tensor, targets, 0 if cp else shift, self.true_vocab)
            summed = sum_over_context_parallel(log_probs.sum(-1))  # 0 where the label is -100
            rows = data["chosen_input_ids"].shape[0]
            chosen = self.beta * (summed[:rows] - data["ref_chosen_logps"].float())
            rejected = self.beta * (summed[rows:] - data["ref_rejected_logps"].float())
            margin = chosen - rejected
            ls = self.label_smoothing
            per_pair = -(1 - ls) * F.logsigmoid(margin) - ls * F.logsigmoid(-margin)
            if self.per_token_loss:
                pairs = margin.new_tensor(float(rows))
                parts = {"loss": per_pair.sum(), "reward accuracy": (chosen > rejected).float().sum(),
                         "chosen reward": chosen.sum(), "rejected reward": rejected.sum(), "reward margin": margin.sum()}
                reduced = sum_across_data_parallel_group([(v, pairs) for v in parts.values()],
                                                         replicated_over_context_parallel=cp)
                return per_token_loss_result(parts["loss"], count_on_first_context_parallel_rank(pairs),
                                             dict(zip(parts, reduced)))
            loss = per_pair.mean()
            values = {"reward accuracy": (chosen > rejected).float().mean(), "chosen reward": chosen.mean(),
                      "rejected reward": rejected.mean(), "reward margin": margin.mean()}
            averaged = avg_losses_across_data_parallel_group([loss, *values.values()])
            return loss, dict(zip(["loss", *values], averaged))

        return loss_func
