"""What the plugin needs to know about one HF model family: data (mapping tables, class names) plus the
few functions that differ (how to build the Megatron module, how HF inputs reach it).

A family's HF classes come in *variants*: "lm" (the model with its LM head: GPT2LMHeadModel,
LlamaForCausalLM, T5ForConditionalGeneration), "base" (GPT2Model, LlamaModel, BertModel, T5Model), and
family-specific ones (BERT's "mlm" and "pretraining"). Mapping tables name tensors as in the richest
variant; a base model's names lack `base_prefix`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .mapping import Dims, Rule, StagePlan, expand


def lm_or_base(hf_model) -> str:
    return "lm" if hasattr(hf_model, "lm_head") else "base"


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: Tuple[str, ...]  # HF `config.model_type` values
    # HF config -> TransformerConfig fields that describe the architecture
    transformer_config: Callable[[Any], Dict[str, Any]]
    # HF config -> extra constructor arguments of the Megatron model (position embeddings, ...)
    model_kwargs: Callable[[Any], Dict[str, Any]]
    # (HF config, tied embeddings?, variant) -> mapping table
    rules: Callable[[Any, bool, str], List[Rule]]
    base_prefix: str  # prefix of the tensors the base models (`base_variants`) name without it
    classes: Dict[str, str]  # variant -> transformers class name (for writing HF checkpoints back)
    max_positions: Callable[[Any], int]
    # builds this rank's Megatron module: (family, hf_config, TransformerConfig, plugin, plan, variant,
    # backend, vp_stage) -> torch.nn.Module; None means the GPT builder (models/gpt.py)
    build: Optional[Callable[..., Any]] = None
    # (MegatronModel, **HF inputs) -> HF-like outputs of one stage; None means the causal-LM forward
    forward: Optional[Callable[..., Any]] = None
    # (**HF inputs) -> the Megatron module's inputs, a NamedTuple: the one conversion the forward, the train
    # steps and generation share (models/causal.py, bert.py's bert_inputs, t5.py's t5_inputs). Every
    # family sets it; it has a default only because the fields before it do
    inputs: Optional[Callable[..., Any]] = None
    # HF model -> variant
    variant_of: Callable[[Any], str] = lm_or_base
    # the train step `prepare` picks (a name in train_steps) and the variants it can train
    train_step: str = "GPTTrainStep"
    trainable_variants: Tuple[str, ...] = ("lm",)
    tied_embeddings: Callable[[Any], bool] = lambda c: bool(getattr(c, "tie_word_embeddings", True))
    # HF state-dict names that repeat another tensor (tied weights): alias -> the name the table reads
    tied_aliases: Callable[[Any, str], Dict[str, str]] = field(default=lambda c, v: {})
    # the longest sequence the model can take (learned position embeddings), or None
    position_limit: Callable[[Any], Optional[int]] = lambda c: None
    # rotary positions computed per token from position_ids (layers/rope.py)
    rotary: bool = False
    # the attention window (keys older than it are masked) of every layer, or None
    sliding_window: Callable[[Any], Optional[int]] = lambda c: None
    base_variants: Tuple[str, ...] = ("base",)
    # why pipeline parallelism is refused for this family, or None when it is supported
    pipeline_note: Optional[str] = None
    # why sequence parallelism is refused for this family, or None when it is supported
    sequence_parallel_note: Optional[str] = None
    # routed experts per MoE layer (0: a dense model); the mapping's `{e}` rules expand over them
    num_experts: Callable[[Any], int] = lambda c: 0
    # (regex, replacement) from the mapping table's HF names (checkpoint names, as `save_pretrained` writes
    # them and the Hub holds them) to the live transformers model's parameter names, where they differ
    # (transformers 5 stacks an MoE layer's experts into one tensor): parameter groups and requires_grad
    # are looked up by the live names
    live_names: Tuple[Tuple[str, str], ...] = ()

    def table(self, hf_config, variant: str) -> List[Rule]:
        """The mapping table for this config (tied or not) and variant."""
        return self.rules(hf_config, self.tied_embeddings(hf_config), variant)

    def prefix(self, variant: str) -> str:
        """What the variant's HF names lack compared with the table's (the base model's missing prefix)."""
        return self.base_prefix if variant in self.base_variants else ""

    def variant_of_class(self, class_name: Optional[str]) -> str:
        """The variant of a transformers class name (e.g. from config.architectures); default 'lm'."""
        for variant, name in self.classes.items():
            if name == class_name:
                return variant
        return "lm" if "lm" in self.classes else next(iter(self.classes))

    def num_layers(self, hf_config) -> int:
        return self.transformer_config(hf_config)["num_layers"]

    def plan_with_experts(self, hf_config, plan: StagePlan, ep_size: int = 1, ep_rank: int = 0) -> StagePlan:
        """`plan` with the routed experts expert-parallel rank `ep_rank` of `ep_size` holds, for an MoE model;
        any other model's plan as it is."""
        experts = self.num_experts(hf_config)
        return plan.with_experts(experts, ep_size, ep_rank) if experts else plan

    def whole_plan(self, hf_config) -> StagePlan:
        """One stage holding every layer and every expert."""
        return self.plan_with_experts(hf_config, StagePlan.single(self.num_layers(hf_config)))

    def live_name(self, name: str) -> str:
        """The live HF model's parameter that holds the table's (checkpoint) tensor `name`."""
        for pattern, repl in self.live_names:
            name = re.sub(pattern, repl, name)
        return name

    def mapped_hf_names(self, hf_config, variant: str) -> set:
        """Every HF tensor name the table reads, over the whole model."""
        whole = self.whole_plan(hf_config)
        return {n for _, names, _ in expand(self.table(hf_config, variant), whole) for n in names}

    def dims(self, hf_config, padded_vocab: int) -> Dims:
        tc = self.transformer_config(hf_config)
        heads = tc["num_attention_heads"]
        return Dims(
            hidden=tc["hidden_size"],
            heads=heads,
            groups=tc.get("num_query_groups") or heads,
            head_dim=tc.get("kv_channels") or tc["hidden_size"] // heads,
            vocab=hf_config.vocab_size,
            padded_vocab=padded_vocab,
        )
