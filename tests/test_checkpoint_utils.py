"""checkpoint_utils: HF <-> Megatron at any TP/PP, reshaping, loading converted checkpoints, bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_utils import convert_hf_to_megatron, convert_megatron_to_hf, reshape_megatron
from megatron_plugin import MegatronPluginConfigError
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_state(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def _assert_same(a, b):
    keys = set(a) - {"lm_head.weight"}
    assert keys == set(b) - {"lm_head.weight"}
    for k in keys:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name,safe", [("tied", True), ("untied", False)])
def test_hf_to_megatron_tp2_pp2_to_hf_bit_exact(tmp_path, name, safe):
    hf = tiny_gpt2(name, n_layer=4)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=safe, max_shard_size="20KB")  # sharded input
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=2, progress=False)
    files = sorted(os.listdir(tmp_path / "mg" / "iter_0000000" / "model"))
    assert files == sorted(f"tp{t:02d}_pp{p:03d}.safetensors" for p in range(2) for t in range(2))
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"), max_shard_size="30KB", progress=False)
    assert os.path.exists(tmp_path / "back" / "model.safetensors.index.json")  # sharded output
    _assert_same(_hf_state(tmp_path / "back"), hf.state_dict())


def _train_and_save(save_dir):
    """TP=2 training for 3 steps, then save_state; returns the model's HF tensors at save time."""
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import optimizer_for, token_dataset

    model = tiny_gpt2("tied", n_layer=4)
    data = token_dataset(12, model.config.vocab_size)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=3), DataLoader(data, batch_size=4)
    )
    engine.train()
    for batch in loader:
        engine(**batch)
    acc.save_state(save_dir)
    return {k: v.clone() for k, v in engine.hf_state_dict().items()}


def test_megatron_tp2_reshaped_to_tp1_pp2_then_hf_bit_exact(tmp_path):
    trained = run_on_ranks(_train_and_save, 2, str(tmp_path / "run"))[0]
    reshape_megatron(str(tmp_path / "run"), str(tmp_path / "tp1pp2"), tp=1, pp=2, progress=False)
    # a reshape keeps the iteration of the run (3 steps)
    meta = json.loads((tmp_path / "tp1pp2" / "iter_0000003" / "meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["model_only"], meta["iteration"]) == (1, 2, True, 3)
    # and its folders are ordinary ones (mkdtemp would leave them 0700)
    assert os.stat(tmp_path / "tp1pp2").st_mode & 0o077
    convert_megatron_to_hf(str(tmp_path / "tp1pp2"), str(tmp_path / "hf"), progress=False)
    _assert_same(_hf_state(tmp_path / "hf"), trained)
    # the trained weights moved away from the initial ones, so equality above is not trivial
    assert not torch.equal(trained["transformer.h.0.attn.c_attn.weight"], tiny_gpt2("tied", n_layer=4).state_dict()["transformer.h.0.attn.c_attn.weight"])


def _load_converted(ckpt):
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import optimizer_for, token_dataset

    target = tiny_gpt2("tied", n_layer=4, seed=0).eval()
    model = tiny_gpt2("tied", n_layer=4, seed=123)  # different weights: load_state must replace them
    data = token_dataset(8, model.config.vocab_size)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, return_logits=True))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=3), DataLoader(data, batch_size=4)
    )
    acc.load_state(ckpt)
    engine.eval()
    batch = next(iter(loader))
    with torch.no_grad():
        got = engine(**batch).logits
        ref = target(**{k: v for k, v in batch.items()}).logits
    return (got - ref).abs().max().item()


def test_converted_checkpoint_loads_with_load_state(tmp_path):
    tiny_gpt2("tied", n_layer=4).save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, progress=False)
    for err in run_on_ranks(_load_converted, 2, str(tmp_path / "mg")):
        assert err < 1e-4


def test_command_line_and_structure(tmp_path):
    tiny_gpt2("tied").save_pretrained(tmp_path / "hf")
    tok = tmp_path / "tok"
    from examples.megatron_lm_gpt_pretraining import build_tokenizer

    build_tokenizer(os.path.join(ROOT, "examples", "data", "corpus.txt"), 300, str(tok))
    run = lambda *a: subprocess.run([sys.executable, "-m", "checkpoint_utils.convert", "--no_progress", *map(str, a)],
                                    capture_output=True, text=True, cwd=ROOT, timeout=300)
    p = run("--load_path", tmp_path / "hf", "--save_path", tmp_path / "mg", "--target_tensor_model_parallel_size", 2,
            "--target_params_dtype", "bf16", "--print-checkpoint-structure")
    assert p.returncode == 0, p.stderr
    assert "tp01_pp000.safetensors" in p.stdout and "self_attention.linear_qkv.weight" in p.stdout
    shard = load_file(tmp_path / "mg" / "iter_0000000" / "model" / "tp00_pp000.safetensors")
    assert shard["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert shard["embedding.word_embeddings.weight"].shape[0] == 1024 // 2  # vocab 1000 padded to 128*2, halved
    p = run("--convert_checkpoint_from_megatron_to_transformers", "--load_path", tmp_path / "mg",
            "--save_path", tmp_path / "out", "--tokenizer_name", tok)
    assert p.returncode == 0, p.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    ref = tiny_gpt2("tied").state_dict()
    assert torch.equal(back["transformer.wpe.weight"], ref["transformer.wpe.weight"].to(torch.bfloat16).float())


def test_bad_input_leaves_no_output(tmp_path):
    hf_dir = tmp_path / "hf"
    tiny_gpt2("tied").save_pretrained(hf_dir)
    out = tmp_path / "out"

    def refused(match, fn):
        with pytest.raises(MegatronPluginConfigError, match=match):
            fn()
        assert not out.exists() or not os.listdir(out)
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.partial")]

    refused("no such folder", lambda: convert_hf_to_megatron(str(tmp_path / "nope"), str(out)))
    refused("4 attention heads", lambda: convert_hf_to_megatron(str(hf_dir), str(out), tp=3))
    from transformers import GPTNeoXConfig

    neox = tmp_path / "neox"
    neox.mkdir()
    GPTNeoXConfig().to_json_file(neox / "config.json")
    refused("model_type='gpt_neox'", lambda: convert_hf_to_megatron(str(neox), str(out)))
    # a truncated weights file: the conversion fails part-way, and nothing is left at --save_path
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((hf_dir / "config.json").read_text())
    data = (hf_dir / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused("safetensors", lambda: convert_hf_to_megatron(str(corrupt), str(out)))
    # an existing non-empty output is not touched without --overwrite
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MegatronPluginConfigError, match="--overwrite"):
        convert_hf_to_megatron(str(hf_dir), str(out))
    assert (out / "keep.txt").read_text() == "mine"
    convert_hf_to_megatron(str(hf_dir), str(out), overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "latest").exists()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "llama_tied_linear"])
def test_llama_family_hf_to_megatron_to_hf_bit_exact(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_llama

    hf = tiny_llama(name, num_hidden_layers=4)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards and an index
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=2, progress=False)
    reshape_megatron(str(tmp_path / "mg"), str(tmp_path / "mg4"), tp=4, pp=1, progress=False)  # 2 KV heads at TP=4 too
    convert_megatron_to_hf(str(tmp_path / "mg4"), str(tmp_path / "back"), progress=False)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(hf)
    _assert_same(back.state_dict(), hf.state_dict())


@pytest.mark.parametrize("name,variant", [("bert", "pretraining"), ("bert_untied", "mlm"), ("megatron_bert", "base"),
                                          ("t5_v1_0", "lm"), ("t5_v1_1", "lm"), ("t5_v1_0", "base")])
def test_bert_and_t5_hf_to_megatron_to_hf_bit_exact(tmp_path, name, variant):
    import transformers

    from tests.models import BERT_CONFIGS, T5_CONFIGS, tiny_bert, tiny_t5

    if name in BERT_CONFIGS:
        hf, pp = tiny_bert(name, variant), 2
    else:
        hf, pp = tiny_t5(name, lm_head=variant == "lm"), 1  # T5: no pipeline stages in megatron-core 0.16.1
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=pp, progress=False)
    reshape_megatron(str(tmp_path / "mg"), str(tmp_path / "mg4"), tp=4, pp=1, progress=False)
    convert_megatron_to_hf(str(tmp_path / "mg4"), str(tmp_path / "back"), progress=False)
    back = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "back")
    sd, ref = back.state_dict(), hf.state_dict()
    assert set(sd) == set(ref)
    # an untied BERT decoder under transformers 5 uses its own bias; cls.predictions.bias is then unused
    # (and not carried): every other tensor, tied copies included, comes back bit for bit
    unused = {"cls.predictions.bias"} if name == "bert_untied" else set()
    for k in set(ref) - unused:
        assert torch.equal(sd[k], ref[k]), k
