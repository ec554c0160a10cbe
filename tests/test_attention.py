"""SDPAttention against an explicit softmax reference: causal, padding masks, grouped-query heads."""


import pytest
import torch

from tests.spawn import run_on_ranks


def _reference(q, k, v, masked, scale):
    # q [s, b, n, d], k/v [s, b, g, d]; masked [b, 1, s, s] True = masked, or None for causal
    n, g = q.shape[2], k.shape[2]
    k = k.repeat_interleave(n // g, dim=2)
    v = v.repeat_interleave(n // g, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    if masked is None:
        s = q.shape[0]
        masked = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _attention_worker(heads, groups):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.layers.attention import SDPAttention
    from megatron_plugin.layers.masks import attention_mask_4d

    initialize(MegatronLMPlugin())
    d, s, b = 8, 6, 2
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=d, attention_dropout=0.0, use_cpu_initialization=True)
    attn = SDPAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g)
    k = torch.randn(s, b, groups, d, generator=g)
    v = torch.randn(s, b, groups, d, generator=g)
    pad = torch.ones(b, s, dtype=torch.long)
    pad[1, 4:] = 0
    errors = {}
    for name, mask in (("causal", None), ("padding", attention_mask_4d(pad, s))):
        got = attn(q, k, v, mask)
        errors[name] = (got - _reference(q, k, v, mask, d**-0.5)).abs().max().item()
    return errors


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_attention_matches_reference(heads, groups):
    (errors,) = run_on_ranks(_attention_worker, 1, heads, groups)
    assert errors["causal"] < 1e-5 and errors["padding"] < 1e-5, errors


def test_attention_mask_4d():
    from megatron_plugin.layers.masks import attention_mask_4d

    assert attention_mask_4d(None, 4) is None
    assert attention_mask_4d(torch.ones(2, 4), 4) is None
    T, F = True, False
    mask = attention_mask_4d(torch.tensor([[1, 1, 0]]), 3)[0, 0]
    assert torch.equal(mask, torch.tensor([[F, T, T], [F, F, T], [F, F, T]]))  # no query sees the padding key
    # a left-padding query sees nothing (SDPA returns zeros there, as under HF's mask)
    mask = attention_mask_4d(torch.tensor([[0, 1, 1]]), 3)[0, 0]
    assert torch.equal(mask, torch.tensor([[T, T, T], [T, F, T], [T, F, F]]))
    # packed sequences (position ids restart, no attention mask) attend within themselves
    mask = attention_mask_4d(None, 4, torch.tensor([[0, 1, 0, 1]]))[0, 0]
    assert torch.equal(mask, torch.tensor([[F, T, T, T], [F, F, T, T], [T, T, F, T], [T, T, F, F]]))
    assert attention_mask_4d(None, 4, torch.tensor([[5, 6, 7, 8]])) is None  # an offset is not packing
    # a window of 2: each query sees itself and one key back
    mask = attention_mask_4d(None, 4, window=2)[0, 0]
    assert torch.equal(mask, torch.tensor([[F, T, T, T], [F, F, T, T], [T, F, F, T], [T, T, F, F]]))
    assert attention_mask_4d(None, 4, window=4) is None  # the window covers everything: plain causal
    # one new query after 3 cached keys, the first of them padding
    mask = attention_mask_4d(torch.tensor([[0, 1, 1, 1]]), 1, past=3)[0, 0]
    assert torch.equal(mask, torch.tensor([[T, F, F, F]]))
