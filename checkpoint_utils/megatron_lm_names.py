"""How Megatron-LM checkpoints name a Megatron-Core tensor, given its name in one rank's module.

- torch_dist: a module's `sharded_state_dict()` stacks the layers of a block under one key with a leading
  layer axis (`decoder.layers.0.mlp.linear_fc2.weight` is row 0 of `decoder.layers.mlp.linear_fc2.weight`;
  layers that differ, as an MoE model's, keep a key each), and routed experts under one key with an expert axis,
  and megatron-core's layer specs file the pre-attention and pre-MLP norms under Transformer Engine's
  names (`sharded_state_dict_keys_map`), so that checkpoints of the local and the TE implementation agree.
- legacy torch: each rank's `state_dict()`, layers numbered within the stage; the norms under the local
  names, or TE's when Megatron-LM ran with Transformer Engine (fused norm + linear).
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

# megatron-core's local GPT, BERT and T5 layer specs (gpt_layer_specs.get_gpt_layer_local_spec, ...)
TE_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_LAYER = re.compile(r"^(?P<stack>(?:.+\.)?layers)\.(?P<i>\d+)\.(?P<rest>.+)$")


def _te(rest: str) -> str:
    for local, te in TE_NORM_KEYS.items():
        if rest.startswith(local):
            return te + rest[len(local):]
    return rest


def split_layer(name: str) -> Optional[Tuple[str, int, str]]:
    """(block prefix, layer index, name inside the layer), or None for a tensor outside the layers."""
    m = _LAYER.match(name)
    return (m.group("stack"), int(m.group("i")), m.group("rest")) if m else None


_LOCAL_EXPERT = re.compile(r"^(?P<head>(?:.+\.)?experts)\.local_experts\.(?P<e>\d+)\.(?P<rest>.+)$")


def sharded_keys(name: str) -> List[Tuple[str, Tuple[int, ...], Tuple[str, ...]]]:
    """Where a torch_dist checkpoint may file `name` (a whole-model module's state-dict name), Megatron-LM's
    names first: [(key, index of `name`'s tensor along the key's leading axes, what those axes are: "layer" /
    "expert")]. A block of alike layers stacks them under one key with a leading layer axis
    (`decoder.layers.mlp.linear_fc2.weight`); a block whose layers differ (an MoE model's `moe_layer_freq`
    list, megatron-core's non-homogeneous layers) keeps each layer's own key (`decoder.layers.3.mlp...`).
    megatron-core's SequentialMLP files its local expert j of expert-parallel rank r under
    `...mlp.experts.experts.<weight>` with a leading axis of all the layer's experts (global index)."""
    parts = split_layer(name)
    if parts is None:
        return [(name, (), ())]
    stack, i, rest = parts
    m = _LOCAL_EXPERT.match(rest)
    if m:  # `name` is of a whole model (one expert-parallel rank): its local index is the global one
        rest = f"{m.group('head')}.experts.{m.group('rest')}"
        e = int(m.group("e"))
        return [(f"{stack}.{rest}", (i, e), ("layer", "expert")), (f"{stack}.{i}.{rest}", (e,), ("expert",))]
    out = [(f"{stack}.{r}", (i,), ("layer",)) for r in dict.fromkeys([_te(rest), rest])]
    return out + [(f"{stack}.{i}.{r}", (), ()) for r in dict.fromkeys([_te(rest), rest])]


def state_dict_names(name: str) -> List[str]:
    """The names one rank's legacy state dict may hold `name` under: the local spec's, then TE's."""
    parts = split_layer(name)
    if parts is None:
        return [name]
    stack, i, rest = parts
    return list(dict.fromkeys([name, f"{stack}.{i}.{_te(rest)}"]))


def layer_indices(names, stack: str) -> set:
    """The layer indices of `stack` (e.g. 'decoder.layers') among state-dict names."""
    out = set()
    for n in names:
        parts = split_layer(n)
        if parts is not None and parts[0] == stack:
            out.add(parts[1])
    return out
