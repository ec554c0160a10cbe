"""Which HF modules LoRA can target in each family, and where they sit in Megatron's layer: data.

A target is named by its path inside one HF decoder layer ("self_attn.q_proj", "mlp.c_proj"), since peft
matches `target_modules` by leaf name and GPT-2 has two `c_proj`s (the attention's output projection and
the MLP's down projection): the peft model's own wrapped modules (`attn.c_proj` vs `mlp.c_proj`) say
which ones it put adapters on, and each maps to its own Megatron linear.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class LoraTarget:
    """One HF module inside a layer -> the Megatron linear (path inside `decoder.layers.{i}`) its adapter
    sits on. `parallel`: 'column' (B split with the output) or 'row' (A split with the input). `part`: the
    part of a fused linear it writes ('q', 'k', 'v' of linear_qkv; 'gate', 'up' of linear_fc1), None for
    the whole output. `fused_qkv`: the HF module is itself fused [q; k; v] (GPT-2's c_attn): B's rows go
    through the weight's QKV regrouping. `conv1d`: HF stores the weight [in, out] (GPT-2's Conv1D), which a
    merge must respect. `layers`: 'dense' or 'moe' for a target only layers of that kind hold (an MoE
    family's dense MLP on its `mlp_only_layers`, Qwen2-MoE's shared expert on its MoE layers), None for
    every layer."""

    hf: str
    linear: str
    parallel: str
    part: Optional[str] = None
    fused_qkv: bool = False
    conv1d: bool = False
    layers: Optional[str] = None

    @property
    def leaf(self) -> str:
        return self.hf.rsplit(".", 1)[-1]


def _table(*targets: LoraTarget) -> Dict[str, LoraTarget]:
    return {t.hf: t for t in targets}


GPT2_TARGETS = _table(
    LoraTarget("attn.c_attn", "self_attention.linear_qkv", "column", fused_qkv=True, conv1d=True),
    LoraTarget("attn.c_proj", "self_attention.linear_proj", "row", conv1d=True),
    LoraTarget("mlp.c_fc", "mlp.linear_fc1", "column", conv1d=True),
    LoraTarget("mlp.c_proj", "mlp.linear_fc2", "row", conv1d=True),
)

LLAMA_TARGETS = _table(
    LoraTarget("self_attn.q_proj", "self_attention.linear_qkv", "column", part="q"),
    LoraTarget("self_attn.k_proj", "self_attention.linear_qkv", "column", part="k"),
    LoraTarget("self_attn.v_proj", "self_attention.linear_qkv", "column", part="v"),
    LoraTarget("self_attn.o_proj", "self_attention.linear_proj", "row"),
    LoraTarget("mlp.gate_proj", "mlp.linear_fc1", "column", part="gate"),
    LoraTarget("mlp.up_proj", "mlp.linear_fc1", "column", part="up"),
    LoraTarget("mlp.down_proj", "mlp.linear_fc2", "row"),
)

# The MoE families' attention is the Llama family's, and so is the MLP of their dense layers (Qwen's
# `mlp_only_layers`). Their routed experts are one stacked parameter in transformers 5 (no nn.Linear, so peft's
# target_modules never wraps them: `gate_proj` in Qwen2-MoE's MoE layers is the shared expert's only) and
# grouped GEMMs in Megatron: not mapped, nor is the router or Qwen2-MoE's `shared_expert_gate` (refused by
# name). Qwen2-MoE's shared expert is Megatron's `mlp.shared_experts`, its gate/up fused in linear_fc1 as a
# dense MLP's.
ATTENTION_TARGETS = {k: t for k, t in LLAMA_TARGETS.items() if k.startswith("self_attn.")}
DENSE_MLP_TARGETS = {k: replace(t, layers="dense") for k, t in LLAMA_TARGETS.items() if k.startswith("mlp.")}
SHARED_EXPERT_TARGETS = _table(
    LoraTarget("mlp.shared_expert.gate_proj", "mlp.shared_experts.linear_fc1", "column", part="gate", layers="moe"),
    LoraTarget("mlp.shared_expert.up_proj", "mlp.shared_experts.linear_fc1", "column", part="up", layers="moe"),
    LoraTarget("mlp.shared_expert.down_proj", "mlp.shared_experts.linear_fc2", "row", layers="moe"),
)

# family name -> (HF layer prefix in the table's names, targets)
FAMILY_TARGETS: Dict[str, Tuple[str, Dict[str, LoraTarget]]] = {
    "gpt2": ("transformer.h.{i}.", GPT2_TARGETS),
    **{name: ("model.layers.{i}.", LLAMA_TARGETS) for name in ("llama", "mistral", "qwen2", "qwen3")},
    **{name: ("model.layers.{i}.", {**ATTENTION_TARGETS, **DENSE_MLP_TARGETS}) for name in ("mixtral", "qwen3_moe")},
    "qwen2_moe": ("model.layers.{i}.", {**ATTENTION_TARGETS, **DENSE_MLP_TARGETS, **SHARED_EXPERT_TARGETS}),
}
