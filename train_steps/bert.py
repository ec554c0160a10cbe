from functools import partial

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import MaskedLMOutput

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.models.bert import bert_inputs

from .base import AbstractTrainStep
from .gpt import IGNORE_INDEX, unwrap_model
from .utils import avg_losses_across_data_parallel_group, per_token_loss_result, sum_across_data_parallel_group


class BertTrainStep(AbstractTrainStep):
    """BERT step on HF batches: `input_ids`, `attention_mask`, `token_type_ids` (zeros when absent),
    MLM `labels` (-100 = no loss) and, for a model with a binary head (…ForPreTraining), an optional
    `next_sentence_label`. Loss = MLM loss (mean over labelled tokens) + NSP/sentence-order loss, as in
    HF's BertForPreTraining; logs 'lm loss' and 'sop loss'.

    `calculate_per_token_loss`: the MLM loss is token-weighted over the global batch (Megatron-LM's
    (sum, tokens, logs) contract). A next-sentence loss is a mean over sequences, which has no per-token
    weight (Megatron-LM's BERT does not offer per-token loss either): a batch with `next_sentence_label` is
    refused then."""

    model_output_class = MaskedLMOutput
    same_shape = (("labels", "input_ids", "one MLM label per token (-100 where none)"),
                  ("token_type_ids", "input_ids", "one segment id per token"))

    def __init__(self, megatron_args, **kwargs):
        super().__init__("BertTrainStep")
        self.megatron_args = megatron_args
        self.binary_head = getattr(megatron_args, "model_variant", "mlm") == "pretraining"
        self.return_logits = getattr(megatron_args, "return_logits", False)
        self.per_token_loss = bool(getattr(megatron_args, "calculate_per_token_loss", False))
        self.get_batch = self.get_batch_func()
        self.loss_func = self.get_loss_func()
        self.forward_step = self.get_forward_step_func()

    def count_loss_tokens(self, batch):
        labels = batch.get("labels")
        count = (labels != IGNORE_INDEX).sum() if labels is not None else torch.zeros((), dtype=torch.long)
        if batch.get("next_sentence_label") is not None and self.binary_head:
            count = count + batch["next_sentence_label"].numel()
        return count

    def check_batch(self, batch):
        if self.per_token_loss and batch.get("next_sentence_label") is not None:
            return MegatronPluginConfigError(
                "calculate_per_token_loss", True,
                "the batch has next_sentence_label: the next-sentence loss is a mean over sequences, HF adds it to the "
                "MLM loss's mean over tokens, and one per-token weighting cannot give both; drop next_sentence_label "
                "(MLM alone), or set calculate_per_token_loss=False (each micro-batch's MLM + NSP loss, averaged)",
            )
        return None

    def get_batch_func(self, *args, **kwargs):
        def get_batch(data_iterator):
            """-> tokens, token types, sentence order (or None), loss mask, labels (0 where ignored), padding mask"""
            data = next(data_iterator)
            # positions stay the model's 0..s-1: this step's get_batch (a public API) has no slot for them
            inputs = bert_inputs(data["input_ids"], data.get("attention_mask"), data.get("token_type_ids"))
            labels = data.get("labels")
            labels = torch.full_like(inputs.tokens, IGNORE_INDEX) if labels is None else labels.long()
            sentence_order = data.get("next_sentence_label")
            if sentence_order is not None and not self.binary_head:
                raise MegatronPluginConfigError(
                    "next_sentence_label", "in the batch",
                    "the model has no binary (next-sentence) head: train a ...ForPreTraining model, or drop the key",
                )
            loss_mask = (labels != IGNORE_INDEX).float()
            labels = labels.clamp_min(0)
            return inputs.tokens, inputs.token_types, sentence_order, loss_mask, labels, inputs.padding_mask

        return get_batch

    def forward_logits(self, data, model):
        tokens, types, _, loss_mask, labels, padding = self.get_batch(iter([data]))
        output = model(tokens, padding, tokentype_ids=types)
        if unwrap_model(model).post_process:
            output = output[0]  # the MLM logits, not the binary head's
        return output, labels.masked_fill(loss_mask == 0, IGNORE_INDEX), 0

    def get_loss_func(self, *args, **kwargs):
        def loss_func(loss_mask, sentence_order, output_tensor):
            lm_losses, binary_logits = output_tensor[:2]
            count = loss_mask.sum()
            if self.per_token_loss:  # check_batch has refused a sentence-order label
                total = (lm_losses.float() * loss_mask).sum()
                logs = {"lm loss": sum_across_data_parallel_group([(total, count)])[0]}
                if len(output_tensor) > 2:
                    logs["logits"] = output_tensor[2]
                return per_token_loss_result(total, count, logs)
            lm_loss = (lm_losses.float() * loss_mask).sum() / count.clamp_min(1.0)
            loss = lm_loss
            logs = {}
            if sentence_order is not None and binary_logits is not None:
                sop_loss = F.cross_entropy(binary_logits.float(), sentence_order.view(-1).long())
                loss = loss + sop_loss
                lm_avg, sop_avg = avg_losses_across_data_parallel_group([lm_loss, sop_loss])
                logs = {"lm loss": lm_avg, "sop loss": sop_avg}
            else:
                logs = {"lm loss": avg_losses_across_data_parallel_group([lm_loss])[0]}
            if len(output_tensor) > 2:
                logs["logits"] = output_tensor[2]
            return loss, logs

        return loss_func

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            tokens, types, sentence_order, loss_mask, labels, padding = self.get_batch(data_iterator)
            bert = unwrap_model(model)
            if not bert.post_process:  # an earlier pipeline stage
                return model(tokens, padding, tokentype_ids=types), partial(self.loss_func, loss_mask, sentence_order)
            if self.return_logits and not model.training:
                logits, binary = model(tokens, padding, tokentype_ids=types)
                losses = bert.compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())
                return (losses, binary, logits), partial(self.loss_func, loss_mask, sentence_order)
            output = model(tokens, padding, tokentype_ids=types, lm_labels=labels)
            return output, partial(self.loss_func, loss_mask, sentence_order)

        return forward_step
