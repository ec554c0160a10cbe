"""GPT-2 (`GPT2LMHeadModel`, `GPT2Model`) on Megatron-Core's GPTModel."""

from __future__ import annotations

import torch.nn.functional as F

from ..errors import MegatronPluginConfigError
from .causal import causal_lm_inputs
from .family import ModelFamily
from .mapping import Rule


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# HF `activation_function` -> the function Megatron's MLP applies
ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_tanh, "gelu": F.gelu, "relu": F.relu}


def biased_layernorm_block(hidden: int, heads: int) -> dict:
    """The TransformerConfig fields of the original transformer block, which GPT-2 and BERT both are:
    multi-head attention, LayerNorm, a bias on every linear, an ungated MLP."""
    return dict(
        num_query_groups=heads,
        kv_channels=hidden // heads,
        normalization="LayerNorm",
        gated_linear_unit=False,
        add_bias_linear=True,
        add_qkv_bias=True,
    )


def transformer_config(c) -> dict:
    if c.activation_function not in ACTIVATIONS:
        raise MegatronPluginConfigError(
            "activation_function", c.activation_function, f"GPT-2 support covers {sorted(ACTIVATIONS)}"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if getattr(c, flag, False):
            raise MegatronPluginConfigError(flag, True, "this GPT-2 variant is not supported; set it to False")
    if not getattr(c, "scale_attn_weights", True):
        raise MegatronPluginConfigError("scale_attn_weights", False, "only scaled attention is supported")
    return dict(
        num_layers=c.n_layer,
        hidden_size=c.n_embd,
        num_attention_heads=c.n_head,
        ffn_hidden_size=c.n_inner or 4 * c.n_embd,
        layernorm_epsilon=c.layer_norm_epsilon,
        activation_func=ACTIVATIONS[c.activation_function],
        # Megatron has one dropout for embeddings and residuals; GPT-2 configs set both alike.
        hidden_dropout=c.resid_pdrop,
        attention_dropout=c.attn_pdrop,
        init_method_std=c.initializer_range,
        **biased_layernorm_block(c.n_embd, c.n_head),
    )


def rules(c, tied: bool, variant: str) -> list:
    lm_head = variant == "lm"
    layer = "transformer.h.{i}."
    out = "decoder.layers.{i}."
    table = [
        Rule("transformer.wte.weight", "embedding.word_embeddings.weight", "vocab", tp_dim=0, stage="first"),
        Rule("transformer.wpe.weight", "embedding.position_embeddings.weight", stage="first"),
        Rule(layer + "ln_1.weight", out + "input_layernorm.weight"),
        Rule(layer + "ln_1.bias", out + "input_layernorm.bias"),
        Rule(layer + "attn.c_attn.weight", out + "self_attention.linear_qkv.weight", "qkv_conv1d", tp_dim=0),
        Rule(layer + "attn.c_attn.bias", out + "self_attention.linear_qkv.bias", "qkv_conv1d_bias", tp_dim=0),
        Rule(layer + "attn.c_proj.weight", out + "self_attention.linear_proj.weight", "conv1d", tp_dim=1),
        Rule(layer + "attn.c_proj.bias", out + "self_attention.linear_proj.bias"),
        Rule(layer + "ln_2.weight", out + "pre_mlp_layernorm.weight"),
        Rule(layer + "ln_2.bias", out + "pre_mlp_layernorm.bias"),
        Rule(layer + "mlp.c_fc.weight", out + "mlp.linear_fc1.weight", "conv1d", tp_dim=0),
        Rule(layer + "mlp.c_fc.bias", out + "mlp.linear_fc1.bias", tp_dim=0),
        Rule(layer + "mlp.c_proj.weight", out + "mlp.linear_fc2.weight", "conv1d", tp_dim=1),
        Rule(layer + "mlp.c_proj.bias", out + "mlp.linear_fc2.bias"),
        Rule("transformer.ln_f.weight", "decoder.final_layernorm.weight", stage="last"),
        Rule("transformer.ln_f.bias", "decoder.final_layernorm.bias", stage="last"),
    ]
    if lm_head and not tied:
        table.append(Rule("lm_head.weight", "output_layer.weight", "vocab", tp_dim=0, stage="last"))
    elif lm_head:
        table.append(Rule("transformer.wte.weight", "output_layer.weight", "vocab", tp_dim=0, stage="tied_output"))
    return table


GPT2 = ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    transformer_config=transformer_config,
    model_kwargs=lambda c: dict(position_embedding_type="learned_absolute"),
    rules=rules,
    base_prefix="transformer.",
    classes={"lm": "GPT2LMHeadModel", "base": "GPT2Model"},
    max_positions=lambda c: c.n_positions,
    tied_aliases=lambda c, v: {"lm_head.weight": "transformer.wte.weight"} if v == "lm" and c.tie_word_embeddings else {},
    position_limit=lambda c: c.n_positions,
    inputs=causal_lm_inputs,
)
