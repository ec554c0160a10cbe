"""Rotary position embeddings computed from each token's position id, as HF computes them.

mcore's RotaryEmbedding gives every row of a batch the positions 0..s-1 and moves its frequencies to
`torch.cuda.current_device()` (no CPU). HF models take `position_ids` per row (left padding, packed
sequences, decoding with a cache), so we compute the angles per token: [s, b, 1, dim], which mcore's
attention applies as it applies its own (`apply_rotary_pos_emb`, unfused). The inverse frequencies come
from transformers' own rope functions, so every scaling type we accept matches HF bit for bit.
"""

from __future__ import annotations

import torch

from ..errors import MegatronPluginConfigError

# rope types whose angles depend on the position only (no per-length rescaling, no attention factor)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    """{'rope_type', 'rope_theta', ...} from either transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    merged.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return merged


def check_rope(hf_config) -> dict:
    params = rope_parameters(hf_config)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise MegatronPluginConfigError(
            "rope_scaling", params,
            f"rope type {kind!r} is not mapped (supported: {SUPPORTED_ROPE_TYPES}); train with one of those "
            "or convert the model first",
        )
    if getattr(hf_config, "partial_rotary_factor", 1.0) != 1.0:
        raise MegatronPluginConfigError(
            "partial_rotary_factor", hf_config.partial_rotary_factor, "only full rotary embeddings are mapped (1.0)"
        )
    return params


def inverse_frequencies(hf_config) -> torch.Tensor:
    """HF's inverse frequencies (fp32, [head_dim / 2]) for this config."""
    params = check_rope(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if params["rope_type"] == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, None)
    if scaling != 1.0:
        raise MegatronPluginConfigError("rope_scaling", params, "rope types with an attention factor are not mapped")
    return inv_freq.float()


class RotaryEmbedding(torch.nn.Module):
    """position_ids [b, s] -> rotary angles [s, b, 1, head_dim] (fp32), for mcore's attention."""

    def __init__(self, hf_config, device=None):
        super().__init__()
        # a plain attribute, not a buffer: Float16Module's .bfloat16() must not round the frequencies
        self.inv_freq = inverse_frequencies(hf_config).to(device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.t()[..., None].float() * self.inv_freq  # [s, b, dim/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
