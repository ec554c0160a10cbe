"""HF Llama, Mistral, Qwen2 and Qwen3 vs their Megatron-Core twins under TP = 1, 2, 4 on CPU: logits with
right padding, left padding + position_ids and packed sequences; gradients; round trip bit for bit."""

import os

import pytest
import torch

from tests.models import LLAMA_CONFIGS, tiny_llama
from tests.spawn import run_on_ranks

SEQ = 12


def _cases(vocab):
    """(name, input_ids, attention_mask, position_ids, valid positions) as HF users build them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, SEQ), generator=g)
    right = torch.ones(3, SEQ, dtype=torch.long)
    right[0, 8:] = 0
    right[2, 5:] = 0
    left = torch.ones(3, SEQ, dtype=torch.long)
    left[1, :4] = 0
    left[2, :7] = 0
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


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _parity_worker():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    tp = int(os.environ["WORLD_SIZE"])
    plugin = MegatronLMPlugin(tp_degree=tp)
    out = {}
    for name in LLAMA_CONFIGS:
        for lm_head in (True, False):
            hf = tiny_llama(name, lm_head=lm_head)
            initialize(plugin, hf.config)
            model = MegatronModel.from_hf(hf, plugin).eval()
            res = {}
            for case, ids, mask, pos, valid in _cases(hf.config.vocab_size):
                with torch.no_grad():
                    # use_cache=False, as in training: only then does HF read packing from position ids
                    ref = hf(ids, attention_mask=mask, position_ids=pos, use_cache=False)
                    ref = ref.logits if lm_head else ref.last_hidden_state
                    got = model(ids, attention_mask=mask, position_ids=pos)
                res[f"fwd_{case}"] = (got - ref).abs()[valid].max().item()
                res["shape_ok"] = res.get("shape_ok", True) and got.shape == ref.shape
            back = model.hf_state_dict()
            tied = hf.config.tie_word_embeddings
            ref_sd = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and tied)}
            res["roundtrip_keys_equal"] = set(back) == set(ref_sd)
            res["roundtrip_bit_exact"] = all(torch.equal(back[k], ref_sd[k]) for k in ref_sd if k in back)
            if lm_head:
                # gradients of a cross-entropy over a left-padded batch with position_ids
                _, ids, mask, pos, _ = _cases(hf.config.vocab_size)[2]
                labels = ids.masked_fill(mask == 0, -100)
                hf.zero_grad()
                hf(ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
                shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
                per_token = model(ids, attention_mask=mask, position_ids=pos, labels=shifted)
                keep = (shifted != -100).float()
                model.zero_grad()
                ((per_token * keep).sum() / keep.sum()).backward()
                if tp > 1:  # q/k norms see only this rank's heads: the engines sum their grads over TP
                    import torch.distributed as dist
                    from megatron.core import parallel_state

                    for n, p in model.module.named_parameters():
                        if "q_layernorm" in n or "k_layernorm" in n:
                            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
                grads = model.hf_state_dict(grads=True)
                ref_grads = {k: p.grad for k, p in hf.named_parameters() if k in grads}
                res["grad_names_equal"] = set(ref_grads) == set(grads)
                res["grad_max_rel"] = max(_max_rel(grads[k], ref_grads[k]) for k in ref_grads)
            out[(name, lm_head)] = res
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_llama_family_parity_under_tensor_parallel(world_size):
    results = run_on_ranks(_parity_worker, world_size)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == 2 * len(LLAMA_CONFIGS)
        for (name, lm_head), res in per_rank.items():
            where = f"rank {rank}/{world_size}, {name}, lm_head={lm_head}"
            assert res["shape_ok"], where
            for case in ("none", "right", "left", "packed", "gapped"):
                assert res[f"fwd_{case}"] < 1e-4, (where, case, res)
            assert res["roundtrip_keys_equal"] and res["roundtrip_bit_exact"], (where, res)
            if lm_head:
                assert res["grad_names_equal"], where
                assert res["grad_max_rel"] < 1e-4, (where, res)


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
    rope.install()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, apply_rope_fusion=True)
    no_cp = object()  # read only for packed (thd) sequences
    got = rope_utils.apply_rotary_pos_emb(t, emb(positions), config=config, cp_group=no_cp)
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="cos \\| sin"):  # angles reaching the slot without TE say so
        rope_utils.apply_rotary_pos_emb(t, angles, config=config, cp_group=no_cp)
