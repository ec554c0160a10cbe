"""HF's embedding `padding_idx` (Llama family, BERT): the lookup gives the pad row no gradient, a tied head
still its own. Our twins' embedding gradients equal HF's on batches holding the pad id, both as padding
(attention_mask 0, labels -100) and as an ordinary token, under TP = 1, 2 and TP = 2 + SP, through mcore's
lookup and through ours into main_grad (layers/embedding.py); GPT-2's embedding has no padding_idx, so
there the pad row's lookups do train it."""

import os
from types import SimpleNamespace

import pytest
import torch

from tests.models import max_rel, megatron_twin, tiny_bert, tiny_gpt2, tiny_llama, token_mean
from tests.spawn import run_on_ranks

PAD = 0  # the tiny models' pad_token_id
SEQ = 12


def _batch(vocab, device="cpu"):
    """ids with the pad id inside rows (attended, labelled) and as right padding (mask 0, labels -100)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (3, SEQ), generator=g)
    ids[0, 2] = ids[1, 5] = ids[2, 0] = PAD
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    mask[2, 6:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return ids.to(device), mask.to(device), ids.masked_fill(mask == 0, -100).to(device)


def _model_grads(hf, model, ids, mask, labels):
    """(HF's embedding gradient, ours gathered to the full HF tensor) of HF's loss on one batch."""
    emb = hf.get_input_embeddings().weight
    name = next(n for n, p in hf.named_parameters() if p is emb)
    hf.zero_grad()
    model.zero_grad()
    if hasattr(hf.config, "type_vocab_size"):  # BERT, masked LM: its labels are not shifted
        hf(ids, attention_mask=mask, labels=labels).loss.backward()
        per_token, _ = model(ids, attention_mask=mask, labels=labels)
        token_mean(per_token, labels).backward()
    else:
        hf(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        token_mean(model(ids, attention_mask=mask, labels=shifted), shifted).backward()
    return emb.grad.clone(), model.hf_state_dict(grads=True)[name]


def _main_grad_lookup(hf, model, ids):
    """The word embedding alone on the main_grad path (gradient_accumulation_fusion): this rank's
    main_grad rows against F.embedding's with HF's padding_idx, for a fixed output gradient."""
    import torch.nn.functional as F

    emb = model.module.embedding.word_embeddings
    tp, rank = emb.tp_group.size(), emb.tp_group.rank()
    full = hf.get_input_embeddings().weight.detach().clone().requires_grad_(True)
    up = torch.linspace(-1, 1, ids.numel() * full.shape[1], device=ids.device).reshape(*ids.shape, full.shape[1])
    (F.embedding(ids, full, padding_idx=hf.get_input_embeddings().padding_idx) * up).sum().backward()
    emb.weight.main_grad = torch.zeros_like(emb.weight)
    emb.model_config = SimpleNamespace(gradient_accumulation_fusion=True)
    assert emb._into_main_grad()
    out = emb(ids)
    if emb.reduce_scatter_embeddings:  # this rank's part of the sequence, [s/tp, b, h]
        up = up.transpose(0, 1).chunk(tp, dim=0)[rank]
    (out * up).sum().backward()
    rows = emb.weight.shape[0]  # this rank's share of the padded vocabulary: rows past HF's get nothing
    ref = torch.zeros_like(emb.weight)
    part = full.grad[rank * rows:(rank + 1) * rows]
    ref[: part.shape[0]] = part
    return max_rel(emb.weight.main_grad, ref), emb.weight.grad_added_to_main_grad and out.is_contiguous()


def _worker(sp, device="cpu"):
    """Per model: our and HF's embedding gradients compared, the pad row apart; also without the index."""
    from megatron_plugin import MegatronLMPlugin

    tp = int(os.environ["WORLD_SIZE"])
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp)
    builds = {"llama": lambda: tiny_llama("llama"), "llama_tied": lambda: tiny_llama("llama_tied_linear")}
    if not sp:  # BERT's and GPT-2's embeddings do not change under SP: the Llama ones show the reduce-scatter
        builds.update(bert=lambda: tiny_bert("bert", "mlm"), bert_untied=lambda: tiny_bert("bert_untied", "mlm"),
                      gpt2=lambda: tiny_gpt2("tied"))
    out = {}
    for name, build in builds.items():
        hf = build().train()
        model = megatron_twin(hf, plugin).train()  # on the launch's device (layout)
        hf.to(device)
        ids, mask, labels = _batch(hf.config.vocab_size, device)
        ref, got = _model_grads(hf, model, ids, mask, labels)
        emb = model.module.embedding.word_embeddings
        res = {"padding_idx": emb.padding_idx, "hf_padding_idx": hf.get_input_embeddings().padding_idx,
               "reduce_scatter": emb.reduce_scatter_embeddings,
               "rel": max_rel(got, ref), "pad_row_rel": max_rel(got[PAD], ref[PAD]),
               "pad_row_norm": ref[PAD].norm().item()}
        # without the index our pad row gets the lookups' gradient too: the comparison above can fail
        emb.padding_idx = None
        _, unfixed = _model_grads(hf, model, ids, mask, labels)
        res["unfixed_pad_row_rel"] = max_rel(unfixed[PAD], ref[PAD])
        emb.padding_idx = res["padding_idx"]
        if name == "llama":
            res["main_grad_rel"], res["main_grad_marked"] = _main_grad_lookup(hf, model, ids)
        out[name] = res
    return out


@pytest.mark.parametrize("world_size, sp", [(1, False), (2, False), (2, True)])
def test_embedding_gradient_leaves_hf_padding_row_alone(world_size, sp):
    for rank, per_rank in enumerate(run_on_ranks(_worker, world_size, sp)):
        names = {"llama", "llama_tied"} | (set() if sp else {"bert", "bert_untied", "gpt2"})
        assert set(per_rank) == names
        for name, res in per_rank.items():
            where = (rank, world_size, sp, name, res)
            assert res["reduce_scatter"] == sp, where  # SP's output: this rank's part of the sequence
            assert res["padding_idx"] == res["hf_padding_idx"] == (None if name == "gpt2" else PAD), where
            assert res["rel"] < 1e-5 and res["pad_row_rel"] < 1e-5, where
            if name == "gpt2":  # no padding_idx: the pad id's lookups train its row, as in HF
                assert res["unfixed_pad_row_rel"] < 1e-5, where
            else:
                assert res["unfixed_pad_row_rel"] > 1e-2, where
            if name in ("llama", "bert_untied"):  # untied: the lookup is the pad row's only gradient
                assert res["pad_row_norm"] == 0.0, where
            else:  # tied: the head's own gradient of the row stays
                assert res["pad_row_norm"] > 0.0, where
            if name == "llama":
                # marked: DDP's hook skips the weight; contiguous: the layers view the output (MoE's dispatch)
                assert res["main_grad_rel"] < 1e-5 and res["main_grad_marked"], where


def _meta_worker(path):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.engine.hf_io import HFReader
    from megatron_plugin.models.modeling import MegatronModel
    from tests.models import tiny_t5

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    plugin = MegatronLMPlugin(tp_degree=1)
    initialize(plugin, meta.config)
    (chunk,) = MegatronModel.chunks_from_hf(meta, plugin, reader=HFReader(path, variant="lm", setting="hf_checkpoint"))
    built_from_config = MegatronModel(meta.config, plugin)  # no HF module to read it from, as a provider's
    t5 = MegatronModel.from_hf(tiny_t5("t5_v1_0"), plugin)
    return [m.module.embedding.word_embeddings.padding_idx for m in (chunk, built_from_config, t5)]


def test_padding_idx_reaches_chunks_built_on_the_meta_device(tmp_path):
    """The reader path (a model without weights, its chunks read from files) takes the index; a model
    built from the config alone keeps None; T5's embedding has none."""
    path = str(tmp_path / "llama")
    tiny_llama("llama").save_pretrained(path)
    assert run_on_ranks(_meta_worker, 1, path) == [[PAD, None, None]]
