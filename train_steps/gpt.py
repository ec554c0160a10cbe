from functools import partial

import torch
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.layers.context_parallel import tokens_over_context_parallel
from megatron_plugin.models.causal import causal_lm_inputs

from .base import AbstractTrainStep
from .moe import MoESupport, unwrap_model
from .utils import avg_context_parallel_parts_across_data_parallel_group, per_token_loss_result, sum_across_data_parallel_group

IGNORE_INDEX = -100


def eod_ids(megatron_args):
    """The end-of-document ids whose positions carry no loss with `eod_mask_loss` (none without it)."""
    if not getattr(megatron_args, "eod_mask_loss", False):
        return None
    eod = getattr(megatron_args, "eod_token", None)
    ids = [] if eod is None else [int(e) for e in eod] if isinstance(eod, (list, tuple)) else [int(eod)]
    if not ids:
        raise MegatronPluginConfigError(
            "eod_mask_loss", True, "the model config has no eos_token_id to find document ends by: set "
            "config.eos_token_id before prepare, or set eod_mask_loss=False",
        )
    return torch.tensor(ids)


class GPTTrainStep(AbstractTrainStep):
    """Causal LM step on HF batches: `input_ids`, optional `attention_mask` and `labels` (HF
    semantics: labels are the inputs, shifted here; -100 and padding positions carry no loss).
    `shift_labels`, when the batch has them, are the targets already shifted (position t's is the
    token after t), as HF's causal-LM loss takes them; then `labels` are not read. Megatron indexed
    datasets yield them, since their labels are the next tokens including the one after the window.

    `eod_mask_loss` (Megatron's): a position whose input token is an end-of-document id (the config's
    eos_token_id) carries no loss, so the first token of the next document is not predicted from the last one.
    `calculate_per_token_loss`: the loss function returns Megatron-LM's (sum, tokens, logs); every labelled
    token of the global batch then weighs the same, as in HF's loss over the whole batch.

    MoE models (train_steps/moe.py): the batch's attention mask reaches the routers as mcore's `padding_mask`,
    and each micro-batch's loss gets HF's load-balancing loss times `moe_aux_loss_coeff` (and the z-loss times
    `moe_z_loss_coeff`); 'lm loss' stays the LM loss, 'load_balancing_loss' is logged apart, and the step
    returns their sum ('loss').

    Context parallelism: the labels are shifted over the whole sequence before the split
    (`before_sequence_split`); each CP rank's loss is its tokens' sum over the CP-wide token count, which the
    engines scale by CP and average over DP x CP (as megatron-core's schedules and DDP do), so the gradients
    and the logged 'lm loss' (the CP ranks' parts added) are those of one rank holding the whole sequence."""

    model_output_class = CausalLMOutputWithCrossAttentions
    same_shape = (("labels", "input_ids", "one label per token (-100 where none)"),
                  ("shift_labels", "input_ids", "one target per token (-100 where none)"))

    def __init__(self, megatron_args, **kwargs):
        super().__init__("GPTTrainStep")
        self.megatron_args = megatron_args
        self.return_logits = getattr(megatron_args, "return_logits", False)
        self.per_token_loss = bool(getattr(megatron_args, "calculate_per_token_loss", False))
        self.eod_ids = eod_ids(megatron_args)
        self._eod_ids_on = {}  # device -> eod_ids there: copied once, not each micro-batch (nor inside a CUDA graph)
        self.get_batch = self.get_batch_func()
        self.loss_func = self.get_loss_func()
        self.moe = MoESupport()
        self.forward_step = self.get_forward_step_func()

    @staticmethod
    def _labels(data):
        labels = data.get("labels")
        if labels is None:
            mask = data.get("attention_mask")
            tokens = data["input_ids"]
            labels = tokens if mask is None else tokens.masked_fill(mask == 0, IGNORE_INDEX)
        return labels

    @classmethod
    def _shifted_labels(cls, data):
        given = data.get("shift_labels")
        if given is not None:
            return given
        labels = cls._labels(data)
        return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)

    def _targets(self, data):
        """(shifted labels, the positions that carry a loss)."""
        shifted = self._shifted_labels(data).long()
        keep = shifted != IGNORE_INDEX
        if self.eod_ids is not None:
            device = data["input_ids"].device
            if device not in self._eod_ids_on:
                self._eod_ids_on[device] = self.eod_ids.to(device)
            keep = keep & ~torch.isin(data["input_ids"], self._eod_ids_on[device])
        return shifted, keep

    def count_loss_tokens(self, batch):
        return self._targets(batch)[1].sum()

    def before_sequence_split(self, micro_batch):
        # position t's target is token t + 1, which sits in another chunk at the chunks' edges
        if micro_batch.get("shift_labels") is not None:
            return micro_batch
        return {**micro_batch, "shift_labels": self._shifted_labels(micro_batch)}

    def get_batch_func(self, *args, **kwargs):
        def get_batch(data_iterator):
            """-> tokens, labels (ignored positions set to 0), loss_mask, attention_mask, position_ids"""
            data = next(data_iterator)
            tokens, position_ids, attention_mask = causal_lm_inputs(
                data["input_ids"], data.get("attention_mask"), data.get("position_ids")
            )
            shifted, keep = self._targets(data)
            return tokens, shifted.clamp_min(0), keep.float(), attention_mask, position_ids

        return get_batch

    def forward_logits(self, data, model):
        tokens, labels, loss_mask, attention_mask, position_ids = self.get_batch(iter([data]))
        output = model(tokens, position_ids, attention_mask, **self.moe.model_kwargs(model, data))
        return output, labels.masked_fill(loss_mask == 0, IGNORE_INDEX), 1

    def with_router_losses(self, model, loss_func):
        """`loss_func` plus the MoE router losses of the forward that just ran (train_steps/moe.py); the step
        then returns the objective logged as 'loss'. Unchanged for a model without MoE layers."""
        if self.moe.losses(model) is None:
            return loss_func
        if self.loss_log_key is None:
            self.loss_log_key = "loss"
        return self.moe.add_to(model, loss_func)

    def get_loss_func(self, *args, **kwargs):
        def loss_func(loss_mask, output_tensor):
            logits = None
            if isinstance(output_tensor, tuple):  # (per-token losses, logits) when logits are asked for
                output_tensor, logits = output_tensor
            losses = output_tensor.float().view(-1)
            loss_mask = loss_mask.view(-1).float()
            total = torch.sum(losses * loss_mask)
            if self.per_token_loss:
                count = loss_mask.sum()
                logs = {"lm loss": sum_across_data_parallel_group([(total, count)])[0]}
                if logits is not None:
                    logs["logits"] = logits
                return per_token_loss_result(total, count, logs)
            # under CP: this rank's part of the mean over the whole sequences' tokens (the parts add up to it)
            loss = total / tokens_over_context_parallel(loss_mask.sum()).clamp_min(1.0)
            averaged = avg_context_parallel_parts_across_data_parallel_group([loss])
            logs = {"lm loss": averaged[0]}
            if logits is not None:
                logs["logits"] = logits
            return loss, logs

        return loss_func

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            data = next(data_iterator)
            tokens, labels, loss_mask, attention_mask, position_ids = self.get_batch(iter([data]))
            moe = self.moe.model_kwargs(model, data)
            if self.return_logits and not model.training:
                output = model(tokens, position_ids, attention_mask, **moe)
                gpt = unwrap_model(model)
                loss_func = self.with_router_losses(model, partial(self.loss_func, loss_mask))
                if not gpt.post_process:  # an earlier pipeline stage: hidden states go to the next one
                    return output, loss_func
                # logits [b, s, vocab / tp]
                losses = gpt.compute_language_model_loss(labels, output.transpose(0, 1).contiguous())
                return (losses, output), loss_func
            output_tensor = model(tokens, position_ids, attention_mask, labels=labels, **moe)
            return output_tensor, self.with_router_losses(model, partial(self.loss_func, loss_mask))

        return forward_step
