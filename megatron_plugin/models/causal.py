"""HF causal-LM inputs -> the inputs of Megatron's GPTModel, for every decoder-only family (GPT-2, the
Llama family).

One conversion serves the model's `forward`, the train steps (and through them log-probs) and generation,
so padding, packed sequences and default positions mean the same thing wherever a batch enters. It lives
apart from `gpt.py` because the family modules name it and `gpt.py` imports `gpt2.py`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..layers.context_parallel import SHARD, shard_of
from ..layers.masks import attention_mask_4d


class CausalLMInputs(NamedTuple):
    """In GPTModel's argument order, so `module(*inputs)` runs it."""

    tokens: torch.Tensor  # [b, s] long
    position_ids: torch.Tensor  # [b, s] long
    attention_mask: Optional[torch.Tensor]  # [b, 1, s, past + s] bool, True = masked; None = plain causal


def causal_lm_inputs(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, past: int = 0) -> CausalLMInputs:
    """HF's semantics: `attention_mask` [b, past + s] is the padding mask (1 = token, either side);
    absent `position_ids` count on from the `past` cached positions; without a padding mask, position ids
    that restart mark packed sequences, which then attend only within themselves (layers/masks.py).

    The mask is read from the tensors as given: the engine's batch check marks them with what it already
    knows about them, which a dtype cast would drop.

    Under context parallelism `input_ids` is this rank's part of the sequence and carries its
    `SequenceShard` (layers/context_parallel.py): the mask is then [b, 1, 2L, s], the local queries over
    the whole sequence's keys, built from the shard's WHOLE padding mask and position ids (the local
    `attention_mask` is not read); absent position ids are the tokens' global positions, given ones are
    this rank's own (already global)."""
    shard = shard_of(input_ids)
    if shard is not None:
        return _sharded_inputs(input_ids, position_ids, shard)
    b, s = input_ids.shape
    mask = attention_mask_4d(attention_mask, s, position_ids, past=past)
    if position_ids is None:
        position_ids = torch.arange(past, past + s, device=input_ids.device).unsqueeze(0).expand(b, s)
    return CausalLMInputs(input_ids.long(), position_ids.long(), mask)


def _sharded_inputs(input_ids: torch.Tensor, position_ids: Optional[torch.Tensor], shard) -> CausalLMInputs:
    mask = attention_mask_4d(shard.attention_mask, shard.seq_len, shard.position_ids, queries=shard.index)
    if position_ids is None:
        position_ids = shard.index.unsqueeze(0).expand(input_ids.shape)
    tokens = input_ids.long()
    # the train steps read the shard from the Megatron inputs (their losses are over the CP group); a cast drops it
    setattr(tokens, SHARD, shard)
    return CausalLMInputs(tokens, position_ids.long(), mask)
