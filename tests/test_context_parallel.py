"""Context parallelism, model side: the load-balanced split of a sequence over CP ranks
(layers/context_parallel.py), the masks of local queries over the whole sequence's keys (layers/masks.py)
and exact attention over K/V gathered over the CP group (layers/attention.py), against HF on CPU (gloo):
CP=2 and CP=2 x TP=2 (+SP), GPT-2 and the Llama family (GQA, Mistral's sliding window shorter than the
sequence), with right padding, left padding + position_ids and packed sequences. Forward logits within
1e-4 of HF's, parameter gradients within 1e-4 relative."""

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend

from tests.spawn import run_on_ranks

SEQ = 16  # a multiple of 2 * CP; longer than Mistral's window (5) in tests/models.py


# -- one process: the layout, bit for bit ------------------------------------------------------------

def test_cp_index_is_megatron_cores_load_balanced_split():
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_plugin.layers.context_parallel import cp_index

    for cp in (1, 2, 4):
        seen = []
        for r in range(cp):
            index = cp_index(SEQ, cp, r)
            theirs = _mcore_split(get_batch_on_this_cp_rank, torch.arange(SEQ)[None], cp, r)[0]
            assert torch.equal(index, theirs), (cp, r)
            seen.append(index)
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(SEQ))  # every position once
    assert cp_index(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_index(8, 2, 1).tolist() == [2, 3, 4, 5]


def _mcore_split(fn, t, cp, rank):
    # megatron-core reads CP size and rank from parallel_state; hand them in without process groups
    from unittest import mock

    from megatron.core import parallel_state

    with mock.patch.object(parallel_state, "get_context_parallel_world_size", return_value=cp), \
            mock.patch.object(parallel_state, "get_context_parallel_rank", return_value=rank):
        return fn({"tokens": t.clone()})["tokens"]


def test_shard_sequence_cuts_every_sequence_tensor_and_keeps_the_whole_masks():
    from megatron_plugin.layers.context_parallel import SequenceShard, cp_index, shard_of, shard_sequence

    b = 3
    ids = torch.arange(b * SEQ).view(b, SEQ)
    mask = (torch.rand(b, SEQ) > 0.2).long()
    pos = torch.arange(SEQ).repeat(b, 1) * 2
    batch = {"input_ids": ids, "labels": ids + 1, "attention_mask": mask, "position_ids": pos,
             "loss_mask": torch.rand(b, SEQ), "rewards": torch.rand(b), "extra": torch.rand(b, 5), "name": "x"}
    assert shard_sequence(batch, 1, 0) is batch and shard_of(batch["input_ids"]) is None
    for r in range(2):
        out = shard_sequence(batch, 2, r)
        index = cp_index(SEQ, 2, r)
        for k in ("input_ids", "labels", "attention_mask", "position_ids", "loss_mask"):
            assert torch.equal(out[k], batch[k][:, index]), k
        for k in ("rewards", "extra", "name"):
            assert out[k] is batch[k], k
        shard = shard_of(out["input_ids"])
        assert isinstance(shard, SequenceShard) and (shard.cp_size, shard.cp_rank, shard.seq_len) == (2, r, SEQ)
        assert torch.equal(shard.index, index)
        assert shard.attention_mask is mask and shard.position_ids is pos
        assert shard_of(out["labels"]) is None


def test_bad_lengths_and_sizes_are_refused_with_the_fix():
    from megatron_plugin.errors import MegatronPluginConfigError
    from megatron_plugin.layers.context_parallel import check_context_parallel, shard_sequence

    with pytest.raises(MegatronPluginConfigError, match="pad_to_multiple_of=4") as e:
        shard_sequence({"input_ids": torch.zeros(2, 10, dtype=torch.long)}, 2, 0)
    assert e.value.setting == "context_parallel_size" and "10" in e.value.fix
    with pytest.raises(MegatronPluginConfigError, match="input_ids"):
        shard_sequence({"labels": torch.zeros(2, 8, dtype=torch.long)}, 2, 0)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(MegatronPluginConfigError) as e:
            check_context_parallel(bad)
        assert e.value.setting == "context_parallel_size"
    check_context_parallel(1), check_context_parallel(4)


@pytest.mark.parametrize("cp", [2, 4])
def test_gather_order_undoes_the_split_bit_for_bit(cp):
    """What the all-gather returns (ranks' local parts, rank after rank) put in global order is the whole
    sequence; the inverse order takes a whole-sequence gradient back to rank-major parts."""
    from megatron_plugin.layers import context_parallel as C

    whole = torch.randn(SEQ, 2, 3)
    gathered = torch.cat([whole[C.cp_index(SEQ, cp, r)] for r in range(cp)])
    assert torch.equal(C._reorder_chunks(gathered, C._global_from_gathered(cp)), whole)
    assert torch.equal(C._reorder_chunks(whole, C._gathered_from_global(cp)), gathered)


def test_masks_of_local_queries_are_the_rows_of_the_whole_mask():
    """Built for a rank's queries (global positions, local order) over the whole sequence's keys, the
    mask equals those rows of the one-rank mask, for padding, packing, the window, and their absence."""
    from megatron_plugin.layers.context_parallel import cp_index
    from megatron_plugin.layers.masks import add_window, attention_mask_4d

    g = torch.Generator().manual_seed(0)
    left = torch.ones(2, SEQ, dtype=torch.long)
    left[0, :5] = 0
    packed = torch.tensor([list(range(7)) + list(range(9)), list(range(4)) * 4])
    cases = [(None, None), (left, (left.cumsum(-1) - 1).clamp_min(0)), (None, packed),
             ((torch.rand(2, SEQ, generator=g) > 0.3).long(), None)]
    for cp in (2, 4):
        for r in range(cp):
            index = cp_index(SEQ, cp, r)
            for mask, pos in cases:
                for window in (None, 5, 64):
                    whole = attention_mask_4d(mask, SEQ, pos, window=window)
                    local = attention_mask_4d(mask, SEQ, pos, window=window, queries=index)
                    if whole is None:
                        assert local is None
                    else:
                        assert torch.equal(local, whole[:, :, index]), (cp, r, window)
                # the model's own window (models/gpt.py) on top of the inputs' mask
                whole = add_window(attention_mask_4d(mask, SEQ, pos), SEQ, 5)
                local = add_window(attention_mask_4d(mask, SEQ, pos, queries=index), SEQ, 5, queries=index)
                assert torch.equal(local, whole[:, :, index]), (cp, r)
    # no window, no mask: None, i.e. plain causal over global positions, which attention computes itself
    assert add_window(None, SEQ, None, queries=cp_index(SEQ, 2, 0)) is None


def test_one_rank_is_untouched():
    """CP=1: the split, the gathers and the token count hand back what they were given, with no collective
    (no process group exists here)."""
    from megatron_plugin.layers.context_parallel import (gather_sequence, shard_of, shard_sequence,
                                                         tokens_over_context_parallel, unshard)

    batch = {"input_ids": torch.arange(12).view(2, 6), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    out = shard_sequence(batch, 1, 0)
    assert out is batch and out["input_ids"] is batch["input_ids"] and shard_of(out["input_ids"]) is None
    k = torch.randn(6, 2, 2, 4)
    assert gather_sequence(k, 1, 0) is k and gather_sequence(k, None, 1) is k
    with pytest.raises(RuntimeError, match="CP group"):  # never a part handed back as the whole
        gather_sequence(k, 2, 0)
    assert torch.equal(unshard(k, 0), k)
    count = torch.tensor(7)
    assert tokens_over_context_parallel(count) is count


@pytest.mark.parametrize("causal", [True, False])
def test_attention_at_one_rank_takes_todays_path(causal, monkeypatch):
    """At CP=1 SDPAttention never reaches the CP code (no gather, no extra op) and equals SDPA."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.layers import attention

    def refuse(*args, **kwargs):
        raise AssertionError("CP code reached at CP=1")

    monkeypatch.setattr(attention, "gather_sequence", refuse)
    monkeypatch.setattr(attention.SDPAttention, "_over_context_parallel", refuse)
    heads, groups, d, s, b = 4, 2, 8, 6, 2
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=d, attention_dropout=0.0)
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    attn = attention.SDPAttention(cfg, 1, mask_type, "self").eval()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = torch.randn(s, b, groups, d, generator=g), torch.randn(s, b, groups, d, generator=g)
    got = attn(q, k, v, None)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
    want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    assert (got - want).abs().max().item() < 1e-5


# -- several processes: parity with HF -----------------------------------------------------------------

MODELS = ("gpt2", "llama", "mistral")


def _hf(name):
    from tests.models import tiny_gpt2, tiny_llama

    return tiny_gpt2("tied") if name == "gpt2" else tiny_llama(name)


def _cases(vocab):
    """(case, input_ids, attention_mask, position_ids, valid positions), as HF users build them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, SEQ), generator=g)
    right = torch.ones(3, SEQ, dtype=torch.long)
    right[0, 11:] = 0
    right[2, 6:] = 0
    left = torch.ones(3, SEQ, dtype=torch.long)
    left[1, :5] = 0
    left[2, :9] = 0
    left_pos = (left.cumsum(-1) - 1).clamp_min(0)
    packed = torch.tensor([list(range(6)) + list(range(10)), list(range(SEQ)), list(range(3)) * 5 + [0]])
    full = torch.ones(3, SEQ, dtype=torch.bool)
    return [("none", ids, None, None, full), ("right", ids, right, None, right.bool()),
            ("left", ids, left, left_pos, left.bool()), ("packed", ids, None, packed, full)]


def _twin(hf, tp, cp, sp):
    """This rank's Megatron model of `hf` under TP x CP (process groups set up here, as the engine's
    start does: Megatron's order, tp-cp-dp)."""
    from megatron.core import parallel_state

    from megatron_plugin import MegatronLMPlugin, patches
    from megatron_plugin.engine.distributed import init_process_group, set_seed
    from megatron_plugin.models import get_family
    from megatron_plugin.models.modeling import MegatronModel

    init_process_group()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                 create_gloo_process_groups=False)
    patches.install(*patches.for_run("cpu", rotary=get_family(hf.config).rotary, wgrad_fusion=False))
    set_seed(0)
    return MegatronModel.from_hf(hf, MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp, context_parallel_size=cp))


def _parity_worker(tp, cp, sp):
    """For each model and case: |logits - HF's| at valid positions, and the max relative difference of
    every parameter's gradient of sum(logits * W) (W fixed, zero at padding) from HF's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_plugin.layers.context_parallel import (gather_sequence, shard_sequence,
                                                         tokens_over_context_parallel, unshard)
    from tests.models import grad_parity

    out = {}
    for name in MODELS:
        hf = _hf(name)
        model = _twin(hf, tp, cp, sp).eval()
        assert model.module.config.context_parallel_size == cp
        cp_group = parallel_state.get_context_parallel_group()
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for case, ids, mask, pos, valid in _cases(hf.config.vocab_size):
            kwargs = {"use_cache": False} if case == "packed" else {}
            hf.zero_grad()
            ref = hf(ids, attention_mask=mask, position_ids=pos, **kwargs).logits
            w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)) * valid[..., None]
            (ref * w).sum().backward()

            batch = {k: v for k, v in (("input_ids", ids), ("attention_mask", mask), ("position_ids", pos))
                     if v is not None}
            local = shard_sequence(batch, cp, parallel_state.get_context_parallel_rank())
            model.zero_grad()
            got_local = model(local["input_ids"], attention_mask=local.get("attention_mask"),
                              position_ids=local.get("position_ids"))
            # every rank computes the same loss of the whole logits: each keeps its own rows' gradient
            got = gather_sequence(got_local, cp, 1, reduce_grad=False)
            (got * w).sum().backward()
            for p in model.module.parameters():
                if p.grad is None:
                    continue
                dist.all_reduce(p.grad, group=cp_group)  # each CP rank's part of the sequence gave a part
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=tp_group)  # norms under SP saw this TP rank's tokens only
            names_equal, grad_rel = grad_parity(model.hf_state_dict(grads=True), hf)
            if case == "none":
                # with attention_backend's kernels chosen, the causal chunks take the bias as a mask: same result
                with torch.no_grad(), _kernels(model, (SDPBackend.MATH,)):
                    chosen = unshard(model(local["input_ids"]))
                out[(name, "chosen_kernels")] = (chosen - got.detach()).abs().max().item()
            local_tokens = local.get("attention_mask", torch.ones_like(local["input_ids"])).sum()
            out[(name, case)] = dict(
                fwd=(got.detach() - ref.detach()).abs()[valid].max().item(),
                tokens=tokens_over_context_parallel(local_tokens).item(), whole_tokens=valid.sum().item(),
                unshard_equal=torch.equal(unshard(got_local), got.detach()),
                local_len=got_local.shape[1], names_equal=names_equal, grad_rel=grad_rel)
    return out


@contextlib.contextmanager
def _kernels(model, kernels):
    from megatron_plugin.layers.attention import SDPAttention

    layers = [m for m in model.modules() if isinstance(m, SDPAttention)]
    saved = [m.kernels for m in layers]
    for m in layers:
        m.kernels = kernels
    try:
        yield
    finally:
        for m, k in zip(layers, saved):
            m.kernels = k


def _check(results, tp, cp):
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(MODELS) * 5
        for (name, case), res in per_rank.items():
            if case == "chosen_kernels":
                assert res < 1e-5, (rank, name, res)
                continue
            where = (f"rank {rank}, TP={tp} CP={cp}", name, case, res)
            assert res["local_len"] == SEQ // cp, where
            assert res["unshard_equal"] and res["tokens"] == res["whole_tokens"], where
            assert res["fwd"] < 1e-4, where
            assert res["names_equal"] and res["grad_rel"] < 1e-4, where


def test_cp2_matches_hf_logits_and_gradients():
    _check(run_on_ranks(_parity_worker, 2, 1, 2, False), 1, 2)


@pytest.mark.parametrize("tp,cp,sp", [(2, 2, True), (1, 4, False)], ids=["cp2_tp2_sp", "cp4"])
def test_four_ranks_match_hf_logits_and_gradients(tp, cp, sp):
    _check(run_on_ranks(_parity_worker, 4, tp, cp, sp), tp, cp)
