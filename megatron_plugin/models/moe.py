"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) on Megatron-Core's GPTModel.

Each is a Llama-family decoder (models/llama.py: attention, rope, biases, q/k norms, window) whose MLP is,
on some or all layers, Megatron-Core's MoE layer: a router `mlp.router`, routed experts
`mlp.experts.local_experts.{e}` (SequentialMLP's names) and, for Qwen2-MoE, a shared expert with a sigmoid
gate `mlp.shared_experts`. What differs between the three is data, in `MOE_TRAITS`: where HF keeps the
router and experts in its checkpoints, how top-k probabilities are normalized, which layers are MoE.

HF names are the checkpoint (on-disk) names that transformers 5's `save_pretrained` writes and the Hub
holds, one tensor per expert; a live transformers-5 model stacks its experts, and
`moe_names.checkpoint_state_dict` turns its state dict into these names (transformers' own
`revert_weight_conversion`).
"""

from __future__ import annotations

from typing import List, Optional

from ..errors import MegatronPluginConfigError
from . import llama
from .family import ModelFamily
from .mapping import Rule

_STACKED = ((r"\.experts\.\d+\.(gate_proj|up_proj)\.weight$", ".experts.gate_up_proj"),
            (r"\.experts\.\d+\.down_proj\.weight$", ".experts.down_proj"))

# model_type -> where the MoE block's tensors are in HF checkpoints, and how the family routes
MOE_TRAITS = {
    "mixtral": dict(
        block="block_sparse_moe.", gate="gate.weight", experts=("w1.weight", "w3.weight", "w2.weight"),
        num_experts=lambda c: c.num_local_experts, moe_ffn=lambda c: c.intermediate_size,
        normalize=lambda c: True,  # Mixtral always renormalizes its top-k probabilities
        shared=False, classes=("MixtralForCausalLM", "MixtralModel"),
        live_names=((r"\.block_sparse_moe\.gate\.weight$", ".mlp.gate.weight"),
                    (r"\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", ".mlp.experts.gate_up_proj"),
                    (r"\.block_sparse_moe\.experts\.\d+\.w2\.weight$", ".mlp.experts.down_proj")),
    ),
    "qwen2_moe": dict(
        block="mlp.", gate="gate.weight", experts=("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
        num_experts=lambda c: c.num_experts, moe_ffn=lambda c: c.moe_intermediate_size,
        normalize=lambda c: bool(c.norm_topk_prob), shared=True,
        classes=("Qwen2MoeForCausalLM", "Qwen2MoeModel"), live_names=_STACKED,
    ),
    "qwen3_moe": dict(
        block="mlp.", gate="gate.weight", experts=("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
        num_experts=lambda c: c.num_experts, moe_ffn=lambda c: c.moe_intermediate_size,
        normalize=lambda c: bool(c.norm_topk_prob), shared=False,
        classes=("Qwen3MoeForCausalLM", "Qwen3MoeModel"), live_names=_STACKED,
    ),
}


def num_experts(c) -> int:
    return MOE_TRAITS[c.model_type]["num_experts"](c)


def moe_layers(c) -> List[int]:
    """1 for each layer whose MLP is an MoE block, 0 for a dense one: Megatron-Core's `moe_layer_freq` list.
    Qwen's rule (its decoder layer's): not in `mlp_only_layers` and every `decoder_sparse_step`-th layer."""
    if c.model_type == "mixtral":
        return [1] * c.num_hidden_layers
    only_dense = set(getattr(c, "mlp_only_layers", None) or [])
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return [int(i not in only_dense and num_experts(c) > 0 and (i + 1) % step == 0) for i in range(c.num_hidden_layers)]


def _check_router(c) -> None:
    """Router variants the mapping does not carry are refused by name rather than trained differently."""
    jitter = getattr(c, "router_jitter_noise", None) or 0.0
    if jitter > 0:
        raise MegatronPluginConfigError(
            "router_jitter_noise", jitter,
            "Mixtral's router jitter (random scaling of the router's input in training) is not mapped: set "
            "router_jitter_noise=0.0 in the HF config",
        )
    if num_experts(c) < 1:
        raise MegatronPluginConfigError("num_experts", num_experts(c), "an MoE model needs at least one expert")
    topk = c.num_experts_per_tok
    if not 1 <= topk <= num_experts(c):
        raise MegatronPluginConfigError("num_experts_per_tok", topk, f"use 1 to {num_experts(c)} (the number of experts)")
    if topk == 1 and MOE_TRAITS[c.model_type]["normalize"](c):
        # HF's renormalized top-1 weight is exactly 1; megatron-core 0.16.1's config refuses a top-1 router
        # that does not take the softmax over all experts (the weight p < 1), which is another model
        raise MegatronPluginConfigError(
            "num_experts_per_tok", 1,
            "a top-1 router with renormalized probabilities (norm_topk_prob=True, or Mixtral) is not mapped: use "
            "num_experts_per_tok >= 2, or norm_topk_prob=False (Qwen2/3-MoE)",
        )
    if c.model_type == "qwen2_moe" and getattr(c, "shared_expert_intermediate_size", 0) <= 0:
        raise MegatronPluginConfigError(
            "shared_expert_intermediate_size", getattr(c, "shared_expert_intermediate_size", None),
            "Qwen2-MoE's shared expert is mapped with its width > 0",
        )


def aux_loss_coeff(c) -> float:
    """HF adds `router_aux_loss_coef` times its load-balancing loss only when the config sets
    `output_router_logits`; so does the train step with `moe_aux_loss_coeff`."""
    return float(c.router_aux_loss_coef) if getattr(c, "output_router_logits", False) else 0.0


def transformer_config(c) -> dict:
    _check_router(c)
    fields = llama.transformer_config(c)
    traits = MOE_TRAITS[c.model_type]
    pattern = moe_layers(c)
    fields.update(
        num_moe_experts=num_experts(c),
        moe_router_topk=c.num_experts_per_tok,
        moe_ffn_hidden_size=traits["moe_ffn"](c),
        moe_layer_freq=pattern,
        # softmax over every expert, then top-k, not renormalized (HF's norm_topk_prob=False); else the top-k
        # renormalized, which mcore computes as a softmax over the top-k logits
        moe_router_pre_softmax=not traits["normalize"](c),
        moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size if traits["shared"] else None,
        moe_shared_expert_gate=traits["shared"],
        moe_aux_loss_coeff=aux_loss_coeff(c),
        moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None,  # dropless, as HF
        moe_token_dispatcher_type="allgather",
        # our router keeps its own statistics and the train step adds HF's loss (layers/moe.py): mcore's
        # aux-loss machinery (CUDA buffers, its own loss definition) stays off
        moe_router_load_balancing_type="none",
    )
    return fields


def sliding_window(c) -> Optional[int]:
    if c.model_type == "qwen2_moe":  # per-layer types, as Qwen2
        return llama.sliding_window(c)
    # Mixtral's and Qwen3-MoE's configs hold the window of every layer, or None
    return getattr(c, "sliding_window", None)


def rules(c, tied: bool, variant: str) -> list:
    traits = MOE_TRAITS[c.model_type]
    pattern = moe_layers(c)
    sparse = tuple(i for i, m in enumerate(pattern) if m)
    dense = tuple(i for i, m in enumerate(pattern) if not m)
    table = []
    for rule in llama.rules(c, tied, variant):
        if rule.mcore.startswith("decoder.layers.{i}.mlp."):  # Llama's dense MLP: on dense layers only
            if dense:
                table.append(Rule(rule.hf, rule.mcore, rule.transform, rule.tp_dim, rule.stage, rule.tp_interleave,
                                  layers=dense))
        else:
            table.append(rule)
    block = "model.layers.{i}." + traits["block"]
    expert = block + "experts.{e}."
    out = "decoder.layers.{i}.mlp."
    gate, up, down = traits["experts"]
    table += [
        Rule(block + traits["gate"], out + "router.weight", layers=sparse),
        Rule((expert + gate, expert + up), out + "experts.local_experts.{e}.linear_fc1.weight", "gate_up", tp_dim=0,
             tp_interleave=2, layers=sparse),
        Rule(expert + down, out + "experts.local_experts.{e}.linear_fc2.weight", tp_dim=1, layers=sparse),
    ]
    if traits["shared"]:
        shared = block + "shared_expert."
        table += [
            Rule((shared + "gate_proj.weight", shared + "up_proj.weight"), out + "shared_experts.linear_fc1.weight",
                 "gate_up", tp_dim=0, tp_interleave=2, layers=sparse),
            Rule(shared + "down_proj.weight", out + "shared_experts.linear_fc2.weight", tp_dim=1, layers=sparse),
            Rule(block + "shared_expert_gate.weight", out + "shared_experts.gate_weight", layers=sparse),
        ]
    return table


def _family(model_type: str) -> ModelFamily:
    traits = MOE_TRAITS[model_type]
    return llama.decoder_family(model_type, traits["classes"], transformer_config=transformer_config, rules=rules,
                                sliding_window=sliding_window, num_experts=num_experts, live_names=traits["live_names"])


MIXTRAL, QWEN2_MOE, QWEN3_MOE = (_family(t) for t in MOE_TRAITS)
