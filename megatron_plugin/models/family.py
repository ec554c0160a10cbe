"""What the plugin needs to know about one HF model family, as data plus two small functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .mapping import Dims, Rule, StagePlan, expand


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: Tuple[str, ...]  # HF `config.model_type` values
    # HF config -> TransformerConfig fields that describe the architecture
    transformer_config: Callable[[Any], Dict[str, Any]]
    # HF config -> extra GPTModel constructor arguments (position embeddings, rope base, ...)
    model_kwargs: Callable[[Any], Dict[str, Any]]
    # (HF config, tied embeddings?, has LM head?) -> mapping table, names as in the LM-head model
    rules: Callable[[Any, bool, bool], List[Rule]]
    base_prefix: str  # prefix of the base model's tensors inside the LM-head model
    lm_head_class: str  # transformers class names, for writing HF checkpoints back
    base_class: str
    max_positions: Callable[[Any], int]
    tied_embeddings: Callable[[Any], bool] = lambda c: bool(getattr(c, "tie_word_embeddings", True))
    # the longest sequence the model can take (learned position embeddings), or None
    position_limit: Callable[[Any], Optional[int]] = lambda c: None
    # rotary positions computed per token from position_ids (layers/rope.py)
    rotary: bool = False
    # the attention window (keys older than it are masked) of every layer, or None
    sliding_window: Callable[[Any], Optional[int]] = lambda c: None

    def table(self, hf_config, lm_head: bool) -> List[Rule]:
        """The mapping table for this config (tied or not) and model class (with or without LM head)."""
        return self.rules(hf_config, self.tied_embeddings(hf_config), lm_head)

    def num_layers(self, hf_config) -> int:
        return self.transformer_config(hf_config)["num_layers"]

    def mapped_hf_names(self, hf_config, lm_head: bool) -> set:
        """Every HF tensor name the table reads, over the whole model."""
        whole = StagePlan.single(self.num_layers(hf_config))
        return {n for _, names, _ in expand(self.table(hf_config, lm_head), whole) for n in names}

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
