"""Rotary position embeddings computed from each token's position id, as HF computes them.

mcore's RotaryEmbedding gives every row of a batch the positions 0..s-1 and moves its frequencies to
`torch.cuda.current_device()` (no CPU). HF models take `position_ids` per row (left padding, packed
sequences, decoding with a cache), so we compute the angles per token. The inverse frequencies come
from transformers' own rope functions, so every scaling type we accept matches HF bit for bit.

The cosines and sines are computed once per forward, here, and handed to every layer ([s, b, 1, 2 * dim]:
cos, then sin with its first half negated). mcore's unfused rope takes the angles and computes cos and
sin inside each layer, which a compiled layer recomputes for every element of every head (at Llama-3.2-1B
the forward rope kernel took 3.9 ms a step; on the tables, 1.3 ms). mcore's attention applies the tables
through its fused-rope slot (`apply_rope_fusion`, filled with TE's kernel when TE is installed), which
`patches.py` fills with `apply_cos_sin`: the same arithmetic as mcore's unfused path, on cos and sin already
computed.

Under context parallelism a rank's position ids are its tokens' global positions (models/causal.py), so
the tables need no per-rank slicing: mcore's `get_pos_emb_on_this_cp_rank` (which calls `.cuda()`) is
never reached.
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
    """position_ids [b, s] -> cos and sin of the rotary angles, [s, b, 1, 2 * head_dim] (fp32), for
    mcore's attention through `apply_cos_sin`: [cos, cos, -sin, sin], each head_dim / 2 wide."""

    def __init__(self, hf_config, device=None):
        super().__init__()
        # a plain attribute, not a buffer: Float16Module's .bfloat16() must not round the frequencies
        self.inv_freq = inverse_frequencies(hf_config).to(device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.t()[..., None].float() * self.inv_freq  # [s, b, dim/2]
        cos, sin = freqs.cos(), freqs.sin()
        # the sine's first half negated: rotating half the head is then a roll (see apply_cos_sin)
        return torch.cat((cos, cos, -sin, sin), dim=-1)[:, :, None, :]


def apply_cos_sin(t: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """t [s, b, heads, dim] rotated by `RotaryEmbedding`'s [s, b, 1, 2 * dim]: what mcore's unfused
    `_apply_rotary_pos_emb_bshd` computes from the angles (non-interleaved, mscale 1), bit for bit.

    mcore rotates half the head as cat(-x2, x1) * sin; here that is roll(t) * [-sin, sin]: the same
    products, but each element reads one other element instead of two masked halves, which keeps the
    compiled kernels (forward and backward) to plain loads."""
    d = t.shape[-1]
    cos, signed_sin = cos_sin[..., :d].to(t.dtype), cos_sin[..., d:].to(t.dtype)
    return t * cos + t.roll(d // 2, dims=-1) * signed_sin


def fused_slot(previous):
    """What goes into mcore's fused-rope slot (read when `apply_rope_fusion=True`; `patches.py` puts it
    there): `apply_cos_sin` for our tables (twice the head size); angles go to what was there (TE's kernel)."""
    if getattr(previous, "applies_cos_sin", False):
        return previous

    def fused_apply_rotary_pos_emb(t, freqs, interleaved: bool = False):
        if freqs.shape[-1] == 2 * t.shape[-1] and not interleaved:
            return apply_cos_sin(t, freqs)
        if previous is None:
            raise RuntimeError("apply_rope_fusion: rotary angles need Transformer Engine's fused rope; this "
                               "slot only applies megatron_plugin's [cos | sin] tables")
        return previous(t, freqs, interleaved=interleaved)

    fused_apply_rotary_pos_emb.applies_cos_sin = True
    return fused_apply_rotary_pos_emb
