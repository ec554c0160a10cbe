"""megatron_generate on CPU: greedy and beam search equal HF's generate token for token (GPT-2 and the
Llama family, TP=1, TP=2, PP=2, right- and left-padded prompts of different lengths, with and without
the KV cache); seeded sampling is reproducible and the same under TP=1 and TP=2; bad arguments are
refused clearly."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, expecter
from tests.models import tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks
from tests.training import optimizer_for, token_dataset

NEW = 64
MODELS = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def _hf(name):
    # GPT-2's learned positions must cover prompt + 64 new tokens
    return tiny_gpt2(n_positions=96) if name == "gpt2" else tiny_llama(name)


def _prompts(vocab):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, vocab, (3, 9), generator=g)
    right = torch.ones_like(ids)
    right[1, 4:] = 0
    right[2, 6:] = 0
    return ids, right


def _left(ids, right):
    """The same prompts, left-padded as HF tokenizers do for generation."""
    lengths = right.sum(1)
    left_ids, left_mask = torch.zeros_like(ids), torch.zeros_like(right)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        left_ids[r, ids.shape[1] - n:] = ids[r, :n]
        left_mask[r, ids.shape[1] - n:] = 1
    return left_ids, left_mask


def _stage(name, tp, pp):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    hf = _hf(name)
    if pp > 1:
        hf = tiny_gpt2(n_positions=96, n_layer=4) if name == "gpt2" else tiny_llama(name, num_hidden_layers=4)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp)
    initialize(plugin, hf.config)
    return MegatronModel.from_hf(hf, plugin).eval()


def _greedy_worker(tp, pp):
    from megatron_plugin.generation.generate import megatron_generate

    out = {}
    for name in MODELS:
        model = _stage(name, tp, pp)
        ids, right = _prompts(model.hf_config.vocab_size)
        left_ids, left = _left(ids, right)
        out[name] = {
            "right": megatron_generate(model, ids, right, max_new_tokens=NEW, eos_token_id=[]),
            "left": megatron_generate(model, left_ids, left, max_new_tokens=NEW, eos_token_id=[]),
            "no_cache": megatron_generate(model, ids, right, max_new_tokens=NEW, eos_token_id=[], use_cache=False),
            "top_k_1": megatron_generate(model, ids, right, max_new_tokens=8, top_k=1, eos_token_id=[]),
        }
    return out


def _hf_greedy(name, pp):
    hf = _hf(name) if pp == 1 else (tiny_gpt2(n_positions=96, n_layer=4) if name == "gpt2" else tiny_llama(name, num_hidden_layers=4))
    ids, right = _prompts(hf.config.vocab_size)
    rows = []
    for r in range(ids.shape[0]):
        n = int(right[r].sum())
        rows.append(hf.generate(ids[r:r + 1, :n], max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0])
    return rows


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_greedy_equals_hf_generate(tp, pp):
    results = run_on_ranks(_greedy_worker, tp * pp, tp, pp)
    for name in MODELS:
        ref = _hf_greedy(name, pp)
        for rank, res in enumerate(results):
            got = res[name]
            for r, row in enumerate(ref):  # each row: its prompt, then 64 new tokens equal to HF's
                assert torch.equal(got["right"][r, : row.numel()], row), (name, rank, r, got["right"][r], row)
            assert torch.equal(got["left"], got["right"]), name  # left padding is accepted and means the same
            assert torch.equal(got["no_cache"], got["right"]), name  # the cache changes nothing
            assert torch.equal(got["top_k_1"], got["right"][:, : got["top_k_1"].shape[1]]), name


def _engine_worker():
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2(n_positions=96)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2), DataLoader(token_dataset(4, 1000), batch_size=2))
    ids, right = _prompts(1000)
    kwargs = dict(max_new_tokens=16, eos_token_id=[])
    engine.train()
    out = {
        "greedy": engine.megatron_generate(ids, right, **kwargs),
        # the guide's sampling calls
        "top_p": engine.megatron_generate(ids, right, top_p=0.8, top_p_decay=0.5, temperature=0.9, random_seed=7, **kwargs),
        "top_k": engine.megatron_generate(ids, right, top_k=50, temperature=0.9, random_seed=7, **kwargs),
        "top_k_again": engine.megatron_generate(ids, right, top_k=50, temperature=0.9, random_seed=7, **kwargs),
        "top_k_seed8": engine.megatron_generate(ids, right, top_k=50, temperature=0.9, random_seed=8, **kwargs),
        "bos": engine.megatron_generate(ids, right, add_BOS=True, **kwargs),
        "zero_new": engine.megatron_generate(ids, right, max_new_tokens=0),
        "training_after": engine.training,
    }
    return out


def _sampling_worker():
    from megatron_plugin.generation.generate import megatron_generate

    model = _stage("gpt2", int(os.environ["WORLD_SIZE"]), 1)
    ids, right = _prompts(1000)
    return megatron_generate(model, ids, right, max_new_tokens=16, top_k=50, temperature=0.9, random_seed=7,
                             eos_token_id=[])


def test_generate_through_the_engine_and_seeded_sampling():
    results = run_on_ranks(_engine_worker, 2)
    a, b = results
    ids, right = _prompts(1000)
    for key in ("greedy", "top_p", "top_k", "bos"):
        assert torch.equal(a[key], b[key]), key  # TP ranks agree
    assert torch.equal(a["top_k"], a["top_k_again"])  # the same seed, the same tokens
    assert not torch.equal(a["top_k"], a["top_k_seed8"])
    assert not torch.equal(a["top_k"], a["greedy"])
    for r in range(3):
        n = int(right[r].sum())
        assert torch.equal(a["top_k"][r, :n], ids[r, :n]) and torch.equal(a["bos"][r, 1:n + 1], ids[r, :n])
    assert (a["bos"][:, 0] == 0).all()  # the model's bos_token_id
    # max_new_tokens=0: the prompts, right-padded rows untouched
    assert torch.equal(a["zero_new"], ids.masked_fill(right == 0, 0))
    assert a["training_after"] is True  # generation leaves the engine in the mode it found it
    # sampling under TP=1 draws the same tokens as under TP=2
    (tp1,) = run_on_ranks(_sampling_worker, 1)
    assert torch.equal(tp1, a["top_k"])


def test_top_p_keeps_the_nucleus():
    from megatron_plugin.generation.generate import filter_logits

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8: the second token completes it
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.85))
    assert kept.tolist() == [[True, True, True, False]]
    kept = torch.isfinite(filter_logits(probs.log(), 2, 0.0))
    assert kept.tolist() == [[True, True, False, False]]


def _beam_worker(cases):
    from megatron_plugin.generation.generate import megatron_generate

    tp = int(os.environ["WORLD_SIZE"])
    out = []
    for name, eos, beams, lp, early in cases:
        model = _stage(name, tp, 1)
        ids, _ = _prompts(model.hf_config.vocab_size)
        out.append(megatron_generate(model, ids[:1, :5], max_new_tokens=12, num_beams=beams, length_penalty=lp,
                                     early_stopping=early, eos_token_id=eos))
    return out


def _beam_cases():
    """Stop tokens the models actually produce mid-way, so finished hypotheses and early stopping matter."""
    cases = []
    for name in ("gpt2", "llama"):
        hf = _hf(name)
        ids, _ = _prompts(hf.config.vocab_size)
        greedy = hf.generate(ids[:1, :5], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        eos = int(greedy[5 + 3])
        for beams, lp, early in ((4, 1.0, False), (3, 1.5, True), (4, 0.5, "never"), (2, -1.0, False)):
            cases.append((name, eos, beams, lp, early))
    return cases


@pytest.mark.parametrize("tp", [1, 2])
def test_beam_search_equals_hf(tp):
    cases = _beam_cases()
    results = run_on_ranks(_beam_worker, tp, cases)
    for (name, eos, beams, lp, early), got in zip(cases, results[0]):
        hf = _hf(name)
        ids, _ = _prompts(hf.config.vocab_size)
        ref = hf.generate(ids[:1, :5], max_new_tokens=12, num_beams=beams, length_penalty=lp, early_stopping=early,
                          do_sample=False, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, ref), (name, eos, beams, lp, early, got, ref)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0]))


def _bad_generate_worker():
    from functools import partial

    from megatron_plugin.generation.generate import megatron_generate

    model = _stage("gpt2", 1, 1)
    ids, right = _prompts(1000)
    out = {}
    expect = expecter(out)
    # each case overrides some of these
    generate = partial(megatron_generate, model, inputs=ids, attention_mask=right, max_new_tokens=4)

    expect("both_lengths", generate, max_length=20)
    expect("no_length", generate, max_new_tokens=None)
    expect("negative_temperature", generate, temperature=-0.5)
    expect("zero_temperature", generate, temperature=0.0)
    expect("top_k_over_vocab", generate, top_k=5000)
    expect("top_p_over_one", generate, top_p=1.5)
    expect("top_k_and_top_p", generate, top_k=5, top_p=0.9)
    expect("beam_with_batch", generate, num_beams=4)
    expect("too_long", generate, max_new_tokens=95)
    expect("prompt_too_long", generate, inputs=torch.randint(0, 1000, (1, 100)), attention_mask=None)
    expect("hole_in_mask", generate, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1, 1]] * 3))
    expect("ids_over_vocab", generate, inputs=ids + 1000)
    expect("float_ids", generate, inputs=ids.float())
    expect("unknown_kwarg", generate, beams=3)
    expect("bad_stop", generate, stop_token=-3)
    return out


def test_bad_generation_arguments():
    (out,) = run_on_ranks(_bad_generate_worker, 1)
    expected = {
        "both_lengths": ("max_length/max_new_tokens", "one of them"),
        "no_length": ("max_new_tokens", "pass max_new_tokens"),
        "negative_temperature": ("temperature", "> 0.0"),
        "zero_temperature": ("temperature", "> 0.0"),
        "top_k_over_vocab": ("top_k", "1000 tokens"),
        "top_p_over_one": ("top_p", "<= 1.0"),
        "top_k_and_top_p": ("top_k/top_p", "not both"),
        "beam_with_batch": ("num_beams", "one prompt"),
        "too_long": ("max_new_tokens", "96 positions", "at most 87"),
        "prompt_too_long": ("max_new_tokens", "96 positions"),
        "hole_in_mask": ("attention_mask", "contiguous"),
        "ids_over_vocab": ("inputs", "[0, 1000)"),
        "float_ids": ("inputs", "integer"),
        "unknown_kwarg": ("megatron_generate", "unknown"),
        "bad_stop": ("stop_token", "[0, 1000)"),
    }
    for name, (setting, *words) in expected.items():
        check_refusal(out[name], setting, *words, where=name)


def trained_t5(name, path):
    """A tiny T5 trained for a few steps on a copy task (random weights only repeat the start token), saved."""
    from tests.models import tiny_t5
    from tests.training import seq2seq_dataset

    model = tiny_t5(name).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = seq2seq_dataset(256, 333)
    for i in range(150):
        chunk = data[(i % 16) * 16:(i % 16 + 1) * 16]
        batch = {k: torch.stack([d[k] for d in chunk]) for k in chunk[0]}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def t5_models(tmp_path_factory):
    from tests.models import T5_CONFIGS

    root = tmp_path_factory.mktemp("t5")
    return {name: (str(root / name), trained_t5(name, root / name)) for name in T5_CONFIGS}


def _t5_worker(paths):
    from transformers import T5ForConditionalGeneration

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.generation.generate import megatron_generate
    from megatron_plugin.models.modeling import MegatronModel

    out = {}
    for name, (path, eos) in paths.items():
        hf = T5ForConditionalGeneration.from_pretrained(path).eval()
        plugin = MegatronLMPlugin(tp_degree=int(os.environ["WORLD_SIZE"]))
        initialize(plugin, hf.config)
        model = MegatronModel.from_hf(hf, plugin)
        ids, mask = _t5_prompts()
        out[name] = {
            "greedy": megatron_generate(model, ids, mask, max_new_tokens=20, eos_token_id=[]),
            "stops": megatron_generate(model, ids, mask, max_new_tokens=20, eos_token_id=eos),
            "sampled": megatron_generate(model, ids, mask, max_new_tokens=20, top_k=10, temperature=2.0,
                                         random_seed=3, eos_token_id=[]),
        }
    return out


def _t5_prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (3, 10), generator=g)  # the copy task's tokens
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


@pytest.mark.parametrize("tp", [1, 2])
def test_t5_greedy_equals_hf_generate(tp, t5_models):
    ids, mask = _t5_prompts()
    refs, paths = {}, {}
    for name, (path, hf) in t5_models.items():
        # (HF's own cache is sized by the encoder's layer count; one config has more decoder layers)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, use_cache=False)
        ref = hf.generate(eos_token_id=None, **kw)
        eos = int(ref[0, 2])  # a token greedy decoding emits a few steps in: rows stop at different lengths
        refs[name] = (ref, hf.generate(eos_token_id=eos, **kw))
        paths[name] = (path, eos)
        assert len(set(ref[:2].flatten().tolist())) >= 5  # varied output, so equality means something
    results = run_on_ranks(_t5_worker, tp, paths)
    for name, (ref, stop_ref) in refs.items():
        for res in results:
            got = res[name]
            assert torch.equal(got["greedy"], ref), (name, got["greedy"], ref)
            assert torch.equal(got["stops"], stop_ref), (name, got["stops"], stop_ref)
            assert got["sampled"].shape == ref.shape and not torch.equal(got["sampled"], ref)
        assert all(torch.equal(r[name]["sampled"], results[0][name]["sampled"]) for r in results)
