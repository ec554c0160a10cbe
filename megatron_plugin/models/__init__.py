"""Model families the plugin converts, looked up by HF `config.model_type`."""

from ..errors import MegatronPluginConfigError
from .family import ModelFamily
from .fields import check_model_fields
from .bert import BERT, MEGATRON_BERT
from .gpt2 import GPT2
from .llama import LLAMA, MISTRAL, QWEN2, QWEN3
from .moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from .t5 import MT5, T5

FAMILIES = {t: fam for fam in (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, BERT, MEGATRON_BERT,
                               T5, MT5) for t in fam.model_types}


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
    check_context_parallel_family(plugin, hf_config, family)
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
    # an MoE model's dense MLPs (if any; its experts are checked in check_experts)
    dense = not tc.get("num_moe_experts") or 0 in tc.get("moe_layer_freq", [0])
    if ffn and dense and ffn % tp:
        raise MegatronPluginConfigError(
            "tp_degree", tp, f"the model's MLP width {ffn} must split evenly over TP ranks: use a divisor of {ffn}"
        )
    if family.pipeline_note and plugin.pp_degree > 1:
        raise MegatronPluginConfigError("pp_degree", plugin.pp_degree, f"{family.name}: {family.pipeline_note}")
    if family.sequence_parallel_note and plugin.sequence_parallelism:
        raise MegatronPluginConfigError("sequence_parallelism", True, f"{family.name}: {family.sequence_parallel_note}")
    # an uneven last stage is checked by Megatron's rule (check_model_fields), not the even split's
    uneven = getattr(plugin, "decoder_last_pipeline_num_layers", None) is not None
    plugin.validate(world_size=world_size, num_layers=None if uneven else tc["num_layers"])
    check_experts(plugin, hf_config, family, tc)
    from .gpt import transformer_config_overrides

    transformer_config_overrides(plugin.other_megatron_args, tc)
    check_model_fields(plugin, hf_config, family)
    return family


# the families whose attention the context-parallel split is written for: causal self-attention over one
# sequence (layers/context_parallel.py, layers/attention.SDPAttention)
CONTEXT_PARALLEL_FAMILIES = (GPT2, LLAMA, MISTRAL, QWEN2, QWEN3)


def check_context_parallel_family(plugin, hf_config, family: ModelFamily) -> None:
    """context_parallel_size > 1 only for the causal dense families; the others are refused by name. No
    collectives."""
    cp = getattr(plugin, "context_parallel_size", 1) or 1
    if cp == 1 or family in CONTEXT_PARALLEL_FAMILIES:
        return
    supported = "GPT-2, Llama, Mistral, Qwen2 and Qwen3"
    if family.num_experts(hf_config):
        why = (f"context parallelism is not implemented for mixture-of-experts models ({family.name}) yet: "
               "the router's load-balancing and z-losses and the logged expert loads are computed over one rank's "
               "tokens and are not combined over the context-parallel ranks")
        instead = "for long sequences use sequence_parallelism=True with tp_degree > 1 (and expert_model_parallel_size)"
    elif family in (T5, MT5):
        why = (f"context parallelism splits one causal sequence; {family.name} is an encoder-decoder model (its "
               "encoder's bidirectional attention and the decoder's cross-attention are not split here)")
        instead = "for long sequences use sequence_parallelism=True with tp_degree > 1"
    else:
        why = (f"context parallelism splits causal attention; {family.name}'s attention is bidirectional (every "
               "token attends to both sides), which is not split here")
        instead = "for long sequences use sequence_parallelism=True with tp_degree > 1"
    raise MegatronPluginConfigError(
        "context_parallel_size", cp, f"{why}: use context_parallel_size=1 ({supported} models take it); {instead}")


def check_experts(plugin, hf_config, family: ModelFamily, tc: dict) -> None:
    """The expert layout and MoE options against the model (design: issue 26). No collectives."""
    ep = plugin.expert_model_parallel_size
    experts = family.num_experts(hf_config)
    if not experts:
        if ep > 1:
            raise MegatronPluginConfigError(
                "expert_model_parallel_size", ep,
                f"the {family.name} model has no experts to split: leave expert_model_parallel_size at 1",
            )
        if plugin.expert_tensor_parallel_size not in (None, plugin.tp_degree):
            raise MegatronPluginConfigError(
                "expert_tensor_parallel_size", plugin.expert_tensor_parallel_size,
                f"the {family.name} model has no experts to split: leave expert_tensor_parallel_size unset",
            )
        return
    if experts % ep:
        raise MegatronPluginConfigError(
            "expert_model_parallel_size", ep,
            f"the model's {experts} experts must split evenly over expert-parallel ranks: use a divisor of {experts}",
        )
    etp = plugin.expert_tensor_parallel_size or plugin.tp_degree
    width = tc["moe_ffn_hidden_size"]
    if width % etp:
        raise MegatronPluginConfigError(
            "expert_tensor_parallel_size" if plugin.expert_tensor_parallel_size else "tp_degree", etp,
            f"each expert's MLP width {width} must split evenly over expert tensor-parallel ranks: use a divisor "
            f"of {width}",
        )
    shared = tc.get("moe_shared_expert_intermediate_size")
    if shared and shared % plugin.tp_degree:
        raise MegatronPluginConfigError(
            "tp_degree", plugin.tp_degree,
            f"the shared expert's MLP width {shared} must split evenly over TP ranks: use a divisor of {shared}",
        )
    args = plugin.other_megatron_args if isinstance(plugin.other_megatron_args, dict) else {}
    capacity = args.get("moe_expert_capacity_factor")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0):
        raise MegatronPluginConfigError(
            "other_megatron_args['moe_expert_capacity_factor']", capacity,
            "use a number > 0 (tokens an expert takes, as a multiple of an even share), or None for dropless "
            "routing, as HF's",
        )
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = args.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise MegatronPluginConfigError(f"other_megatron_args[{key!r}]", value, "use a number >= 0 (0 turns it off)")


def _check_stages_have_experts(plugin, tc: dict) -> None:
    """Every pipeline rank must hold an MoE layer: the expert gradient norm (and megatron-core's expert
    optimizer) all-reduce over the expert x pipeline group, which a rank without expert parameters never
    enters, so the others would wait for it for ever."""
    from .mapping import StagePlan

    pattern = tc.get("moe_layer_freq")
    if not isinstance(pattern, (list, tuple)):
        return
    layers = len(pattern)
    vp = plugin.virtual_pipeline_stages(layers) or 1
    for rank in range(plugin.pp_degree):
        held = []
        for v in range(vp):
            try:
                plan = StagePlan.for_rank(layers, plugin.pp_degree, rank, v, vp,
                                          last_stage_layers=plugin.decoder_last_pipeline_num_layers)
            except ValueError:
                return  # the split itself is refused elsewhere, by its own setting
            held += pattern[plan.layer_offset:plan.layer_offset + plan.num_layers]
        if not any(held):
            raise MegatronPluginConfigError(
                "pp_degree", plugin.pp_degree,
                f"pipeline stage {rank} would hold only dense layers (the model's MoE layers: "
                f"{[i for i, m in enumerate(pattern) if m]}), and the expert gradient norm all-reduces over every "
                "stage: choose a pp_degree (or decoder_last_pipeline_num_layers) that gives each stage an MoE layer",
            )


def check_moe_training(plugin, hf_config) -> None:
    """What training an MoE model needs beyond its layout (prepare's resolve; an offline conversion trains
    nothing, so checkpoint_utils does not ask): every pipeline stage holds an MoE layer, and the router losses
    have every layer's statistics on one rank, with gradients. No collectives."""
    family = get_family(hf_config)
    if not family.num_experts(hf_config):
        return
    tc = family.transformer_config(hf_config)
    if plugin.pp_degree > 1:
        _check_stages_have_experts(plugin, tc)
    args = plugin.other_megatron_args if isinstance(plugin.other_megatron_args, dict) else {}
    aux = args.get("moe_aux_loss_coeff", tc.get("moe_aux_loss_coeff", 0.0))
    if aux and plugin.pp_degree > 1:
        raise MegatronPluginConfigError(
            "other_megatron_args['moe_aux_loss_coeff']", aux,
            "HF's load-balancing loss multiplies the routing statistics of all layers together, which pipeline "
            "stages hold apart: set other_megatron_args={'moe_aux_loss_coeff': 0.0} (or the HF config's "
            "output_router_logits=False), or pp_degree=1",
        )
    z = args.get("moe_z_loss_coeff")
    recompute_moe = plugin.recompute_granularity == "full" or (
        plugin.recompute_granularity == "selective" and "moe" in (args.get("recompute_modules") or ()))
    if (aux or z) and recompute_moe:
        # megatron-core runs a recomputed layer's forward under no_grad: the router statistics the losses are
        # built from would carry no gradient, and the routers would train as if the coefficients were 0
        raise MegatronPluginConfigError(
            "recompute_granularity", plugin.recompute_granularity,
            "the router losses (moe_aux_loss_coeff / moe_z_loss_coeff > 0) need the MoE layers' forward outside "
            "activation recompute: use recompute_activations=True (selective: attention only), or set the "
            "coefficients to 0.0 in other_megatron_args",
        )
    if z and plugin.pp_degree > 1:
        # the router losses are added where one stage holds every layer's statistics; under PP they would be lost
        raise MegatronPluginConfigError(
            "other_megatron_args['moe_z_loss_coeff']", z,
            "the router losses are computed from every layer's statistics on one pipeline stage: set "
            "other_megatron_args={'moe_z_loss_coeff': 0.0}, or pp_degree=1",
        )



__all__ = ["FAMILIES", "ModelFamily", "check_model", "check_moe_training", "get_family"]
