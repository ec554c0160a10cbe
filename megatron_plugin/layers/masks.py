"""Attention masks from HF inputs, in Megatron's convention: bool [b, 1, queries, keys], True = masked.

`None` means "plain causal, nothing else", which lets SDPA take its causal (flash) kernels.
"""

from __future__ import annotations

from typing import Optional

import torch


def causal_mask(queries: int, keys: int, device=None) -> torch.Tensor:
    """[queries, keys], True = masked: the queries are the last `queries` of `keys` positions."""
    return ~torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


# What the engine's batch check already read about a micro-batch's mask or position ids (a Python bool
# set as this attribute on that tensor): deciding it here again would read the device once per
# micro-batch, and each read stalls the GPU until the work queued before it is done.
KNOWN = "_megatron_plugin_known"


def rows_without_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.bool().all(-1)


def no_padding(attention_mask: torch.Tensor) -> bool:
    """An HF padding mask without a padded position (absent and all-ones masks mean the same)."""
    known = getattr(attention_mask, KNOWN, None)
    return bool(rows_without_padding(attention_mask).all()) if known is None else known


def padding_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """HF padding mask [b, s] (1 = token) -> Megatron's [b, 1, 1, s] (True = masked), or None when nothing
    is padded (which keeps the fused attention kernels)."""
    if attention_mask is None or no_padding(attention_mask):
        return None
    return ~attention_mask.bool()[:, None, None, :]


def _sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    return starts.cumsum(-1)


def rows_not_packed(position_ids: torch.Tensor) -> torch.Tensor:
    return _sequence_ids(position_ids)[:, -1] == 0


def packed_sequence_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """HF's rule (transformers.masking_utils.find_packed_sequence_indices): where position ids do not
    step by one a new sequence starts. [b, s] -> sequence index per token, or None if nothing is packed."""
    not_packed = getattr(position_ids, KNOWN, None)
    if not_packed:
        return None
    ids = _sequence_ids(position_ids)
    return None if not_packed is None and bool((ids[:, -1] == 0).all()) else ids


def attention_mask_4d(attention_mask: Optional[torch.Tensor], seq_len: int, position_ids: Optional[torch.Tensor] = None,
                      window: Optional[int] = None, past: int = 0, device=None,
                      queries: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Causal mask for `seq_len` new queries after `past` cached keys.

    attention_mask: HF padding mask [b, past + seq_len] (1 = token), or None.
    position_ids: [b, seq_len]; as in HF, read only when there is no attention_mask and no cache:
        restarting positions mark packed sequences, which then attend only within themselves.
    window: keys `window` or more tokens behind a query are masked (Mistral's sliding window).
    queries: under context parallelism, the global positions ([q] long, in the rank's local order) of the
        query rows, with `seq_len`, `attention_mask` and `position_ids` those of the WHOLE sequence (the
        keys): the mask is then [b, 1, q, seq_len] (None still means plain causal, by global positions).
    A query row that sees no key at all (a left-padding position) stays fully masked: torch's SDPA
    then returns zeros for it, as it does under HF's own SDPA mask, so even the loss at the last padding
    position (it predicts the first token) equals HF's.
    """
    keys = past + seq_len
    packed = None
    if attention_mask is None and position_ids is not None and past == 0:
        packed = packed_sequence_ids(position_ids)
    padded = attention_mask is not None and not no_padding(attention_mask)
    windowed = window is not None and keys > window
    if not (padded or packed is not None or windowed or (past and seq_len > 1)):
        return None
    for t in (attention_mask, position_ids):
        if t is not None:
            device = t.device
    q = (torch.arange(past, keys, device=device) if queries is None else queries)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    allowed = k <= q
    if windowed:
        allowed &= q - k < window
    allowed = allowed[None]
    if padded:
        allowed = allowed & attention_mask.bool()[:, None, :]
    if packed is not None:
        packed_q = packed if queries is None else packed.index_select(1, queries)
        allowed = allowed & (packed_q[:, :, None] == packed[:, None, :])
    return ~allowed[:, None]


def add_window(mask: Optional[torch.Tensor], seq_len: int, window: Optional[int], device=None,
               queries: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """`mask` (or plain causal when None) with keys `window` or more tokens behind each query masked too.
    Under context parallelism `queries` are the query rows' global positions and `seq_len` the whole
    sequence's length (the keys)."""
    keys = seq_len if mask is None or queries is not None else mask.shape[-1]
    if window is None or keys <= window:
        return mask
    device = device if mask is None else mask.device
    q = (torch.arange(keys - seq_len, keys, device=device) if queries is None else queries.to(device))[:, None]
    k = torch.arange(keys, device=device)[None, :]
    outside = (q - k >= window) | (k > q)
    return outside[None, None] if mask is None else mask | outside
