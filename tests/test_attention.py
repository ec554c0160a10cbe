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


class _CPUTracker:
    """megatron-core's CUDA RNG tracker, on the CPU generator: fork() draws from its own state and restores the
    default one after, with the same kind of RNG-state swaps (a graph break where torch.compile traces them)."""

    def __init__(self, seed):
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.forks = 0

    def is_initialized(self):
        return True

    def fork(self):
        import contextlib

        @contextlib.contextmanager
        def forked():
            self.forks += 1
            outside = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                yield
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(outside)
        return forked()


def _tracker_fork_worker():
    from types import SimpleNamespace
    from unittest import mock

    import torch._dynamo
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.layers import attention, rng_fork

    initialize(MegatronLMPlugin())
    d, s, b, heads = 8, 6, 2, 4
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, kv_channels=d,
                            attention_dropout=0.5, use_cpu_initialization=True)
    out = {}
    # which runs fork: dropout at TP > 1 without sequence parallelism, on CUDA
    tracker = _CPUTracker(0)
    fake_tp = SimpleNamespace(get_cuda_rng_tracker=lambda: tracker)

    def needs(dropout, tp, sp, cuda=True):
        fake_ps = SimpleNamespace(model_parallel_is_initialized=lambda: True,
                                  get_tensor_model_parallel_world_size=lambda: tp)
        with mock.patch.object(rng_fork, "tensor_parallel", fake_tp), mock.patch.object(rng_fork, "parallel_state",
                                                                                         fake_ps):
            return rng_fork.tracker_fork_needed(dropout, cuda, sp)
    out["needs"] = [needs(0.1, 2, False), needs(0.1, 1, False), needs(0.1, 2, True), needs(0.0, 2, False),
                    needs(0.1, 2, False, cuda=False)]

    # the fork under torch.compile: one graph break at the attention, the same numbers as eager, no recompiles
    def run(compiled):
        tracker = _CPUTracker(1)
        fake_tp = SimpleNamespace(get_cuda_rng_tracker=lambda: tracker)
        torch.manual_seed(0)
        attn = attention.SDPAttention(cfg, 1, AttnMaskType.causal, "self").train()
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(s, b, heads, d, generator=g, requires_grad=True) for _ in range(3))

        def step(q, k, v):
            return (attn(q * 2, k, v, None) + 1).sum()
        fn = torch.compile(step, backend="aot_eager") if compiled else step
        torch._dynamo.reset()
        torch.manual_seed(3)
        default_before = torch.get_rng_state()
        with mock.patch.object(rng_fork, "tensor_parallel", fake_tp), \
                mock.patch.object(rng_fork, "tracker_fork_needed", lambda p, on_cuda, sp: p > 0):
            losses = [fn(q, k, v)]
            first = counters["stats"]["unique_graphs"]
            losses += [fn(q, k, v) for _ in range(2)]
            losses[-1].backward()
        return {"losses": torch.stack(losses).detach(), "grads": [t.grad for t in (q, k, v)], "forks": tracker.forks,
                "default_untouched": torch.equal(torch.get_rng_state(), default_before),
                "graphs": (first, counters["stats"]["unique_graphs"])}

    from torch._dynamo.utils import counters

    out["eager"] = run(False)
    counters.clear()
    out["compiled"] = run(True)
    out["break_reasons"] = list(counters["graph_break"])
    return out


def test_attention_dropout_forks_the_tracker_outside_torch_compile():
    (r,) = run_on_ranks(_tracker_fork_worker, 1)
    assert r["needs"] == [True, False, False, False, False]
    eager, compiled = r["eager"], r["compiled"]
    # dropout drew from the tracker in both (the default stream untouched), the same masks step by step
    assert eager["forks"] == compiled["forks"] == 3 and eager["default_untouched"] and compiled["default_untouched"]
    assert len(set(eager["losses"].tolist())) == 3  # each step its own mask
    assert torch.equal(compiled["losses"], eager["losses"])
    for a, b in zip(compiled["grads"], eager["grads"]):
        assert torch.equal(a, b)
    # the only graph break is the call into the fork (before: dynamo traced the RNG swaps themselves), and the
    # graphs of the first step serve the next ones
    assert len(r["break_reasons"]) == 1 and "torch.compiler.disable" in r["break_reasons"][0], r["break_reasons"]
    first, last = compiled["graphs"]
    assert first == last > 0
