"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on Megatron-Core's GPTModel.

All four are the same decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP. What
differs is data, in `TRAITS`: which linears carry biases, Qwen3's per-head q/k norms, Mistral's window.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F

from ..errors import MegatronPluginConfigError
from ..layers.rope import check_rope
from .causal import causal_lm_inputs
from .family import ModelFamily
from .mapping import Rule

# model_type -> (qkv bias, output-projection bias, MLP bias, q/k norm), each a function of the config
TRAITS = {
    "llama": dict(qkv_bias=lambda c: c.attention_bias, o_bias=lambda c: c.attention_bias,
                  mlp_bias=lambda c: getattr(c, "mlp_bias", False), qk_norm=False,
                  classes=("LlamaForCausalLM", "LlamaModel")),
    "mistral": dict(qkv_bias=lambda c: False, o_bias=lambda c: False, mlp_bias=lambda c: False, qk_norm=False,
                    classes=("MistralForCausalLM", "MistralModel")),
    "qwen2": dict(qkv_bias=lambda c: True, o_bias=lambda c: False, mlp_bias=lambda c: False, qk_norm=False,
                  classes=("Qwen2ForCausalLM", "Qwen2Model")),
    "qwen3": dict(qkv_bias=lambda c: getattr(c, "attention_bias", False), o_bias=lambda c: getattr(c, "attention_bias", False),
                  mlp_bias=lambda c: False, qk_norm=True, classes=("Qwen3ForCausalLM", "Qwen3Model")),
    # the MoE families (models/moe.py) share this decoder's attention
    "mixtral": dict(qkv_bias=lambda c: False, o_bias=lambda c: False, mlp_bias=lambda c: False, qk_norm=False),
    "qwen2_moe": dict(qkv_bias=lambda c: bool(getattr(c, "qkv_bias", True)), o_bias=lambda c: False,
                      mlp_bias=lambda c: False, qk_norm=False),
    "qwen3_moe": dict(qkv_bias=lambda c: getattr(c, "attention_bias", False),
                      o_bias=lambda c: getattr(c, "attention_bias", False), mlp_bias=lambda c: False, qk_norm=True),
}


def head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def sliding_window(c) -> Optional[int]:
    """The attention window every layer uses, or None; a window on some layers only is refused."""
    if c.model_type == "mistral":
        return getattr(c, "sliding_window", None)
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", False) else None
    types = getattr(c, "layer_types", None)
    if types is None:  # transformers 4: layers from max_window_layers on slide
        start = getattr(c, "max_window_layers", c.num_hidden_layers)
        types = ["sliding_attention" if window and i >= start else "full_attention" for i in range(c.num_hidden_layers)]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window:
        return window
    raise MegatronPluginConfigError(
        "layer_types", sorted(kinds),
        "a sliding window on some layers only is not mapped: use full attention on every layer "
        "(use_sliding_window=False) or the window on every layer",
    )


def _biases(c):
    traits = TRAITS[c.model_type]
    qkv, o, mlp = traits["qkv_bias"](c), traits["o_bias"](c), traits["mlp_bias"](c)
    # mcore has one switch for every linear's bias and one more for the QKV bias
    if (qkv, o, mlp) == (False, False, False):
        return dict(add_bias_linear=False, add_qkv_bias=False)
    if (qkv, o, mlp) == (True, False, False):
        return dict(add_bias_linear=False, add_qkv_bias=True)
    if (qkv, o, mlp) == (True, True, True):
        return dict(add_bias_linear=True, add_qkv_bias=True)
    raise MegatronPluginConfigError(
        "attention_bias/mlp_bias", (qkv, o, mlp),
        "biases on (q/k/v, o_proj, MLP) must be all off, q/k/v only (Qwen2), or all on: Megatron's layer has no "
        "other combination",
    )


def transformer_config(c) -> dict:
    if c.hidden_act != "silu":
        raise MegatronPluginConfigError("hidden_act", c.hidden_act, f"the {c.model_type} mapping covers SwiGLU ('silu')")
    if getattr(c, "pretraining_tp", 1) != 1:
        raise MegatronPluginConfigError("pretraining_tp", c.pretraining_tp, "set it to 1 (it only slices matmuls in HF)")
    check_rope(c)
    sliding_window(c)
    return dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        kv_channels=head_dim(c),
        ffn_hidden_size=c.intermediate_size,
        layernorm_epsilon=c.rms_norm_eps,
        normalization="RMSNorm",
        activation_func=F.silu,
        gated_linear_unit=True,
        qk_layernorm=TRAITS[c.model_type]["qk_norm"],
        # HF's rope (halves rotated, not interleaved), from the model's cos/sin tables through mcore's
        # fused-rope slot (layers/rope.py); an override of either would not carry HF's weights right
        apply_rope_fusion=True,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=getattr(c, "attention_dropout", 0.0),
        init_method_std=c.initializer_range,
        **_biases(c),
    )


def rules(c, tied: bool, variant: str) -> list:
    lm_head = variant == "lm"
    layer = "model.layers.{i}."
    out = "decoder.layers.{i}."
    attn = layer + "self_attn."
    traits = TRAITS[c.model_type]
    table = [
        Rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", "vocab", tp_dim=0, stage="first"),
        Rule(layer + "input_layernorm.weight", out + "input_layernorm.weight"),
        Rule((attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
             out + "self_attention.linear_qkv.weight", "qkv_split", tp_dim=0),
        Rule(attn + "o_proj.weight", out + "self_attention.linear_proj.weight", tp_dim=1),
        Rule(layer + "post_attention_layernorm.weight", out + "pre_mlp_layernorm.weight"),
        Rule((layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"), out + "mlp.linear_fc1.weight", "gate_up",
             tp_dim=0, tp_interleave=2),
        Rule(layer + "mlp.down_proj.weight", out + "mlp.linear_fc2.weight", tp_dim=1),
        Rule("model.norm.weight", "decoder.final_layernorm.weight", stage="last"),
    ]
    if traits["qkv_bias"](c):
        table.append(Rule((attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                          out + "self_attention.linear_qkv.bias", "qkv_split", tp_dim=0))
    if traits["o_bias"](c):
        table.append(Rule(attn + "o_proj.bias", out + "self_attention.linear_proj.bias"))
    if traits["mlp_bias"](c):
        table += [
            Rule((layer + "mlp.gate_proj.bias", layer + "mlp.up_proj.bias"), out + "mlp.linear_fc1.bias", "gate_up",
                 tp_dim=0, tp_interleave=2),
            Rule(layer + "mlp.down_proj.bias", out + "mlp.linear_fc2.bias"),
        ]
    if traits["qk_norm"]:
        table += [
            Rule(attn + "q_norm.weight", out + "self_attention.q_layernorm.weight"),
            Rule(attn + "k_norm.weight", out + "self_attention.k_layernorm.weight"),
        ]
    if lm_head and not tied:
        table.append(Rule("lm_head.weight", "output_layer.weight", "vocab", tp_dim=0, stage="last"))
    elif lm_head:
        table.append(Rule("model.embed_tokens.weight", "output_layer.weight", "vocab", tp_dim=0, stage="tied_output"))
    return table


def decoder_family(model_type: str, classes, **fields) -> ModelFamily:
    """A family of this decoder (rotary positions, untied-by-default embeddings, `model.` base prefix);
    `fields` replace or add ModelFamily fields (the MoE families' config, table and experts, models/moe.py)."""
    lm_class, base_class = classes
    return ModelFamily(**{
        "name": model_type,
        "model_types": (model_type,),
        "transformer_config": transformer_config,
        # positions are rotary angles computed per token by the model (layers/rope.py), not an embedding
        "model_kwargs": lambda c: dict(position_embedding_type="none"),
        "rules": rules,
        "base_prefix": "model.",
        "classes": {"lm": lm_class, "base": base_class},
        "max_positions": lambda c: c.max_position_embeddings,
        "tied_embeddings": lambda c: bool(getattr(c, "tie_word_embeddings", False)),
        "tied_aliases": lambda c, v: {"lm_head.weight": "model.embed_tokens.weight"}
        if v == "lm" and getattr(c, "tie_word_embeddings", False) else {},
        "rotary": True,
        "sliding_window": sliding_window,
        "inputs": causal_lm_inputs,
        **fields,
    })


LLAMA, MISTRAL, QWEN2, QWEN3 = (decoder_family(t, TRAITS[t]["classes"]) for t in ("llama", "mistral", "qwen2", "qwen3"))
