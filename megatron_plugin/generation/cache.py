"""The key/value cache of incremental decoding.

Each core attention layer (`layers.attention.SDPAttention`) holds one `LayerCache` while a generation
runs; mcore's attention computes q, k, v (rotary angles already applied from the tokens' position ids),
the cache stores k and v and attends the new queries to everything cached. All layers share a
`DecodeState`: how many positions are cached, the attention window, and whether the step runs with
static shapes (one new token, its position a tensor), which a CUDA graph can capture.

Cross-attention layers (encoder-decoder models) keep the encoder's keys and values of the first call.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from ..layers.masks import attention_mask_4d, causal_mask


class DecodeState:
    def __init__(self, max_len: int, window: Optional[int] = None, device=None):
        self.max_len = max_len
        self.window = window
        self.offset = 0  # positions cached before the current call (eager steps)
        self.static = False  # one token per row at `position`, shapes fixed (graph capture)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(max_len, device=device)
        self.cross_mask: Optional[torch.Tensor] = None  # [b, 1, 1, encoder len] True = attend, or None


class LayerCache:
    def __init__(self, state: DecodeState, cross: bool = False):
        self.state = state
        self.cross = cross
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def attend(self, q, k, v, scale: float, gqa: bool, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [b, heads, s, d]; k, v [b, groups, s, d] for the new positions -> [b, heads, s, d]."""
        st = self.state
        if self.cross:
            if self.k is None:
                self.k, self.v = k, v
            mask = st.cross_mask
            if bias is not None:
                mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if self.k is None:
            b, g, _, d = k.shape
            self.k = k.new_zeros(b, g, st.max_len, d)
            self.v = v.new_zeros(b, g, st.max_len, d)
        if st.static:
            self.k.index_copy_(2, st.position, k)
            self.v.index_copy_(2, st.position, v)
            keys = st.key_positions
            allowed = keys <= st.position
            if st.window is not None:
                allowed = allowed & (keys > st.position - st.window)
            mask = allowed.view(1, 1, 1, -1)
            if bias is not None:
                mask = bias.masked_fill(~mask, float("-inf"))
            return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        off, s = st.offset, q.shape[2]
        self.k[:, :, off:off + s] = k
        self.v[:, :, off:off + s] = v
        keys, values = self.k[:, :, :off + s], self.v[:, :, :off + s]
        masked = attention_mask_4d(None, s, window=st.window, past=off, device=q.device)
        if bias is not None:  # no is_causal next to a bias: the causal part goes into it
            if masked is None and s > 1:
                masked = causal_mask(s, off + s, q.device)
            attn = bias if masked is None else bias.masked_fill(masked, float("-inf"))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=None if masked is None else ~masked,
            is_causal=masked is None and off == 0 and s > 1, scale=scale, enable_gqa=gqa,
        )

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the rows `index` (beam search), in place so static addresses stay valid."""
        if self.k is not None and not self.cross:
            self.k.copy_(self.k.index_select(0, index))
            self.v.copy_(self.v.index_select(0, index))


def attention_layers(module: torch.nn.Module):
    from ..layers.attention import SDPAttention

    return [m for m in module.modules() if isinstance(m, SDPAttention)]


@contextlib.contextmanager
def kv_cache(modules, state: DecodeState):
    """Give every core attention of `modules` a cache for the duration of the block."""
    caches = []
    layers = [layer for m in modules for layer in attention_layers(m)]
    try:
        for layer in layers:
            layer.kv_cache = LayerCache(state, cross=layer.attention_type == "cross")
            caches.append(layer.kv_cache)
        yield caches
    finally:
        for layer in layers:
            layer.kv_cache = None
