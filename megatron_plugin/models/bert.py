"""BERT on Megatron-Core's BertModel: HF `bert` (post-LN) and `megatron-bert` (pre-LN).

Variants (HF classes): "pretraining" (…ForPreTraining: MLM head, pooler, sentence-order/NSP head),
"mlm" (…ForMaskedLM: MLM head), "base" (…Model with its pooler), "base_no_pooler" (add_pooling_layer=False).

`megatron-bert` is mcore's layer as it is (pre-LN, a final encoder norm). HF `bert` normalizes after the
residual adds: its layers are `layers.post_ln.PostLNTransformerLayer` and its embeddings get a LayerNorm.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.bert.pooler import Pooler
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from ..errors import MegatronPluginConfigError
from ..layers.comm import gather_tensor_parallel_last_dim
from ..layers.embedding import use_our_word_embeddings
from ..layers.masks import padding_mask
from ..layers.norm import Norm
from ..layers.spec import block_spec
from .common import HFParityMixin, use_our_output_layer
from .family import ModelFamily
from .gpt import padded_vocab_size
from .gpt2 import biased_layernorm_block, gelu_tanh
from .mapping import Rule

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "relu": F.relu}
LM_VARIANTS = ("pretraining", "mlm")
POOLER_VARIANTS = ("pretraining", "base")


def bert_variant(hf_model) -> str:
    heads = getattr(hf_model, "cls", None)
    if heads is not None:
        return "pretraining" if hasattr(heads, "seq_relationship") else "mlm"
    return "base" if getattr(hf_model, "pooler", None) is not None else "base_no_pooler"


def post_ln(c) -> bool:
    return c.model_type == "bert"


def transformer_config(c) -> dict:
    if getattr(c, "position_embedding_type", "absolute") not in (None, "absolute"):
        raise MegatronPluginConfigError("position_embedding_type", c.position_embedding_type,
                                        "the BERT mapping covers absolute (learned) position embeddings")
    for flag in ("is_decoder", "add_cross_attention"):
        if getattr(c, flag, False):
            raise MegatronPluginConfigError(flag, True, "BERT is mapped as an encoder: set it to False")
    if c.hidden_act not in ACTIVATIONS:
        raise MegatronPluginConfigError("hidden_act", c.hidden_act, f"the BERT mapping covers {sorted(ACTIVATIONS)}")
    return dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size,
        layernorm_epsilon=c.layer_norm_eps,
        activation_func=ACTIVATIONS[c.hidden_act],
        hidden_dropout=c.hidden_dropout_prob,
        attention_dropout=c.attention_probs_dropout_prob,
        init_method_std=c.initializer_range,
        **biased_layernorm_block(c.hidden_size, c.num_attention_heads),
    )


def rules(c, tied: bool, variant: str) -> list:
    emb, layer, out = "bert.embeddings.", "bert.encoder.layer.{i}.", "encoder.layers.{i}."
    attn = layer + "attention."
    table = [
        Rule(emb + "word_embeddings.weight", "embedding.word_embeddings.weight", "vocab", tp_dim=0, stage="first"),
        Rule(emb + "position_embeddings.weight", "embedding.position_embeddings.weight", stage="first"),
        Rule(emb + "token_type_embeddings.weight", "embedding.tokentype_embeddings.weight", stage="first"),
        Rule((attn + "self.query.weight", attn + "self.key.weight", attn + "self.value.weight"),
             out + "self_attention.linear_qkv.weight", "qkv_split", tp_dim=0),
        Rule((attn + "self.query.bias", attn + "self.key.bias", attn + "self.value.bias"),
             out + "self_attention.linear_qkv.bias", "qkv_split", tp_dim=0),
        Rule(attn + "output.dense.weight", out + "self_attention.linear_proj.weight", tp_dim=1),
        Rule(attn + "output.dense.bias", out + "self_attention.linear_proj.bias"),
        Rule(layer + "intermediate.dense.weight", out + "mlp.linear_fc1.weight", tp_dim=0),
        Rule(layer + "intermediate.dense.bias", out + "mlp.linear_fc1.bias", tp_dim=0),
        Rule(layer + "output.dense.weight", out + "mlp.linear_fc2.weight", tp_dim=1),
        Rule(layer + "output.dense.bias", out + "mlp.linear_fc2.bias"),
    ]
    if post_ln(c):
        for p in ("weight", "bias"):
            table += [
                Rule(emb + f"LayerNorm.{p}", f"embedding_norm.{p}", stage="first"),
                Rule(attn + f"output.LayerNorm.{p}", out + f"post_attention_layernorm.{p}"),
                Rule(layer + f"output.LayerNorm.{p}", out + f"post_mlp_layernorm.{p}"),
            ]
    else:
        for p in ("weight", "bias"):
            table += [
                Rule(attn + f"ln.{p}", out + f"input_layernorm.{p}"),
                Rule(layer + f"ln.{p}", out + f"pre_mlp_layernorm.{p}"),
                Rule(f"bert.encoder.ln.{p}", f"encoder.final_layernorm.{p}", stage="last"),
            ]
    if variant in POOLER_VARIANTS:
        table += [Rule(f"bert.pooler.dense.{p}", f"pooler.dense.{p}", stage="last") for p in ("weight", "bias")]
    if variant in LM_VARIANTS:
        head = "cls.predictions."
        table += [
            Rule(head + "transform.dense.weight", "lm_head.dense.weight", stage="last"),
            Rule(head + "transform.dense.bias", "lm_head.dense.bias", stage="last"),
            Rule(head + "transform.LayerNorm.weight", "lm_head.layer_norm.weight", stage="last"),
            Rule(head + "transform.LayerNorm.bias", "lm_head.layer_norm.bias", stage="last"),
        ]
        # transformers 4 always ties decoder.bias to predictions.bias; transformers 5 ties them only with
        # tied embeddings, and an untied decoder then uses its own bias (predictions.bias goes unused)
        bias = head + ("bias" if tied else "decoder.bias")
        table.append(Rule(bias, "output_layer.bias", "vocab", tp_dim=0, stage="last"))
        if tied:
            table.append(Rule(emb + "word_embeddings.weight", "output_layer.weight", "vocab", tp_dim=0, stage="tied_output"))
        else:
            table.append(Rule(head + "decoder.weight", "output_layer.weight", "vocab", tp_dim=0, stage="last"))
    if variant == "pretraining":
        table += [Rule(f"cls.seq_relationship.{p}", f"binary_head.{p}", stage="last") for p in ("weight", "bias")]
    return table


def tied_aliases(c, variant: str) -> dict:
    if variant not in LM_VARIANTS:
        return {}
    if getattr(c, "tie_word_embeddings", True):
        return {"cls.predictions.decoder.bias": "cls.predictions.bias",
                "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}
    return {"cls.predictions.bias": "cls.predictions.decoder.bias"}


class MegatronBert(HFParityMixin, BertModel):
    """BertModel with HF's heads per variant, HF's exact order of norms and dropout, our SP-capable norms
    and vocab-parallel loss. forward(input_ids, attention_mask [b, 1, 1, s] True = masked, tokentype_ids,
    lm_labels, position_ids) -> (per-token MLM loss [b, s] or logits [b, s, local vocab] or hidden states,
    binary-head logits [b, 2] or the pooled output or None)."""

    def __init__(self, *args, true_vocab_size: int, variant: str, post_ln: bool, head_activation, **kwargs):
        super().__init__(*args, add_binary_head=variant == "pretraining", **kwargs)
        config = self.config
        self.true_vocab_size = true_vocab_size
        self.variant = variant
        self.post_ln = post_ln
        self.head_activation = head_activation
        if self.pre_process and post_ln:
            # HF: LayerNorm(word + position + token type), then dropout; mcore's embedding would drop out first
            self.embedding.embedding_dropout = torch.nn.Dropout(0.0)
            self.embedding_norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)
            self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)
        if self.post_process:
            if variant in LM_VARIANTS:
                # mcore's BertLMHead norm is WrappedTorchNorm (no sequence parallelism without apex)
                self.lm_head.layer_norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)
                use_our_output_layer(self.output_layer)
            else:
                del self.lm_head, self.output_layer
            if variant == "base":
                self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel)
        use_our_word_embeddings(self, self.share_embeddings_and_output_weights and self.post_process)

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        # mcore asks TE's version whenever the core attention is not its own; ours takes [b, 1, 1, s]
        return "b11s"

    def _embed(self, input_ids, position_ids, tokentype_ids):
        if position_ids is None:
            position_ids = self.bert_position_ids(input_ids)
        if tokentype_ids is None and self.embedding.tokentype_embeddings is not None:
            tokentype_ids = torch.zeros_like(input_ids)
        out = self.embedding(input_ids=input_ids, position_ids=position_ids, tokentype_ids=tokentype_ids)
        if self.post_ln:
            out = self.embedding_norm(out)
            if self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    out = self.embedding_dropout(out)
            else:
                out = self.embedding_dropout(out)
        return out

    def forward(self, input_ids, attention_mask=None, tokentype_ids=None, lm_labels=None, position_ids=None, **kwargs):
        encoder_input = self._embed(input_ids, position_ids, tokentype_ids) if self.pre_process else None
        hidden = self.encoder(hidden_states=encoder_input, attention_mask=attention_mask)
        if not self.post_process:
            return hidden
        pooled = self.pooler(hidden, 0) if self.variant in POOLER_VARIANTS else None
        if self.variant not in LM_VARIANTS:
            if self.config.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return hidden.transpose(0, 1).contiguous(), pooled
        h = self.lm_head.layer_norm(self.head_activation(self.lm_head.dense(hidden)))
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(h, weight=weight)
        binary_logits = self.binary_head(pooled) if self.binary_head is not None else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits


def build_bert(family, hf_config, config, plugin, plan, *, variant="mlm", backend="local", vp_stage=None):
    spec = block_spec(config, plan.num_layers, backend, causal=False, post_ln=post_ln(hf_config))
    return MegatronBert(
        config=config,
        num_tokentypes=hf_config.type_vocab_size,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, plugin.make_vocab_size_divisible_by, plugin.tp_degree),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=plan.first,
        post_process=plan.last,
        share_embeddings_and_output_weights=variant in LM_VARIANTS and family.tied_embeddings(hf_config),
        true_vocab_size=hf_config.vocab_size,
        variant=variant,
        post_ln=post_ln(hf_config),
        head_activation=ACTIVATIONS[hf_config.hidden_act],
        vp_stage=vp_stage,
    )


class BertInputs(NamedTuple):
    """MegatronBert's inputs; its forward takes the labels between them, so they go in by name."""

    tokens: torch.Tensor  # [b, s] long
    padding_mask: Optional[torch.Tensor]  # [b, 1, 1, s] bool, True = masked; None = nothing padded
    token_types: Optional[torch.Tensor]  # [b, s]; None: the model takes zeros
    position_ids: Optional[torch.Tensor]  # [b, s]; None: the model takes 0..s-1


def bert_inputs(input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> BertInputs:
    """HF BERT inputs -> MegatronBert's. An encoder attends both ways, so the mask is the padding alone;
    absent token types and positions stay None for the model's own defaults, which only its first
    pipeline stage (the one with embeddings) can fill."""
    return BertInputs(input_ids.long(), padding_mask(attention_mask), token_type_ids, position_ids)


def bert_forward(model, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None):
    """HF inputs -> (MLM logits [b, s, vocab] gathered over TP, NSP logits) for the LM variants,
    (last hidden state, pooled output) for the base ones; with shifted-free `labels` the per-token loss."""
    x = bert_inputs(input_ids, attention_mask, token_type_ids, position_ids)
    if labels is not None:
        return model.module(x.tokens, x.padding_mask, x.token_types, labels.masked_fill(labels < 0, 0), x.position_ids)
    out, second = model.module(x.tokens, x.padding_mask, x.token_types, None, x.position_ids)
    if model.plan.last and model.variant in LM_VARIANTS:
        out = gather_tensor_parallel_last_dim(out)[..., : model.hf_config.vocab_size]
    return out, second


def _family(model_type: str, prefix_classes: str) -> ModelFamily:
    return ModelFamily(
        name=model_type,
        model_types=(model_type,),
        transformer_config=transformer_config,
        model_kwargs=lambda c: {},
        rules=rules,
        base_prefix="bert.",
        classes={"pretraining": f"{prefix_classes}ForPreTraining", "mlm": f"{prefix_classes}ForMaskedLM",
                 "base": f"{prefix_classes}Model", "base_no_pooler": f"{prefix_classes}Model"},
        max_positions=lambda c: c.max_position_embeddings,
        build=build_bert,
        forward=bert_forward,
        inputs=bert_inputs,
        variant_of=bert_variant,
        train_step="BertTrainStep",
        trainable_variants=LM_VARIANTS,
        tied_aliases=tied_aliases,
        position_limit=lambda c: c.max_position_embeddings,
        base_variants=("base", "base_no_pooler"),
        sequence_parallel_note="megatron-core 0.16.1's BertLMHead builds a torch LayerNorm that asserts "
        "sequence_parallel is off (before any weight is loaded): set sequence_parallelism=False",
    )


BERT = _family("bert", "Bert")
MEGATRON_BERT = _family("megatron-bert", "MegatronBert")
