from functools import partial

from transformers.modeling_outputs import Seq2SeqLMOutput

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.models.t5 import t5_inputs

from .base import AbstractTrainStep
from .gpt import IGNORE_INDEX, unwrap_model
from .utils import avg_losses_across_data_parallel_group, per_token_loss_result, sum_across_data_parallel_group


class T5TrainStep(AbstractTrainStep):
    """Seq2seq step on HF batches: `input_ids`, `attention_mask`, `labels` (-100 = no loss) and optional
    `decoder_input_ids` (default: the labels shifted right, as HF's T5 makes them) and
    `decoder_attention_mask`. Loss = mean over labelled tokens, as T5ForConditionalGeneration's; with
    `calculate_per_token_loss`, over the labelled tokens of the global batch (Megatron-LM's (sum, tokens, logs))."""

    model_output_class = Seq2SeqLMOutput
    # labels are the decoder's targets: their length is the decoder's, not input_ids'
    same_shape = (("decoder_input_ids", "labels", "one decoder input per target token"),
                  ("decoder_attention_mask", "labels", "one decoder mask value per target token"),
                  ("decoder_attention_mask", "decoder_input_ids", "one mask value per decoder input"))

    def __init__(self, megatron_args, **kwargs):
        super().__init__("T5TrainStep")
        self.megatron_args = megatron_args
        self.return_logits = getattr(megatron_args, "return_logits", False)
        self.per_token_loss = bool(getattr(megatron_args, "calculate_per_token_loss", False))
        self.decoder_start_token_id = getattr(megatron_args, "decoder_start_token_id", 0)
        self.pad_token_id = getattr(megatron_args, "pad_token_id", 0)
        self.get_batch = self.get_batch_func()
        self.loss_func = self.get_loss_func()
        self.forward_step = self.get_forward_step_func()

    def count_loss_tokens(self, batch):
        labels = batch.get("labels")
        return (labels != IGNORE_INDEX).sum() if labels is not None else None

    def get_batch_func(self, *args, **kwargs):
        def get_batch(data_iterator):
            """-> encoder ids, decoder ids, labels (0 where ignored), loss mask, encoder/decoder/cross masks"""
            data = next(data_iterator)
            labels = data.get("labels")
            if labels is None:
                raise MegatronPluginConfigError("labels", None, "a T5 training batch needs labels (the target token ids)")
            labels = labels.long()
            enc_ids, dec_ids, enc, dec, cross = t5_inputs(
                data["input_ids"], data.get("attention_mask"), data.get("decoder_input_ids"),
                data.get("decoder_attention_mask"), labels,
                decoder_start_token_id=self.decoder_start_token_id, pad_token_id=self.pad_token_id,
            )
            loss_mask = (labels != IGNORE_INDEX).float()
            return enc_ids, dec_ids, labels.clamp_min(0), loss_mask, enc, dec, cross

        return get_batch

    def forward_logits(self, data, model):
        enc_ids, dec_ids, labels, loss_mask, enc, dec, cross = self.get_batch(iter([data]))
        return model(enc_ids, dec_ids, enc, dec, cross), labels.masked_fill(loss_mask == 0, IGNORE_INDEX), 0

    def get_loss_func(self, *args, **kwargs):
        def loss_func(loss_mask, output_tensor):
            logits = None
            if isinstance(output_tensor, tuple):
                output_tensor, logits = output_tensor
            total = (output_tensor.float() * loss_mask).sum()
            if self.per_token_loss:
                logs = {"lm loss": sum_across_data_parallel_group([(total, loss_mask.sum())])[0]}
                if logits is not None:
                    logs["logits"] = logits
                return per_token_loss_result(total, loss_mask.sum(), logs)
            loss = total / loss_mask.sum().clamp_min(1.0)
            logs = {"lm loss": avg_losses_across_data_parallel_group([loss])[0]}
            if logits is not None:
                logs["logits"] = logits
            return loss, logs

        return loss_func

    def get_forward_step_func(self):
        def forward_step(data_iterator, model):
            enc_ids, dec_ids, labels, loss_mask, enc, dec, cross = self.get_batch(data_iterator)
            if self.return_logits and not model.training:
                logits = model(enc_ids, dec_ids, enc, dec, cross)
                losses = unwrap_model(model).compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())
                return (losses, logits), partial(self.loss_func, loss_mask)
            return model(enc_ids, dec_ids, enc, dec, cross, lm_labels=labels), partial(self.loss_func, loss_mask)

        return forward_step
