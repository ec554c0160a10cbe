"""Model families the plugin converts, looked up by HF `config.model_type`."""

from ..errors import MegatronPluginConfigError
from .family import ModelFamily
from .fields import check_model_fields
from .bert import BERT, MEGATRON_BERT
from .gpt2 import GPT2
from .llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .t5 import MT5, T5

FAMILIES = {t: fam for fam in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, BERT, MEGATRON_BERT, T5, MT5) for t in fam.model_types}


def get_family(hf_config) -> ModelFamily:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise MegatronPluginConfigError(
            "model_type", model_type, f"supported model types are {sorted(FAMILIES)}; convert another model first"
        )
    return FAMILIES[model_type]


def check_model(plugin, hf_config, world_size=None) -> ModelFamily:
    """Raise a clear error when the model can't be laid out as the plugin asks (over `world_size`
    processes, when given). No collectives."""
    family = get_family(hf_config)
    tc = family.transformer_config(hf_config)
    tp = plugin.tp_degree
    heads = tc["num_attention_heads"]
    groups = tc.get("num_query_groups") or heads
    if heads % tp:
        raise MegatronPluginConfigError(
            "tp_degree", tp, f"the model's {heads} attention heads must split evenly over TP ranks: use a divisor of {heads}"
        )
    if groups % tp and tp % groups:
        # fewer key/value heads than ranks works when each head serves a whole number of ranks
        raise MegatronPluginConfigError(
            "tp_degree", tp, f"the model's {groups} key/value heads must split evenly over TP ranks, or each be "
            f"shared by a whole number of them: use a divisor or a multiple of {groups} that divides {heads}"
        )
    ffn = tc.get("ffn_hidden_size")
    if ffn and ffn % tp:
        raise MegatronPluginConfigError(
            "tp_degree", tp, f"the model's MLP width {ffn} must split evenly over TP ranks: use a divisor of {ffn}"
        )
    if family.pipeline_note and plugin.pp_degree > 1:
        raise MegatronPluginConfigError("pp_degree", plugin.pp_degree, f"{family.name}: {family.pipeline_note}")
    # an uneven last stage is checked by Megatron's rule (check_model_fields), not the even split's
    uneven = getattr(plugin, "decoder_last_pipeline_num_layers", None) is not None
    plugin.validate(world_size=world_size, num_layers=None if uneven else tc["num_layers"])
    from .gpt import transformer_config_overrides

    transformer_config_overrides(plugin.other_megatron_args, tc)
    check_model_fields(plugin, hf_config, family)
    return family


__all__ = ["FAMILIES", "ModelFamily", "check_model", "get_family"]
