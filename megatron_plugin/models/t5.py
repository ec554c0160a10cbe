"""T5 (and mT5) on Megatron-Core's T5Model: HF `T5ForConditionalGeneration` ("lm") and `T5Model` ("base").

What T5 needs beyond mcore's local T5 specs: RMSNorm without bias in every slot (mcore's local block
specs drop the final norm without TE), relative position biases (mcore's `RelativePositionEmbedding` is a
port of HF's buckets: one per stack, added in every self-attention layer, split over TP ranks by head)
given to our SDPA core attention, no 1/sqrt(d) scaling, dropout inside the MLP and after each stack's
final norm as HF places it, no bias on the LM head and HF's `d_model ** -0.5` output scaling when the
config asks for it.

Pipeline parallelism: megatron-core 0.16.1's schedules pass one tensor between stages, and its
encoder-decoder split (the encoder's output travelling with the decoder's stages) is gone; T5 runs with
tensor and data parallelism, pp_degree=1.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from ..errors import MegatronPluginConfigError
from ..layers.comm import gather_tensor_parallel_last_dim, scatter_to_tensor_parallel_dim
from ..layers.embedding import use_our_word_embeddings
from ..layers.linear import ColumnParallelLinear
from ..layers.masks import attention_mask_4d, padding_mask
from ..layers.spec import block_spec
from .common import HFParityMixin
from .family import ModelFamily
from .gpt import padded_vocab_size
from .gpt2 import gelu_tanh
from .mapping import Rule

ACTIVATIONS = {"relu": F.relu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu, "silu": F.silu}


def t5_variant(hf_model) -> str:
    if not hasattr(hf_model, "decoder"):
        raise MegatronPluginConfigError("model", type(hf_model).__name__,
                                        "encoder-only T5 is not mapped: use T5ForConditionalGeneration or T5Model")
    return "lm" if hasattr(hf_model, "lm_head") else "base"


def tied(c) -> bool:
    """transformers 5 always ties T5's LM head to the shared embedding; 4 follows tie_word_embeddings."""
    return bool(getattr(c, "tie_word_embeddings", True))


def scale_outputs(c) -> bool:
    """HF scales the decoder output by d_model ** -0.5 before the LM head for T5 v1.0-style configs:
    transformers 5 says so in `scale_decoder_outputs`, 4 in `tie_word_embeddings`."""
    return bool(getattr(c, "scale_decoder_outputs", getattr(c, "tie_word_embeddings", True)))


def transformer_config(c) -> dict:
    if getattr(c, "is_encoder_decoder", True) is False:
        raise MegatronPluginConfigError("is_encoder_decoder", False, "T5 is mapped as an encoder-decoder")
    act = getattr(c, "dense_act_fn", None) or c.feed_forward_proj.split("-")[-1]
    if act not in ACTIVATIONS:
        raise MegatronPluginConfigError("feed_forward_proj", c.feed_forward_proj, f"T5's mapping covers {sorted(ACTIVATIONS)}")
    return dict(
        num_layers=c.num_layers,
        hidden_size=c.d_model,
        num_attention_heads=c.num_heads,
        num_query_groups=c.num_heads,
        kv_channels=c.d_kv,
        ffn_hidden_size=c.d_ff,
        layernorm_epsilon=c.layer_norm_epsilon,
        normalization="RMSNorm",
        activation_func=ACTIVATIONS[act],
        gated_linear_unit=bool(getattr(c, "is_gated_act", c.feed_forward_proj.startswith("gated"))),
        add_bias_linear=False,
        add_qkv_bias=False,
        softmax_scale=1.0,  # T5 folds the scaling into its initialization
        hidden_dropout=c.dropout_rate,
        attention_dropout=c.dropout_rate,
        init_method_std=c.initializer_factor,
    )


def _stack_rules(c, stack: str, layers: int, decoder: bool) -> list:
    out = []
    for i in range(layers):
        hf, mc = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
        att = hf + "0.SelfAttention."
        out += [
            Rule(hf + "0.layer_norm.weight", mc + "input_layernorm.weight", stage="whole"),
            Rule((att + "q.weight", att + "k.weight", att + "v.weight"), mc + "self_attention.linear_qkv.weight",
                 "qkv_split", tp_dim=0, stage="whole"),
            Rule(att + "o.weight", mc + "self_attention.linear_proj.weight", tp_dim=1, stage="whole"),
        ]
        mlp = 2 if decoder else 1
        if decoder:
            x = hf + "1.EncDecAttention."
            out += [
                Rule(hf + "1.layer_norm.weight", mc + "pre_cross_attn_layernorm.weight", stage="whole"),
                Rule(x + "q.weight", mc + "cross_attention.linear_q.weight", tp_dim=0, stage="whole"),
                Rule((x + "k.weight", x + "v.weight"), mc + "cross_attention.linear_kv.weight", "kv_split", tp_dim=0,
                     stage="whole"),
                Rule(x + "o.weight", mc + "cross_attention.linear_proj.weight", tp_dim=1, stage="whole"),
            ]
        ff = hf + f"{mlp}.DenseReluDense."
        out.append(Rule(hf + f"{mlp}.layer_norm.weight", mc + "pre_mlp_layernorm.weight", stage="whole"))
        if getattr(c, "is_gated_act", c.feed_forward_proj.startswith("gated")):
            out.append(Rule((ff + "wi_0.weight", ff + "wi_1.weight"), mc + "mlp.linear_fc1.weight", "gate_up", tp_dim=0,
                            tp_interleave=2, stage="whole"))
        else:
            out.append(Rule(ff + "wi.weight", mc + "mlp.linear_fc1.weight", tp_dim=0, stage="whole"))
        out.append(Rule(ff + "wo.weight", mc + "mlp.linear_fc2.weight", tp_dim=1, stage="whole"))
    return out


def rules(c, tied_: bool, variant: str) -> list:
    table = [Rule("shared.weight", "embedding.word_embeddings.weight", "vocab", tp_dim=0, stage="whole")]
    table += _stack_rules(c, "encoder", c.num_layers, decoder=False)
    table += _stack_rules(c, "decoder", c.num_decoder_layers, decoder=True)
    table += [
        Rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "encoder_relative_pos_emb.relative_attention_bias.weight", stage="whole"),
        Rule("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             "decoder_relative_pos_emb.relative_attention_bias.weight", stage="whole"),
        Rule("encoder.final_layer_norm.weight", "encoder.final_layernorm.weight", stage="whole"),
        Rule("decoder.final_layer_norm.weight", "decoder.final_layernorm.weight", stage="whole"),
    ]
    if variant == "lm" and not tied_:
        table.append(Rule("lm_head.weight", "output_layer.weight", "vocab", tp_dim=0, stage="whole"))
    return table


def tied_aliases(c, variant: str) -> dict:
    aliases = {"encoder.embed_tokens.weight": "shared.weight", "decoder.embed_tokens.weight": "shared.weight"}
    if variant == "lm" and tied(c):
        aliases["lm_head.weight"] = "shared.weight"
    return aliases


class MegatronT5(HFParityMixin, T5Model):
    """T5Model with HF's head (no bias, optional d_model ** -0.5 scaling), dropout placement, our loss,
    and what generation needs (`encode`, a decoder position offset, next-token logits only).

    forward(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
    encoder_decoder_attn_mask, lm_labels, encoder_hidden_states) with masks in Megatron's convention
    (bool, True = masked, or None) -> per-token loss [b, s], logits [b, s, local vocab], or decoder hidden
    states for the base model."""

    def __init__(self, *args, true_vocab_size: int, variant: str, scale_outputs: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        self.variant = variant
        self.output_scale = self.config.hidden_size ** -0.5 if scale_outputs else None
        self.decoder_past = 0  # positions the decoder has cached (generation)
        self.last_position_logits = False
        if self.post_process:
            del self.lm_head, self.output_layer  # mcore's T5 head has a bias when tied; HF's has none
            if variant == "lm":
                self.output_layer = ColumnParallelLinear(
                    self.config.hidden_size, self.vocab_size, config=self.config, init_method=self.config.init_method,
                    bias=False, gather_output=False,
                    skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
                )
                self.setup_embeddings_and_output_layer()
        use_our_word_embeddings(self, self.share_embeddings_and_output_weights and self.post_process)

    def _stack_dropout(self, hidden):
        # HF drops out after each stack's final norm; mcore's block has no dropout there
        if self.config.sequence_parallel and hidden.is_cuda:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(hidden, self.config.hidden_dropout, self.training)
        return F.dropout(hidden, self.config.hidden_dropout, self.training)

    def _position_bias(self, embedding, queries: int, keys: int):
        """[1, local heads, queries, keys]: the queries are the last `queries` of `keys` positions.

        Contiguous, because mcore's table comes out with keys on a stride of the head count, and SDPA takes an
        attention mask that is not contiguous in its last dimension only on its math path: on GPU that is
        fp32 GEMMs plus a materialized softmax, about 6 ms against 2.8 ms a T5-base encoder layer (fwd+bwd)."""
        bias = embedding(keys, keys)[:, :, keys - queries:] if queries != keys else embedding(queries, keys)
        return scatter_to_tensor_parallel_dim(bias, 1, self.tp_group).contiguous()

    def encode(self, input_ids, attention_mask=None):
        hidden = self.embedding(input_ids=input_ids, position_ids=None)
        s = input_ids.shape[1]
        bias = self._position_bias(self.encoder_relative_pos_emb, s, s)
        hidden = self.encoder(hidden_states=hidden, attention_mask=attention_mask, attention_bias=bias)
        return self._stack_dropout(hidden)

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask=None, decoder_attn_mask=None,
                encoder_decoder_attn_mask=None, lm_labels=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is None:
            encoder_hidden_states = self.encode(encoder_input_ids, encoder_attn_mask)
        hidden = self.embedding(input_ids=decoder_input_ids, position_ids=None)
        s = decoder_input_ids.shape[1]
        bias = self._position_bias(self.decoder_relative_pos_emb, s, self.decoder_past + s)
        hidden = self.decoder(hidden_states=hidden, attention_mask=decoder_attn_mask, context=encoder_hidden_states,
                              context_mask=encoder_decoder_attn_mask, attention_bias=bias)
        hidden = self._stack_dropout(hidden)
        if self.variant != "lm":
            if self.config.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return hidden.transpose(0, 1).contiguous()
        if self.last_position_logits:
            hidden = hidden[-1:]
        if self.output_scale is not None:
            hidden = hidden * self.output_scale
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(lm_labels, logits)


def build_t5(family, hf_config, config, plugin, plan, *, variant="lm", backend="local", vp_stage=None):
    c = hf_config
    decoder_config = dataclasses.replace(config, num_layers=c.num_decoder_layers)
    return MegatronT5(
        config=decoder_config,
        encoder_config=config,
        transformer_encoder_layer_spec=block_spec(config, c.num_layers, backend, causal=False, mlp_dropout=True),
        transformer_decoder_layer_spec=block_spec(decoder_config, c.num_decoder_layers, backend, causal=True,
                                                  cross_attention=True, mlp_dropout=True),
        vocab_size=padded_vocab_size(c.vocab_size, plugin.make_vocab_size_divisible_by, plugin.tp_degree),
        max_sequence_length=1 << 16,  # relative positions: no table to size
        share_embeddings_and_output_weights=variant == "lm" and tied(c),
        position_embedding_type="relative",
        relative_attention_num_buckets=c.relative_attention_num_buckets,
        relative_attention_max_distance=c.relative_attention_max_distance,
        true_vocab_size=c.vocab_size,
        variant=variant,
        scale_outputs=scale_outputs(c),
    )


def shift_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """HF's T5 `_shift_right`: decoder inputs from labels (start token first, -100 -> pad)."""
    shifted = labels.new_zeros(labels.shape)
    shifted[..., 1:] = labels[..., :-1]
    shifted[..., 0] = start
    return shifted.masked_fill(shifted == -100, pad)


class T5Inputs(NamedTuple):
    """In MegatronT5's argument order, so `module(*inputs)` runs it. Masks: bool, True = masked, or None."""

    encoder_ids: torch.Tensor  # [b, s_enc] long
    decoder_ids: torch.Tensor  # [b, s_dec] long
    encoder_mask: Optional[torch.Tensor]  # [b, 1, 1, s_enc]: the encoder's padding
    decoder_mask: Optional[torch.Tensor]  # [b, 1, s_dec, s_dec]: causal and the decoder's padding
    cross_mask: Optional[torch.Tensor]  # [b, 1, 1, s_enc]: decoder queries see the encoder's tokens only


def t5_inputs(input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None, labels=None, *,
              decoder_start_token_id=0, pad_token_id=0) -> T5Inputs:
    """HF seq2seq inputs -> MegatronT5's. Decoder inputs default to the labels shifted right behind
    `decoder_start_token_id`, as HF's T5 makes them, so a batch of inputs and labels trains alike here."""
    if decoder_input_ids is None:
        if labels is None:
            raise MegatronPluginConfigError("decoder_input_ids", None, "pass decoder_input_ids or labels")
        decoder_input_ids = shift_right(labels, decoder_start_token_id, pad_token_id)
    enc = padding_mask(attention_mask)
    dec = attention_mask_4d(decoder_attention_mask, decoder_input_ids.shape[1])
    return T5Inputs(input_ids.long(), decoder_input_ids.long(), enc, dec, enc)


def t5_forward(model, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
               labels=None):
    """HF inputs -> logits [b, s_dec, vocab] gathered over TP (base model: decoder hidden states); with
    `labels` (-100 = no loss) the per-token loss."""
    cfg = model.hf_config
    inputs = t5_inputs(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels,
                       decoder_start_token_id=getattr(cfg, "decoder_start_token_id", None),
                       pad_token_id=getattr(cfg, "pad_token_id", None))
    if labels is not None:
        return model.module(*inputs, lm_labels=labels.masked_fill(labels < 0, 0))
    out = model.module(*inputs)
    if model.variant == "lm":
        out = gather_tensor_parallel_last_dim(out)[..., : cfg.vocab_size]
    return out


def _family(model_type: str, classes: str) -> ModelFamily:
    return ModelFamily(
        name=model_type,
        model_types=(model_type,),
        transformer_config=transformer_config,
        model_kwargs=lambda c: {},
        rules=rules,
        base_prefix="",
        classes={"lm": f"{classes}ForConditionalGeneration", "base": f"{classes}Model"},
        max_positions=lambda c: getattr(c, "n_positions", 512),
        build=build_t5,
        forward=t5_forward,
        inputs=t5_inputs,
        variant_of=t5_variant,
        train_step="T5TrainStep",
        trainable_variants=("lm",),
        tied_embeddings=tied,
        tied_aliases=tied_aliases,
        pipeline_note="megatron-core 0.16.1 has no pipeline schedule for encoder-decoder models (its stages pass "
                      "one tensor, T5's decoder needs the encoder's output on every stage): use tensor and data "
                      "parallelism",
    )


T5, MT5 = _family("t5", "T5"), _family("mt5", "MT5")
