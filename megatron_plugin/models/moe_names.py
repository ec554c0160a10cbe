"""A live transformers-5 model's tensors under the names its checkpoints use.

transformers 5 loads an MoE checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, ...) into one
stacked parameter per layer (`experts.gate_up_proj` [E, 2F, H]) and writes them back apart on
`save_pretrained`. The mapping tables name the checkpoint's tensors, which is also what each rank reads of
a big model's files; a live model's state dict reaches them through transformers' own reverse conversion,
so there is one definition of the layout, transformers'.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def checkpoint_names(hf_model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`tensors` (named as `hf_model.state_dict()` names them: weights, or their gradients) under the
    checkpoint names. Models without a conversion come back as they are."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(hf_model, dict(tensors)))


def checkpoint_state_dict(hf_model) -> Dict[str, torch.Tensor]:
    """The model's state dict, named as its checkpoints name it."""
    return checkpoint_names(hf_model, hf_model.state_dict())


def checkpoint_grads(hf_model) -> Dict[str, Optional[torch.Tensor]]:
    """The gradients of the model's parameters, named as its checkpoints name the weights (parameters
    without a gradient are left out)."""
    grads = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    return checkpoint_names(hf_model, grads)


def live_state_dict(hf_config, tensors: Dict[str, torch.Tensor], variant: str = "lm") -> Dict[str, torch.Tensor]:
    """The inverse of `checkpoint_names` for the mapped MoE families: checkpoint-named tensors (e.g. from
    `MegatronModel.hf_state_dict` or `iter_hf_weights`) as a live transformers-5 model's state dict names
    them, each layer's experts stacked ([E, 2F, H] gate then up, [E, H, F] down), ready for its
    `load_state_dict`. Tensors the family does not rename pass through."""
    from . import get_family

    family = get_family(hf_config)
    experts = family.num_experts(hf_config)
    if not experts:
        return dict(tensors)
    prefix = family.prefix(variant)
    out, used = {}, set()
    for rule in family.table(hf_config, variant):
        if not rule.per_expert:
            continue
        for i in range(family.num_layers(hf_config)):
            if rule.layers is not None and i not in rule.layers:
                continue
            names = [[n.format(i=i, e=e)[len(prefix):] for n in rule.hf] for e in range(experts)]
            if names[0][0] not in tensors:  # another pipeline stage's layer
                continue
            out[family.live_name(prefix + names[0][0])[len(prefix):]] = torch.stack(
                [torch.cat([tensors[n] for n in per], 0) for per in names])
            used.update(n for per in names for n in per)
    out.update({family.live_name(prefix + k)[len(prefix):]: v for k, v in tensors.items() if k not in used})
    return out
