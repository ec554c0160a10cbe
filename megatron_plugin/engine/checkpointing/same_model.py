"""Whether a checkpoint is of the model it is loaded into.

The family, the variant and every setting that decides the weights' shapes and count are read from
meta.json's HF config and from the running model's, through the family's own TransformerConfig fields
(so GPT-2's `n_layer` and Llama's `num_hidden_layers` are compared alike). A checkpoint of the same model
in another TP/PP/virtual-stage layout is resharded; one of another model is refused before anything is
loaded, naming each setting that differs. Settings that shape no weight (dropout, rope scaling, the
longest rotary sequence) may differ.
"""

from __future__ import annotations

import os

from ...errors import MegatronPluginConfigError
from ..hf_io import hf_config_from_dict
from .layout import META
from .state import TrainingState

# (the name an error gives the setting, how to read it from (family, HF config, its TransformerConfig fields))
_SETTINGS = (
    ("model_type", lambda f, c, tc: c.model_type),
    ("num_hidden_layers", lambda f, c, tc: tc["num_layers"]),
    ("hidden_size", lambda f, c, tc: tc["hidden_size"]),
    ("num_attention_heads", lambda f, c, tc: tc["num_attention_heads"]),
    ("num_key_value_heads", lambda f, c, tc: tc.get("num_query_groups") or tc["num_attention_heads"]),
    ("head_dim", lambda f, c, tc: tc.get("kv_channels") or tc["hidden_size"] // tc["num_attention_heads"]),
    ("intermediate_size", lambda f, c, tc: tc["ffn_hidden_size"]),
    ("vocab_size", lambda f, c, tc: c.vocab_size),
    ("tie_word_embeddings", lambda f, c, tc: f.tied_embeddings(c)),
    ("max_position_embeddings", lambda f, c, tc: f.position_limit(c)),  # learned positions only: a weight
) + tuple(  # the block's layout, and MoE experts where the family has them
    (k, lambda f, c, tc, k=k: tc.get(k)) for k in (
        "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
        "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq")
) + tuple(  # HF settings of a few families that shape a weight the fields above do not
    (k, lambda f, c, tc, k=k: getattr(c, k, None)) for k in (
        "num_decoder_layers", "type_vocab_size", "relative_attention_num_buckets")
)


def _architecture(family, hf_config, variant: str) -> dict:
    tc = family.transformer_config(hf_config)
    arch = {name: read(family, hf_config, tc) for name, read in _SETTINGS}
    arch["tensors"] = len(family.mapped_hf_names(hf_config, variant))  # whatever else adds weights
    return arch


def mismatch(meta: dict, state: TrainingState) -> list:
    """'setting: checkpoint X, this model Y' for each setting in which the checkpoint's model differs from
    the running one; empty when it is the same model (whatever its parallel layout)."""
    model = state.model
    if meta["family"] != model.family.name:
        return [f"family: checkpoint {meta['family']}, this model {model.family.name}"]
    differ = [] if meta["variant"] == model.variant else [f"variant: checkpoint {meta['variant']}, this model {model.variant}"]
    saved = _architecture(model.family, hf_config_from_dict(meta["hf_config"]), meta["variant"])
    mine = _architecture(model.family, model.hf_config, model.variant)
    names = [name for name in saved if name != "tensors" and saved[name] != mine[name]]
    if not (differ or names) and saved["tensors"] != mine["tensors"]:
        names = ["tensors"]  # named only when no setting above explains it
    return differ + [f"{name}: checkpoint {saved[name]}, this model {mine[name]}" for name in names]


def check_same_model(ckpt: str, meta: dict, state: TrainingState) -> None:
    """Raise a clear error unless the checkpoint in `ckpt` (its `meta`) is of the model of `state`."""
    try:
        differ = mismatch(meta, state)
    except MegatronPluginConfigError:
        raise
    except Exception as err:  # a meta.json edited by hand, or of a transformers version that lacks a field
        raise MegatronPluginConfigError(
            "load_state", os.path.join(ckpt, META), f"cannot read the model config it records ({type(err).__name__}: "
            f"{err}): is the file damaged?") from None
    if differ:
        raise MegatronPluginConfigError(
            "load_state", ckpt,
            f"the checkpoint is of another model ({'; '.join(differ)}): load it into a model built from the "
            "checkpoint's config (its hf_config in meta.json), or pass a checkpoint saved from this model",
        )
