"""HF BERT (bert, megatron-bert; pre-training, MLM and base variants) and T5 (v1.0, v1.1; conditional
generation and base) vs their Megatron-Core twins under TP = 1, 2, 4 on CPU: outputs with padding, odd
vocabulary, tied and untied heads; gradients; HF -> Megatron -> HF bit for bit."""

import os

import pytest
import torch

from tests.models import BERT_CONFIGS, T5_CONFIGS, grad_parity, megatron_twin, tiny_bert, tiny_t5, token_mean
from tests.spawn import run_on_ranks

# a key bias shifts every score of a softmax row alike: its true gradient is 0, and HF's and ours are
# rounding noise of ~1e-9; relative to a floor of 1e-5 such a tensor still has to agree
FLOOR = 1e-5


def _inputs(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    return ids, mask, torch.randint(0, 2, (3, 12), generator=g), g


def _roundtrip(model, hf):
    back = model.hf_state_dict()
    sd = hf.state_dict()
    aliases = model.family.tied_aliases(hf.config, model.variant)
    expected = {k for k in sd if k not in aliases}
    return set(back) == expected and all(torch.equal(back[k], sd[k]) for k in back)


def _bert_worker():
    from megatron_plugin import MegatronLMPlugin

    tp = int(os.environ["WORLD_SIZE"])
    out = {}
    for name in BERT_CONFIGS:
        for variant in ("pretraining", "mlm", "base"):
            hf = tiny_bert(name, variant)
            model = megatron_twin(hf, MegatronLMPlugin(tp_degree=tp)).eval()
            ids, mask, types, g = _inputs(hf.config.vocab_size)
            valid = mask.bool()
            with torch.no_grad():
                ref = hf(ids, attention_mask=mask, token_type_ids=types)
                got = model(ids, attention_mask=mask, token_type_ids=types)
            res = {"roundtrip": _roundtrip(model, hf)}
            if variant == "base":
                res["fwd"] = (got[0] - ref.last_hidden_state).abs()[valid].max().item()
                res["second"] = (got[1] - ref.pooler_output).abs().max().item()
            else:
                logits = ref.prediction_logits if variant == "pretraining" else ref.logits
                res["fwd"] = (got[0] - logits).abs()[valid].max().item()
                res["second"] = (got[1] - ref.seq_relationship_logits).abs().max().item() if variant == "pretraining" else 0.0
                # gradients of HF's loss (MLM + NSP) w.r.t. every HF parameter
                labels = ids.masked_fill(torch.rand(ids.shape, generator=g) > 0.3, -100).masked_fill(mask == 0, -100)
                nsp = torch.tensor([0, 1, 1])
                hf.zero_grad()
                kwargs = {"next_sentence_label": nsp} if variant == "pretraining" else {}
                hf(ids, attention_mask=mask, token_type_ids=types, labels=labels, **kwargs).loss.backward()
                per_token, binary = model(ids, attention_mask=mask, token_type_ids=types, labels=labels)
                loss = token_mean(per_token, labels)
                if variant == "pretraining":
                    loss = loss + torch.nn.functional.cross_entropy(binary, nsp)
                model.zero_grad()
                loss.backward()
                # (an untied decoder under transformers 5 leaves cls.predictions.bias unused: no grad)
                res["grad_names"], res["grad_max_rel"] = grad_parity(model.hf_state_dict(grads=True), hf, FLOOR,
                                                                     reached_only=True)
            out[(name, variant)] = res
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bert_parity_under_tensor_parallel(world_size):
    for rank, per_rank in enumerate(run_on_ranks(_bert_worker, world_size)):
        assert len(per_rank) == 3 * len(BERT_CONFIGS)
        for key, res in per_rank.items():
            where = (rank, world_size, key, res)
            assert res["fwd"] < 1e-4 and res["second"] < 1e-4, where
            assert res["roundtrip"], where
            if key[1] != "base":
                assert res["grad_names"] and res["grad_max_rel"] < 1e-4, where


def _sdpa_mask_strides(forward):
    """The last-dimension strides of the masks (T5: position biases) SDPA gets during `forward`: one that is
    not 1 sends SDPA to its math path (on GPU fp32 GEMMs and a materialized softmax, 2x slower)."""
    from unittest import mock

    real, strides = torch.nn.functional.scaled_dot_product_attention, set()

    def spy(*args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            strides.add(attn_mask.stride(-1))
        return real(*args, attn_mask=attn_mask, **kwargs)

    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
        forward()
    return strides


def _t5_worker():
    from megatron_plugin import MegatronLMPlugin

    tp = int(os.environ["WORLD_SIZE"])
    out = {}
    for name in T5_CONFIGS:
        for lm_head in (True, False):
            hf = tiny_t5(name, lm_head)
            model = megatron_twin(hf, MegatronLMPlugin(tp_degree=tp)).eval()
            ids, mask, _, g = _inputs(hf.config.vocab_size)
            dec = torch.randint(2, hf.config.vocab_size, (3, 7), generator=g)
            dec_mask = torch.ones_like(dec)
            dec_mask[0, 5:] = 0
            with torch.no_grad():
                ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
                got = model(ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            ref = ref.logits if lm_head else ref.last_hidden_state
            res = {"fwd": (got - ref).abs()[dec_mask.bool()].max().item(), "roundtrip": _roundtrip(model, hf),
                   "mask_strides": _sdpa_mask_strides(lambda: model(ids, decoder_input_ids=dec))}
            if lm_head:
                labels = torch.randint(2, hf.config.vocab_size, (3, 6), generator=g)
                labels[1, 4:] = -100
                hf.zero_grad()
                hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
                per_token = model(ids, attention_mask=mask, labels=labels)
                model.zero_grad()
                token_mean(per_token, labels).backward()
                res["grad_names"], res["grad_max_rel"] = grad_parity(model.hf_state_dict(grads=True), hf, FLOOR)
            out[(name, lm_head)] = res
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_t5_parity_under_tensor_parallel(world_size):
    for rank, per_rank in enumerate(run_on_ranks(_t5_worker, world_size)):
        assert len(per_rank) == 2 * len(T5_CONFIGS)
        for key, res in per_rank.items():
            where = (rank, world_size, key, res)
            assert res["fwd"] < 1e-4 and res["roundtrip"], where
            assert res["mask_strides"] == {1}, where
            if key[1]:
                assert res["grad_names"] and res["grad_max_rel"] < 1e-4, where
