"""The bad-input battery of the capabilities added since the last round (issue 31): generation, log-probs,
offload / reload / weight snapshots, Megatron indexed datasets. Inputs a new user plausibly passes (wrong
types, strings and lists where tensors go, zero or negative sizes, bad shapes, flags given as strings, a
snapshot used twice or across an offload, ...): each is refused with a MegatronPluginConfigError naming the
setting and the fix, or gives a result checked here to be the right one. Never a raw traceback, a silently
wrong result or a hang.

The cases the capabilities' own tests already hold (tests/test_generate.py, tests/test_post_training.py,
tests/test_indexed_data.py) are not repeated."""

import os
import pathlib
import signal
import shutil

import numpy as np
import torch

from tests.errors import check_refusal, expecter, refusal
from tests.spawn import run_on_ranks
from tests.test_indexed_data import SEQ, corpus  # noqa: F401 (the corpus fixture: a tokenized 120-document set)


# -- generation, log-probs, offload and snapshots: one prepared tiny GPT-2 ---------------------------------------
def _engine_worker():
    from tests.training import prepared_gpt2

    acc, engine, batches = prepared_gpt2(1)
    batch = next(batches)
    ids = torch.randint(0, 1000, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    out, got = {}, {}
    expect = expecter(out)

    def generate(**kwargs):
        return engine.megatron_generate(**{"inputs": ids, "attention_mask": mask, "max_new_tokens": 4, **kwargs})

    generation = {
        "inputs_list": dict(inputs=ids.tolist()),
        "inputs_string": dict(inputs="Hello, my name is"),
        "inputs_numpy": dict(inputs=ids.numpy()),
        "inputs_bool": dict(inputs=ids > 500),
        "inputs_1d": dict(inputs=ids[0], attention_mask=None),
        "inputs_empty": dict(inputs=ids[:, :0], attention_mask=None),
        "inputs_negative": dict(inputs=ids - 2000),
        "mask_list": dict(attention_mask=mask.tolist()),
        "mask_rows": dict(attention_mask=mask[:2]),
        "prompt_alone_too_long": dict(inputs=torch.zeros(1, 40, dtype=torch.long), attention_mask=None, max_new_tokens=0),
        "max_new_tokens_negative": dict(max_new_tokens=-1),
        "max_new_tokens_float": dict(max_new_tokens=4.0),
        "max_new_tokens_string": dict(max_new_tokens="4"),
        "max_length_zero": dict(max_new_tokens=None, max_length=0),
        "max_length_under_prompt": dict(max_new_tokens=None, max_length=4),
        "temperature_inf": dict(temperature=float("inf")),
        "temperature_nan": dict(temperature=float("nan")),
        "temperature_string": dict(temperature="0.7"),
        "top_p_negative": dict(top_p=-0.1),
        "top_p_nan": dict(top_p=float("nan")),
        "top_k_negative": dict(top_k=-1),
        "top_k_float": dict(top_k=2.5),
        "top_p_decay_over_one": dict(top_p=0.9, top_p_decay=2.0),
        "num_beams_zero": dict(num_beams=0),
        "beams_with_temperature": dict(inputs=ids[:1], attention_mask=None, num_beams=2, temperature=0.5),
        "beams_without_cache": dict(inputs=ids[:1], attention_mask=None, num_beams=2, use_cache=False),
        "length_penalty_string": dict(inputs=ids[:1], attention_mask=None, num_beams=2, length_penalty="1"),
        "random_seed_negative": dict(random_seed=-1, temperature=0.5),
        "random_seed_float": dict(random_seed=1.5, temperature=0.5),
        "stop_token_string": dict(stop_token="</s>"),
        "stop_token_float": dict(stop_token=2.0),
        "early_stopping_string": dict(early_stopping="yes"),
        "add_BOS_string": dict(add_BOS="yes"),
        "use_cache_string": dict(use_cache="no"),
        "cuda_graphs_string": dict(cuda_graphs="auto"),
        "cuda_graphs_on_cpu": dict(cuda_graphs=True),
    }
    for name, kwargs in generation.items():
        expect(name, generate, **kwargs)

    # accepted: what they give is what the plain spelling gives
    greedy = generate()
    got["stop_token_tensor"] = torch.equal(generate(stop_token=torch.tensor(7)), generate(stop_token=7))
    got["max_new_tokens_numpy"] = torch.equal(generate(max_new_tokens=np.int64(4)), greedy) and greedy.shape == (3, 12)
    got["max_new_tokens_zero"] = torch.equal(generate(max_new_tokens=0), ids)
    # accelerate's signature: max_length, then max_new_tokens, by position after the mask
    got["positional_like_accelerate"] = (torch.equal(engine.megatron_generate(ids, mask, 12), greedy)
                                         and torch.equal(engine.megatron_generate(ids, mask, None, 4), greedy))
    got["int32_inputs"] = torch.equal(generate(inputs=ids.int()), greedy)
    got["float_mask"] = torch.equal(generate(attention_mask=mask.float()), greedy)

    log_probs = {
        "batch_tensor": lambda: engine.compute_log_probs(batch["input_ids"]),
        "batch_list": lambda: engine.compute_log_probs([batch]),
        "batch_none": lambda: engine.compute_log_probs(None),
        "batch_of_lists": lambda: engine.compute_log_probs({k: v.tolist() for k, v in batch.items()}),
        "labels_rows": lambda: engine.compute_log_probs(dict(batch, labels=batch["labels"][:2])),
        "mask_rows_lp": lambda: engine.compute_log_probs(dict(batch, attention_mask=batch["attention_mask"][:2])),
        "sequence_too_long": lambda: engine.compute_log_probs({"input_ids": torch.zeros(4, 40, dtype=torch.long)}),
        "lp_temperature_string": lambda: engine.compute_log_probs(batch, temperature="1"),
        "lp_temperature_inf": lambda: engine.compute_log_probs(batch, temperature=float("inf")),
        "entropy_int": lambda: engine.compute_log_probs(batch, entropy=1),
    }
    for name, fn in log_probs.items():
        expect(name, fn)
    no_labels = engine.compute_log_probs(dict(batch, labels=torch.full_like(batch["labels"], -100)))
    got["all_labels_ignored_is_zero"] = bool((no_labels == 0).all())

    # offload / reload: twice each, in any order, and the weights come back bit for bit
    weights = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    got["reload_without_offload"] = acc.reload()
    got["offload"], got["offload_again"] = acc.offload(), acc.offload()
    got["reload"], got["reload_again"] = acc.reload(), acc.reload()
    got["weights_back"] = all(torch.equal(v, weights[k]) for k, v in engine.hf_state_dict().items())

    def offloaded(fn):
        acc.offload()
        try:
            return fn()
        finally:
            acc.reload()

    def inside(fn):
        with acc.use_weights(acc.snapshot_weights()):
            return fn()

    def nested():
        snapshot = acc.snapshot_weights()
        with acc.use_weights(snapshot), acc.use_weights(snapshot):
            pass

    for name, fn in {
        "offload_params_string": lambda: acc.offload(params="no"),
        "offload_grads_int": lambda: acc.offload(grads=0),
        "offload_other_model": lambda: acc.offload(model=torch.nn.Linear(2, 2)),
        "generate_offloaded": lambda: offloaded(generate),
        "train_offloaded": lambda: offloaded(lambda: (engine.train(), engine(**batch))),
        "snapshot_offloaded": lambda: offloaded(acc.snapshot_weights),
        "use_weights_none": lambda: acc.use_weights(None).__enter__(),
        "use_weights_nested": nested,
        "train_inside_use_weights": lambda: inside(lambda: (engine.train(), engine(**batch))),
        "offload_inside_use_weights": lambda: inside(acc.offload),
        "snapshot_inside_use_weights": lambda: inside(acc.snapshot_weights),
        "save_state_inside_use_weights": lambda: inside(lambda: acc.save_state("/nonexistent/never")),
    }.items():
        expect(name, fn)
    got["not_offloaded_after"] = not engine.is_offloaded

    # one snapshot, used twice and across an offload, gives its own weights each time, and the model's after
    snapshot = acc.snapshot_weights()
    reference = engine.compute_log_probs(batch)
    engine.train()
    engine(**batch)
    trained = engine.compute_log_probs(batch)
    seen = []
    for cycle in range(3):
        if cycle == 2:
            acc.offload()
            acc.reload()
        with acc.use_weights(snapshot):
            seen.append(engine.compute_log_probs(batch))
    got["snapshot_reused"] = [torch.equal(s, reference) for s in seen]
    got["own_weights_after"] = torch.equal(engine.compute_log_probs(batch), trained)
    # use_weights without `with` swaps nothing: it says so instead of leaving the script believing it did
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.use_weights(snapshot)
    got["use_weights_without_with_warns"] = [str(w.message) for w in caught if "without `with`" in str(w.message)]
    got["still_own_weights"] = torch.equal(engine.compute_log_probs(batch), trained)
    got["training_moved_them"] = not torch.equal(trained, reference)
    return out, got, len(generation) + len(log_probs)


ENGINE_REFUSALS = {
    "inputs_list": ("inputs", "list", "torch tensor", "return_tensors='pt'"),
    "inputs_string": ("inputs", "str", "torch tensor"),
    "inputs_numpy": ("inputs", "ndarray", "torch tensor"),
    "inputs_bool": ("inputs", "torch.bool", "integer token ids"),
    "inputs_1d": ("inputs", "shape (8,)", "[batch, prompt length]"),
    "inputs_empty": ("inputs", "shape (3, 0)", "[batch, prompt length]"),
    "inputs_negative": ("inputs", "[0, 1000)", "tokenizer"),
    "mask_list": ("attention_mask", "list", "torch tensor shaped like the inputs"),
    "mask_rows": ("attention_mask", "(2, 8)", "(3, 8)"),
    "prompt_alone_too_long": ("max_new_tokens", "=0", "40 tokens already exceed the model's 32 positions", "shorten"),
    "max_new_tokens_negative": ("max_new_tokens", "-1", ">= 0"),
    "max_new_tokens_float": ("max_new_tokens", "4.0", "whole number"),
    "max_new_tokens_string": ("max_new_tokens", "'4'", "whole number"),
    "max_length_zero": ("max_length", ">= 1"),
    "max_length_under_prompt": ("max_length", "already have 8 tokens", "larger max_length"),
    "temperature_inf": ("temperature", "inf", "> 0.0 and <= 100.0"),
    "temperature_nan": ("temperature", "nan", "> 0.0"),
    "temperature_string": ("temperature", "'0.7'", "pass a number"),
    "top_p_negative": ("top_p", "-0.1", ">= 0.0 and <= 1.0"),
    "top_p_nan": ("top_p", "nan", "<= 1.0"),
    "top_k_negative": ("top_k", "-1", ">= 0", "1000 tokens"),
    "top_k_float": ("top_k", "2.5", "whole number"),
    "top_p_decay_over_one": ("top_p_decay", "2.0", "<= 1.0"),
    "num_beams_zero": ("num_beams", ">= 1"),
    "beams_with_temperature": ("num_beams", "drop temperature"),
    "beams_without_cache": ("use_cache", "decode with the cache"),
    "length_penalty_string": ("length_penalty", "'1'", "pass a number"),
    "random_seed_negative": ("random_seed", "-1", ">= 0"),
    "random_seed_float": ("random_seed", "1.5", "whole number"),
    "stop_token_string": ("stop_token", "'</s>'", "ids in [0, 1000)"),
    "stop_token_float": ("stop_token", "2.0", "ids in [0, 1000)"),
    "early_stopping_string": ("early_stopping", "'yes'", "True, False or 'never'"),
    "add_BOS_string": ("add_BOS", "'yes'", "True or False"),
    "use_cache_string": ("use_cache", "'no'", "True or False"),
    "cuda_graphs_string": ("cuda_graphs", "'auto'", "True, False or None"),
    "cuda_graphs_on_cpu": ("cuda_graphs", "need CUDA"),
    "batch_tensor": ("compute_log_probs(batch)", "Tensor", "dict of tensors"),
    "batch_list": ("compute_log_probs(batch)", "list", "dict of tensors"),
    "batch_none": ("compute_log_probs(batch)", "NoneType", "dict of tensors"),
    "batch_of_lists": ("batch", "input_ids", "tensor of token ids"),
    "labels_rows": ("batch['labels']", "(2, 16)", "4 rows of input_ids"),
    "mask_rows_lp": ("batch['attention_mask']", "(2, 16)", "4 rows of input_ids"),
    "sequence_too_long": ("sequence length", "40 > 32", "at most 32"),
    "lp_temperature_string": ("temperature", "'1'", "positive number"),
    "lp_temperature_inf": ("temperature", "inf", "positive number"),
    "entropy_int": ("entropy", "True or False"),
    "offload_params_string": ("offload(params=...)", "'no'", "True or False"),
    "offload_grads_int": ("offload(grads=...)", "0", "True or False"),
    "offload_other_model": ("offload(model)", "Linear", "the model accelerator.prepare returned"),
    "generate_offloaded": ("megatron_generate", "offloaded", "accelerator.reload()"),
    "train_offloaded": ("model(**batch) in training mode", "offloaded", "accelerator.reload()"),
    "snapshot_offloaded": ("snapshot_weights", "offloaded", "accelerator.reload()"),
    "use_weights_none": ("use_weights(snapshot)", "NoneType", "snapshot_weights()"),
    "use_weights_nested": ("use_weights", "inside use_weights", "outside the `with` block"),
    "train_inside_use_weights": ("model(**batch) in training mode", "inside use_weights", "outside the `with` block"),
    "offload_inside_use_weights": ("offload", "inside use_weights", "outside the `with` block"),
    "snapshot_inside_use_weights": ("snapshot_weights", "inside use_weights", "outside the `with` block"),
    "save_state_inside_use_weights": ("save_state", "inside use_weights", "outside the `with` block"),
}


def test_generation_log_probs_offload_and_snapshots_battery():
    ((out, got, _),) = run_on_ranks(_engine_worker, 1)
    assert set(out) == set(ENGINE_REFUSALS), set(out) ^ set(ENGINE_REFUSALS)
    for name, (setting, *words) in ENGINE_REFUSALS.items():
        check_refusal(out[name], setting, *words, exact=True, where=name)
    for name in ("stop_token_tensor", "max_new_tokens_numpy", "max_new_tokens_zero", "positional_like_accelerate",
                 "int32_inputs", "float_mask",
                 "all_labels_ignored_is_zero", "weights_back", "not_offloaded_after", "own_weights_after",
                 "training_moved_them"):
        assert got[name] is True, (name, got[name])
    assert got["reload_without_offload"] == {}
    moved = got["offload"]
    assert moved["params"] > 0 and moved["optimizer"] > 0, moved
    assert got["offload_again"] == {k: 0 for k in moved}  # the second offload is a no-op
    assert got["reload"] == {k: v for k, v in moved.items() if v} and got["reload_again"] == {}
    assert got["snapshot_reused"] == [True, True, True]
    assert len(got["use_weights_without_with_warns"]) == 1 and got["still_own_weights"], got


# -- indexed datasets -------------------------------------------------------------------------------------------
INDEXED_REFUSALS = {  # (the loader's arguments over the defaults, the setting, words of the message)
    "blend_negative_weight": (lambda p: dict(data_path=["-1", p, "1", p]), "data_path", "'-1'", "weights must be > 0"),
    "blend_zero_weight": (lambda p: dict(data_path=["0", p, "1", p]), "data_path", "weights must be > 0"),
    "blend_weight_missing": (lambda p: dict(data_path=["0.7", p, "0.3"]), "data_path", "alternates weight and prefix"),
    "data_path_dict": (lambda p: dict(data_path={"a": p}), "data_path", "prefix string or a list"),
    "data_path_folder": (lambda p: dict(data_path=os.path.dirname(p)), "data_path", ".bin does not exist", "prefix"),
    "split_list": (lambda p: dict(split=[90, 8, 2]), "split", "[90, 8, 2]", "'949,50,1'"),
    "split_all_zero": (lambda p: dict(split="0,0,0"), "split", "non-negative"),
    "seq_length_string": (lambda p: dict(seq_length="24"), "seq_length", "'24'", "whole number >= 1"),
    "micro_batch_size_negative": (lambda p: dict(micro_batch_size=-2), "micro_batch_size", "-2", "whole number >= 1"),
    "eod_token_id_string": (lambda p: dict(eod_token_id="0"), "eod_token_id", "whole number >= 0"),
    "mmap_bin_files_string": (lambda p: dict(mmap_bin_files="yes"), "mmap_bin_files", "True or False"),
    "eval_interval_zero": (lambda p: dict(eval_interval=0), "eval_interval", "whole number >= 1"),
}


def test_indexed_dataset_settings_battery(corpus, tmp_path):  # noqa: F811 (the imported fixture)
    from megatron_plugin import MegatronLMDummyDataLoader

    base = dict(data_path=corpus.prefix, split="90,8,2", seq_length=SEQ, micro_batch_size=2,
                data_cache_path=str(tmp_path / "cache"), eod_token_id=0)
    for name, (change, setting, *words) in INDEXED_REFUSALS.items():
        got = refusal(MegatronLMDummyDataLoader, **{**base, **change(corpus.prefix)})
        check_refusal(got, f"MegatronLMDummyDataLoader({setting}=...)", *words, exact=True, where=name)
    # accepted, as what they name: a pathlib path, a folder with a space in it, numpy integers
    loader = MegatronLMDummyDataLoader(**{**base, "data_path": pathlib.Path(corpus.prefix)})
    assert loader.dataset_args["data_path"] == corpus.prefix
    spaced = tmp_path / "my data" / "docs"
    spaced.parent.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(corpus.prefix + ext, str(spaced) + ext)
    assert MegatronLMDummyDataLoader(**{**base, "data_path": str(spaced)}).documents == {str(spaced): 120}
    loader = MegatronLMDummyDataLoader(**{**base, "seq_length": np.int64(SEQ), "micro_batch_size": np.int32(2)})
    assert type(loader.dataset_args["seq_length"]) is int and loader.micro_batch_size == 2


def _indexed_prepare_worker(prefix, cache):
    """What prepare does with splits that have no documents (megatron-core's GPTDataset loops forever over one:
    120 documents and the default split '969, 30, 1' leave the test split none)."""
    from megatron_plugin import Accelerator, MegatronLMDummyDataLoader, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.engine.distributed import destroy
    from tests.models import tiny_gpt2
    from tests.training import optimizer_for

    def hung(*_):
        raise TimeoutError("prepare did not return in 120 s")

    signal.signal(signal.SIGALRM, hung)
    out = {}
    expect = expecter(out, keep_result=True)

    def prepare(times, **kwargs):
        signal.alarm(120)
        try:
            model = tiny_gpt2()
            opt = optimizer_for(model)
            args = dict(data_path=prefix, seq_length=SEQ, micro_batch_size=2, data_cache_path=cache, eod_token_id=0)
            loader = MegatronLMDummyDataLoader(**{k: v for k, v in {**args, **kwargs}.items() if v is not None})
            accelerator = Accelerator(megatron_lm_plugin=MegatronLMPlugin())
            engine, _, _, *iterators = accelerator.prepare(
                model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4), *[loader] * times)
            engine.train()
            return [len(i) for i in iterators], bool(torch.isfinite(engine(**next(iterators[0])).loss))
        finally:
            signal.alarm(0)
            destroy()
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    expect("default_split_train_only", prepare, 1)  # hung in megatron-core before: the unused test split was built
    expect("default_split_with_test", prepare, 3)
    expect("valid_data_path_only", prepare, 1, data_path=None, valid_data_path=prefix)
    expect("no_train_weight", prepare, 2, split="0,1,0")
    return out


def test_indexed_splits_without_documents_are_refused_not_hung(corpus):  # noqa: F811
    (out,) = run_on_ranks(_indexed_prepare_worker, 1, corpus.prefix, str(corpus.root / "cache"))
    lengths, finite = out["default_split_train_only"]
    assert lengths == [38] and finite, out["default_split_train_only"]  # an epoch of the 116 train documents: 38 steps
    check_refusal(out["default_split_with_test"], "MegatronLMDummyDataLoader(split=...)", "test iterator",
                  "'969, 30, 1' gives it none of the 120 documents", "give it a weight", exact=True)
    check_refusal(out["valid_data_path_only"], "MegatronLMDummyDataLoader(train_data_path=...)", "train iterator",
                  "train_data_path is not set", exact=True)
    check_refusal(out["no_train_weight"], "MegatronLMDummyDataLoader(split=...)", "train iterator",
                  "its weight in split='0,1,0' is 0", exact=True)
