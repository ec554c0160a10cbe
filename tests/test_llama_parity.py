"""HF Llama, Mistral, Qwen2 and Qwen3 vs their Megatron-Core twins under TP = 1, 2, 4 on CPU: logits with
right padding, left padding + position_ids and packed sequences; gradients; round trip bit for bit."""

import pytest
import torch

from tests.models import LLAMA_CONFIGS, check_decoder_parity, decoder_parity, padded_ids, tiny_llama
from tests.spawn import run_on_ranks

SEQ = 12


def _cases(vocab):
    """(name, input_ids, attention_mask, position_ids, valid positions) as HF users build them."""
    ids, right, left = padded_ids(vocab, 3, {1: 4, 2: 7}, SEQ)
    left_pos = (left.cumsum(-1) - 1).clamp_min(0)  # what HF generate passes for left-padded prompts
    packed_pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12)), list(range(3)) * 4])
    gapped_pos = torch.arange(SEQ).expand(3, SEQ) * torch.tensor([[1], [2], [3]])  # with a mask: not packing
    full = torch.ones(3, SEQ, dtype=torch.bool)
    return [
        ("none", ids, None, None, full),
        ("right", ids, right, None, right.bool()),
        ("left", ids, left, left_pos, left.bool()),
        ("packed", ids, None, packed_pos, full),
        ("gapped", ids, full.long(), gapped_pos, full),
    ]


def _parity_worker():
    # gradients on the left-padded batch with position_ids; use_cache=False, as in training: only then does
    # HF read packing from position ids
    return decoder_parity(tiny_llama, LLAMA_CONFIGS, _cases, "left", use_cache=False)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_llama_family_parity_under_tensor_parallel(world_size):
    check_decoder_parity(run_on_ranks(_parity_worker, world_size), LLAMA_CONFIGS,
                         ("none", "right", "left", "packed", "gapped"), world_size)


def test_the_cases_exercise_what_they_claim():
    """Position ids, packing and Mistral's window each change HF's output, so the parity above would
    catch a model that ignored them. (Left padding's position ids shift every position of a row alike,
    which rotary attention does not see: the gapped case is the one that tests position ids.)"""
    hf = tiny_llama("mistral")
    cases = {c[0]: c for c in _cases(hf.config.vocab_size)}
    with torch.no_grad():
        plain = hf(cases["none"][1]).logits
        _, ids, mask, pos, _ = cases["gapped"]
        assert (hf(ids, attention_mask=mask, position_ids=pos).logits - plain).abs().max() > 1e-3
        _, ids, _, pos, _ = cases["packed"]
        assert (hf(ids, position_ids=pos, use_cache=False).logits - plain).abs().max() > 1e-3
        wide = tiny_llama("mistral", sliding_window=64)
        assert (wide(cases["none"][1]).logits - plain).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["llama", "llama_tied_linear", "qwen3"])
def test_rope_tables_apply_what_mcore_applies_from_angles(name):
    """The cos/sin tables our layers get (layers/rope.py) rotate q and k exactly as mcore's unfused rope
    does from the angles, through mcore's own `apply_rotary_pos_emb` with its fused-rope slot filled."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.layers import rope
    from tests.models import llama_config

    cfg = llama_config(name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    emb = rope.RotaryEmbedding(cfg)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 7, 8, 9, 31]])  # a left-padded row too
    t = torch.randn(6, 2, 3, head_dim, dtype=torch.bfloat16)
    freqs = positions.t()[..., None].float() * emb.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    expected = rope_utils._apply_rotary_pos_emb_bshd(t, angles, rotary_interleaved=False)
    from megatron_plugin import patches

    patches.install("rope_tables")
    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, apply_rope_fusion=True)
        no_cp = object()  # read only for packed (thd) sequences
        got = rope_utils.apply_rotary_pos_emb(t, emb(positions), config=config, cp_group=no_cp)
        assert torch.equal(got, expected)
        with pytest.raises(RuntimeError, match="cos \\| sin"):  # angles reaching the slot without TE say so
            rope_utils.apply_rotary_pos_emb(t, angles, config=config, cp_group=no_cp)
    finally:
        patches.undo("rope_tables")
