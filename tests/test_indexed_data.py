"""Megatron indexed datasets (the guide's MegatronLMDummyDataLoader) on CPU: `preprocess-data` writes
what the tokenizer gives; the iterators hand each data-parallel rank its part of every global batch in
Megatron-LM's order; training through prepare on them matches HF trained on the same global batches
(HF's causal-LM loss with `shift_labels`), with packed documents too; a resumed run reads on where it
stopped; bad settings are refused before distributed work."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_plugin import MegatronPluginConfigError
from tests.errors import check_refusal, expecter, refusal
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import LR, WARMUP, optimizer_for

SEQ = 24  # tiny_gpt2 has 32 positions
STEPS = 8


def _tokenizer(folder):
    """A word-level tokenizer over 'w0'..'w299' (ids 1..300) with eos 0: every id is in tiny_gpt2's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(300)}, "<unk>": 301}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(folder)
    return tok


def _documents(n=120, seed=0):
    """Arithmetic progressions of words, 3 to 30 long: learnable, and documents shorter and longer than SEQ."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length, start, stride = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((3, 31), (0, 300), (1, 4)))
        docs.append(" ".join(f"w{(start + stride * i) % 300}" for i in range(length)))
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron_plugin.data.preprocess import preprocess_data

    root = tmp_path_factory.mktemp("indexed")
    tok = _tokenizer(str(root / "tok"))
    docs = _documents()
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 1}) + "\n\n")  # blank lines are skipped
    prefix = preprocess_data(str(root / "docs.jsonl"), str(root / "tok"), str(root / "docs"))
    return SimpleNamespace(root=root, tok=tok, docs=docs, prefix=prefix)


def test_preprocess_writes_what_the_tokenizer_gives(corpus, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_plugin.cli import main
    from megatron_plugin.data.preprocess import preprocess_data

    data = IndexedDataset(corpus.prefix)
    assert corpus.prefix.endswith("docs_text_document") and len(data) == len(corpus.docs)
    for i in (0, 1, len(corpus.docs) - 1):
        assert list(data[i]) == corpus.tok(corpus.docs[i])["input_ids"] + [0]
    # plain text, a document a line, through the CLI, without the eos: the same tokens less the eos
    (tmp_path / "docs.txt").write_text("\n".join(corpus.docs[:5]) + "\n")
    assert main(["preprocess-data", "--input", str(tmp_path / "docs.txt"), "--tokenizer", str(corpus.root / "tok"),
                 "--output_prefix", str(tmp_path / "t"), "--no_append_eod"]) == 0
    plain = IndexedDataset(str(tmp_path / "t_text_document"))
    assert [list(plain[i]) for i in range(5)] == [list(data[i])[:-1] for i in range(5)]
    assert sorted(os.listdir(tmp_path)) == ["docs.txt", "t_text_document.bin", "t_text_document.idx"]

    (tmp_path / "bad.jsonl").write_text('{"text": "w1 w2"}\n{"body": "w3"}\n')
    for kwargs, setting, words in (
        (dict(input_path=str(tmp_path / "none.jsonl")), "input", "no such file"),
        (dict(input_path=str(tmp_path / "bad.jsonl")), "json_key", "line 2"),
        (dict(input_path=str(tmp_path / "docs.txt"), tokenizer=str(tmp_path / "no_tok")), "tokenizer", "local folder"),
    ):
        kwargs = {"tokenizer": str(corpus.root / "tok"), "output_prefix": str(tmp_path / "x"), **kwargs}
        with pytest.raises(MegatronPluginConfigError, match=words) as err:
            preprocess_data(**kwargs)
        assert err.value.setting == setting
    assert not any(n.startswith("x_") for n in os.listdir(tmp_path))  # nothing half written


def _loader(corpus, **kwargs):
    from megatron_plugin import MegatronLMDummyDataLoader

    args = dict(data_path=corpus.prefix, splits_string="90,8,2", seq_length=SEQ, micro_batch_size=2,
                data_cache_path=str(corpus.root / "cache"), eod_token_id=0)
    args.update(kwargs)
    return MegatronLMDummyDataLoader(**args)


def _iterators(corpus, dp_size, dp_rank, micro, num_micro, steps, wanted=1, **kwargs):
    """The iterators of one data-parallel rank, built without any process group."""
    loader = _loader(corpus, micro_batch_size=micro, **kwargs)
    plugin = SimpleNamespace(global_batch_size=micro * num_micro * dp_size, num_micro_batches=num_micro)
    sizes = {"train_iters": steps, "eval_iters": 2, "eval_interval": 4, "eod": 0, "vocab_size": 1000}
    layout = SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank)
    return loader.build(sizes, plugin, layout, torch.device("cpu"), wanted)


def test_ranks_read_megatrons_order_and_resume_where_they_stopped(corpus):
    (whole,) = _iterators(corpus, 1, 0, 8, 1, STEPS)
    ranks = [_iterators(corpus, 2, r, 2, 2, STEPS)[0] for r in range(2)]
    for step in range(STEPS):
        full = next(whole)
        parts = [next(r) for r in ranks]
        for key in ("input_ids", "shift_labels"):
            # micro-batch j of rank r holds global rows j*4 + r*2 .. +1 (MegatronPretrainingSampler)
            rows = [parts[r][key][2 * j:2 * j + 2] for j in range(2) for r in range(2)]
            assert torch.equal(torch.cat(rows), full[key]), (step, key)
        assert set(full) == {"input_ids", "shift_labels"} and full["input_ids"].shape == (8, SEQ)
    # the labels are the next tokens: row-wise, a sample continues where its inputs end
    assert torch.equal(full["shift_labels"][:, :-1], full["input_ids"][:, 1:])
    again = _iterators(corpus, 2, 1, 2, 2, STEPS)[0]
    again.seek(3)
    (fresh,) = _iterators(corpus, 2, 1, 2, 2, STEPS)
    for _ in range(3):
        next(fresh)
    assert torch.equal(next(again)["input_ids"], next(fresh)["input_ids"])
    # past the end of the train split: StopIteration (a for loop ends), saying why for next()
    fresh.seek(len(fresh))
    with pytest.raises(StopIteration, match="total_num_steps"):
        next(fresh)
    fresh.seek(4)
    # workers read ahead; the order does not change
    (threaded,) = _iterators(corpus, 2, 1, 2, 2, STEPS, num_workers=2)
    threaded.seek(4)
    assert torch.equal(next(threaded)["input_ids"], next(fresh)["input_ids"])


def test_packed_documents_and_eod_loss_mask(corpus):
    (plain,) = _iterators(corpus, 1, 0, 4, 1, STEPS)
    (packed,) = _iterators(corpus, 1, 0, 4, 1, STEPS, reset_position_ids=True, reset_attention_mask=True,
                           eod_mask_loss=True)
    a, b = next(plain), next(packed)
    assert torch.equal(a["input_ids"], b["input_ids"])
    ids, pos = b["input_ids"], b["position_ids"]
    eod = ids == 0
    assert eod.any() and "position_ids" not in a
    # positions restart after each end of document; the token after it carries no loss
    after = torch.zeros_like(eod)
    after[:, 1:] = eod[:, :-1]
    assert (pos[after] == 0).all() and (pos[:, 1:][~after[:, 1:]] == pos[:, :-1][~after[:, 1:]] + 1).all()
    assert (b["shift_labels"][eod] == -100).all() and torch.equal(b["shift_labels"][~eod], a["shift_labels"][~eod])


def _megatron_run(prefix, cache, tp, micro, num_micro, extra, ckpt, pp=1):
    from megatron_plugin import Accelerator, MegatronLMDummyDataLoader, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2().train()
    opt = optimizer_for(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp, num_micro_batches=num_micro, gradient_clipping=1.0,
                              eval_iters=2, eval_interval=4)
    acc = Accelerator(megatron_lm_plugin=plugin)
    loader = MegatronLMDummyDataLoader(data_path=prefix, splits_string="90,8,2", seq_length=SEQ, micro_batch_size=micro,
                                       data_cache_path=cache, eod_token_id=0, **extra)
    # the guide's call: the same loader three times gives the train, validation and test iterators
    model, opt, sched, train_it, valid_it, test_it = acc.prepare(model, opt, sched, loader, loader, loader)
    assert acc.state.megatron_lm_plugin.megatron_dataset_flag
    losses, seen = [], []
    model.train()
    while len(losses) < STEPS:
        batch = next(train_it) if train_it is not None else {}
        seen.append(batch["input_ids"].clone())
        out = model(**batch)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        if len(losses) == 3:
            saved = acc.save_state(ckpt)
    model.eval()
    with torch.no_grad():
        first = next(valid_it)
        evals = [model(**first).loss.item(), model(**next(test_it)).loss.item()]
    valid_it.seek(len(valid_it) - 1)
    next(valid_it)
    wrapped = torch.equal(next(valid_it)["input_ids"], first["input_ids"])  # validation wraps around
    acc.load_state(saved)
    resumed = next(train_it)["input_ids"]
    return losses, seen, resumed, evals, wrapped


def _hf_losses(corpus, global_batch, extra):
    """HF GPT-2 and torch AdamW on the same global batches: mean cross-entropy of the logits against
    `shift_labels` over the batch's loss tokens (HF's ForCausalLMLoss with shift_labels)."""
    from transformers import get_linear_schedule_with_warmup

    (batches,) = _iterators(corpus, 1, 0, global_batch, 1, STEPS, **extra)
    model = tiny_gpt2().train()
    opt = optimizer_for(model)
    sched = get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses = []
    for _ in range(STEPS):
        batch = next(batches)
        logits = model(batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "tp,micro,num_micro,extra",
    [(2, 8, 1, {}), (1, 2, 2, {}),
     (2, 8, 1, dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True))],
    ids=["tp2", "dp2_2micro", "tp2_packed_eod_mask"],
)
def test_training_on_indexed_data_matches_hf(corpus, tmp_path, tp, micro, num_micro, extra):
    dp = 2 // tp
    ref = _hf_losses(corpus, micro * num_micro * dp, extra)
    assert ref[-1] < ref[0] - 0.1  # it learns, so the comparison means something
    results = run_on_ranks(_megatron_run, 2, corpus.prefix, str(corpus.root / "cache"), tp, micro, num_micro, extra,
                           str(tmp_path / "ckpt"))
    for rank, (losses, seen, resumed, evals, wrapped) in enumerate(results):
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) / b < 1e-4, (rank, step, losses, ref)
        assert torch.equal(resumed, seen[3]), rank  # after load_state the run reads on from step 3
        assert all(0 < e < ref[0] for e in evals) and wrapped, (evals, wrapped)
    if dp == 2:  # the two ranks read different rows of each global batch
        assert not torch.equal(results[0][1][0], results[1][1][0])
    else:
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _prepare_errors(prefix, cache):
    """What prepare refuses about indexed data, each before any process group exists."""
    from megatron.core import parallel_state
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyDataLoader, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.models import tiny_bert

    out = {}
    expect = expecter(out, state=lambda name: parallel_state.model_parallel_is_initialized())

    def attempt(name, model=None, loaders=None, scheduler=True, plugin=None, **kwargs):
        model = model if model is not None else tiny_gpt2()
        opt = optimizer_for(model)
        args = dict(data_path=prefix, seq_length=SEQ, micro_batch_size=2, data_cache_path=cache, eod_token_id=0)
        args.update(kwargs)
        loader = MegatronLMDummyDataLoader(**args)
        extra = [MegatronLMDummyScheduler(opt, total_num_steps=4)] if scheduler else []
        expect(name, lambda: Accelerator(megatron_lm_plugin=plugin or MegatronLMPlugin()).prepare(
            model, opt, *extra, *(loaders(loader) if loaders else [loader])))

    attempt("bert", model=tiny_bert())
    attempt("too_long", seq_length=64)
    attempt("no_steps", scheduler=False)
    attempt("empty_split", loaders=lambda d: [d, d], split="100,0,0")
    attempt("two_loaders", loaders=lambda d: [d, MegatronLMDummyDataLoader(data_path=prefix, seq_length=SEQ,
                                                                           micro_batch_size=2, data_cache_path=cache)])
    attempt("eod_outside_vocab", eod_token_id=5000)
    attempt("model_eos_outside_vocab", model=tiny_gpt2(eos_token_id=50256), eod_token_id=None)
    attempt("flag_without_loader", loaders=lambda d: [DataLoader([{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * 4,
                                                                 batch_size=2)],
            plugin=MegatronLMPlugin(megatron_dataset_flag=True))
    return out


def test_bad_indexed_data_is_refused_before_distributed_work(corpus, tmp_path):
    from megatron_plugin import MegatronLMDummyDataLoader

    def refused(setting, *words, **kwargs):
        args = dict(data_path=corpus.prefix, seq_length=SEQ, micro_batch_size=2, data_cache_path=str(tmp_path / "c"))
        args.update(kwargs)
        args = {k: v for k, v in args.items() if v is not None}
        check_refusal(refusal(MegatronLMDummyDataLoader, **args), setting, *words)

    refused("global_batch_size", "not a setting", global_batch_size=16)
    refused("data_path", "required", data_path=None)
    refused("data_path", "does not exist", data_path=str(tmp_path / "nothing"))
    refused("data_path", "prefix of a .bin/.idx pair", data_path=corpus.prefix + ".bin")
    refused("seq_length", "required", seq_length=None)
    refused("micro_batch_size", "whole number", micro_batch_size=0)
    refused("split", "non-negative", splits_string="90,x,2")
    refused("splits_string", "name the same setting", splits_string="90,8,2", split="80,10,10")
    refused("reset_position_ids", "set both or neither", reset_position_ids=True)
    refused("data_path", "either data_path", train_data_path=corpus.prefix)
    # a damaged file is refused here, not on one rank inside prepare
    broken = tmp_path / "broken_text_document"
    (tmp_path / "broken_text_document.idx").write_bytes(b"not an index")
    (tmp_path / "broken_text_document.bin").write_bytes(b"")
    refused("data_path", "not a readable Megatron indexed dataset", data_path=str(broken))
    short = tmp_path / "short_text_document"
    (tmp_path / "short_text_document.idx").write_bytes(open(corpus.prefix + ".idx", "rb").read())
    (tmp_path / "short_text_document.bin").write_bytes(open(corpus.prefix + ".bin", "rb").read()[:100])
    refused("data_path", "shorter than the .idx", data_path=str(short))
    # blends of weighted prefixes, and per-split data, are accepted
    MegatronLMDummyDataLoader(data_path=["0.7", corpus.prefix, "0.3", corpus.prefix], seq_length=SEQ, micro_batch_size=2)
    MegatronLMDummyDataLoader(train_data_path=corpus.prefix, valid_data_path=corpus.prefix, seq_length=SEQ,
                              micro_batch_size=2)

    (got,) = run_on_ranks(_prepare_errors, 1, corpus.prefix, str(corpus.root / "cache"))
    expected = {
        "bert": ("MegatronLMDummyDataLoader", "causal-LM", "DataLoaders"),
        "too_long": ("seq_length", "32 positions"),
        "no_steps": ("train_iters", "total_num_steps"),
        "empty_split": ("split", "valid iterator", "no data"),
        "two_loaders": ("prepare(MegatronLMDummyDataLoader)", "2 loaders"),
        "eod_outside_vocab": ("eod_token_id", "vocabulary"),
        "model_eos_outside_vocab": ("eod_token_id", "50256", "model config's eos_token_id", "vocabulary"),
        "flag_without_loader": ("megatron_dataset_flag", "no MegatronLMDummyDataLoader"),
    }
    for name, (setting, *words) in expected.items():
        check_refusal(got[name], setting, *words, where=name)
        assert got[name][2] is False, f"{name}: raised after Megatron's groups were built"


def _consumed_iterators(corpus, consumed, dp_rank, dp_size=2, micro=2, num_micro=2, wanted=2):
    """The train and validation iterators of one data-parallel rank, built (as prepare builds them) with the
    plugin's consumed_samples."""
    loader = _loader(corpus, micro_batch_size=micro)
    plugin = SimpleNamespace(global_batch_size=micro * num_micro * dp_size, num_micro_batches=num_micro,
                             consumed_samples=consumed)
    sizes = {"train_iters": STEPS, "eval_iters": 2, "eval_interval": 4, "eod": 0, "vocab_size": 1000}
    return loader.build(sizes, plugin, SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank), torch.device("cpu"), wanted)


def test_consumed_samples_skip_exactly_those_samples(corpus):
    g = 8  # micro 2 x 2 micro-batches x 2 data-parallel ranks
    for rank in range(2):
        train, valid = _consumed_iterators(corpus, None, rank)
        skipped_train, skipped_valid = _consumed_iterators(corpus, [2 * g, g], rank)
        assert (len(skipped_train), len(skipped_valid)) == (len(train) - 2, len(valid) - 1)
        next(train), next(train)
        first_valid = next(valid)["input_ids"]
        # whole global batches: the run reads what a fresh run reads after that many steps, to the end
        for step in range(len(skipped_train)):
            assert torch.equal(next(skipped_train)["input_ids"], next(train)["input_ids"]), (rank, step)
        with pytest.raises(StopIteration):
            next(skipped_train)
        second_valid = next(valid)["input_ids"]
        assert torch.equal(next(skipped_valid)["input_ids"], second_valid)
        # the validation iterator wraps around to its consumed samples, not to sample 0
        skipped_valid.seek(len(skipped_valid) - 1)
        next(skipped_valid)
        again = next(skipped_valid)["input_ids"]
        assert torch.equal(again, second_valid) and not torch.equal(again, first_valid)
        # resuming (load_state's seek) counts steps after the consumed samples
        skipped_train.seek(1)
        (fresh,) = _consumed_iterators(corpus, None, rank, wanted=1)
        fresh.seek(3)
        assert torch.equal(next(skipped_train)["input_ids"], next(fresh)["input_ids"])
    # any count, as Megatron-LM's sampler starts at any sample: rank r's micro-batch j holds c + 4j + 2r + (0, 1)
    c = 5
    for rank in range(2):
        (it,) = _consumed_iterators(corpus, [c], rank, wanted=1)
        rows = next(it)["input_ids"]
        want = [c + 4 * j + 2 * rank + e for j in range(2) for e in range(2)]
        assert torch.equal(rows, torch.stack([it.dataset[i]["tokens"] for i in want]))


def test_consumed_samples_are_refused_when_nothing_is_left(corpus):
    import copy

    from megatron_plugin import MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.data.indexed import consumed_samples
    from megatron_plugin.models import check_model

    model = tiny_gpt2()

    def check(consumed, wanted=1):
        plugin = copy.copy(MegatronLMPlugin(eval_iters=2, eval_interval=4, consumed_samples=consumed))
        plugin.global_batch_size = 8  # as prepare's resolved plugin has it
        return refusal(_loader(corpus).check_for, model.config, check_model(plugin, model.config), plugin,
                       MegatronLMDummyScheduler(None, total_num_steps=STEPS), wanted)

    assert check([8 * (STEPS - 1)]) is None  # one global batch left
    check_refusal(check([8 * STEPS - 4]), "consumed_samples", "train split", f"{8 * STEPS} samples", "not one global batch")
    # validation: (8 // 4 + 1) evaluations of 2 batches of 8
    assert check([0, 40], wanted=2) is None
    check_refusal(check([0, 48], wanted=2), "consumed_samples", "valid split", "48 are already consumed")
    assert consumed_samples(SimpleNamespace(consumed_samples=[5])) == [5, 0, 0]
    assert consumed_samples(SimpleNamespace(consumed_samples=None)) == [0, 0, 0]
    check_refusal(refusal(consumed_samples, SimpleNamespace(consumed_samples=[-1])), "consumed_samples", "whole numbers")
