"""checkpoint_utils: HF <-> Megatron (Megatron-LM's torch_dist and legacy torch, and the native format) at any
TP/PP, reshaping, what megatron-core and load_state read of converted checkpoints, bad input."""

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
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=2, progress=False,
                           checkpoint_format="megatron_plugin")
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
    reshape_megatron(str(tmp_path / "run"), str(tmp_path / "tp1pp2"), tp=1, pp=2, progress=False,
                     checkpoint_format="megatron_plugin")
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


@pytest.mark.parametrize("fmt", ["megatron_plugin", "torch_dist", "torch", "torch_dist as iteration 0"])
def test_converted_checkpoint_loads_with_load_state(tmp_path, fmt):
    tiny_gpt2("tied", n_layer=4).save_pretrained(tmp_path / "hf")
    release = fmt != "torch_dist as iteration 0"  # accelerate's example asserts iter_0000000 and a tracker of 0
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, progress=False,
                           checkpoint_format=fmt.split()[0], release=release)
    if fmt.startswith("torch_dist"):
        tracker = (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text().strip()
        assert (tracker, sorted(os.listdir(tmp_path / "mg"))) == (
            ("release", ["latest_checkpointed_iteration.txt", "release"]) if release
            else ("0", ["iter_0000000", "latest_checkpointed_iteration.txt"]))
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
            "--target_params_dtype", "bf16", "--print-checkpoint-structure", "--checkpoint_format", "megatron_plugin")
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
    convert_hf_to_megatron(str(hf_dir), str(out), overwrite=True, progress=False, checkpoint_format="megatron_plugin")
    assert not (out / "keep.txt").exists() and (out / "latest").exists()


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "llama_tied_linear"])
def test_llama_family_hf_to_megatron_to_hf_bit_exact(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_llama

    hf = tiny_llama(name, num_hidden_layers=4)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # several shards and an index
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=2, progress=False)
    # torch_dist in, Megatron-LM's legacy per-rank files out (2 KV heads at TP=4 too), then HF from those
    reshape_megatron(str(tmp_path / "mg"), str(tmp_path / "mg4"), tp=4, pp=1, progress=False, checkpoint_format="torch")
    assert sorted(n for n in os.listdir(tmp_path / "mg4" / "release") if n.startswith("mp_")) == [
        f"mp_rank_{t:02d}" for t in range(4)]
    convert_megatron_to_hf(str(tmp_path / "mg4"), str(tmp_path / "back"), progress=False)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(hf)
    _assert_same(back.state_dict(), hf.state_dict())


# the reshape writes torch_dist for some, Megatron-LM's legacy files for the others
@pytest.mark.parametrize("name,variant,fmt", [("bert", "pretraining", "torch"), ("bert_untied", "mlm", "torch_dist"),
                                              ("megatron_bert", "base", "torch"), ("t5_v1_0", "lm", "torch"),
                                              ("t5_v1_1", "lm", "torch_dist"), ("t5_v1_0", "base", "torch_dist")])
def test_bert_and_t5_hf_to_megatron_to_hf_bit_exact(tmp_path, name, variant, fmt):
    import transformers

    from tests.models import BERT_CONFIGS, T5_CONFIGS, tiny_bert, tiny_t5

    if name in BERT_CONFIGS:
        hf, pp = tiny_bert(name, variant), 2
    else:
        hf, pp = tiny_t5(name, lm_head=variant == "lm"), 1  # T5: no pipeline stages in megatron-core 0.16.1
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=pp, progress=False)
    reshape_megatron(str(tmp_path / "mg"), str(tmp_path / "mg4"), tp=4, pp=1, progress=False, checkpoint_format=fmt)
    convert_megatron_to_hf(str(tmp_path / "mg4"), str(tmp_path / "back"), progress=False)
    back = getattr(transformers, type(hf).__name__).from_pretrained(tmp_path / "back")
    sd, ref = back.state_dict(), hf.state_dict()
    assert set(sd) == set(ref)
    # an untied BERT decoder under transformers 5 uses its own bias; cls.predictions.bias is then unused
    # (and not carried): every other tensor, tied copies included, comes back bit for bit
    unused = {"cls.predictions.bias"} if name == "bert_untied" else set()
    for k in set(ref) - unused:
        assert torch.equal(sd[k], ref[k]), k


# -- Megatron-LM's formats: torch_dist and legacy torch ----------------------------------------------
def _tiny(name):
    """(HF model, pp) of the families' tiny configs; all vocabularies are odd, so padding rows exist."""
    from tests.models import tiny_bert, tiny_llama, tiny_t5

    return {"gpt2": lambda: (tiny_gpt2("untied", n_layer=4), 2), "llama": lambda: (tiny_llama("llama", num_hidden_layers=4), 2),
            "bert": lambda: (tiny_bert("bert", "pretraining"), 2), "t5": lambda: (tiny_t5("t5_v1_0"), 1)}[name]()


def _assert_hf_equal(folder, hf):
    import transformers

    back = getattr(transformers, type(hf).__name__).from_pretrained(folder)
    sd, ref = back.state_dict(), hf.state_dict()
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_torch_dist_round_trip_bit_exact(tmp_path, name):
    from megatron.core import dist_checkpointing

    from checkpoint_utils.process import one_process

    hf, pp = _tiny(name)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=pp, progress=False)
    # Megatron-LM's layout: iteration 0 is a release checkpoint (Megatron-LM refuses a tracker holding 0)
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "release"
    ckpt = tmp_path / "mg" / "release"
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    with one_process():
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
        tensors = dist_checkpointing.load_tensors_metadata(str(ckpt))
    assert (common["iteration"], common["checkpoint_version"]) == (0, 3.0)
    a = common["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.make_vocab_size_divisible_by) == (2, pp, 128)
    assert a.padded_vocab_size == tensors["embedding.word_embeddings.weight"].global_shape[0] > hf.config.vocab_size
    assert common["megatron_plugin"]["hf_config"]["vocab_size"] == hf.config.vocab_size
    stack = "encoder" if name == "bert" else "decoder"  # layers stacked under one key, layer axis first
    n_layers = hf.config.num_decoder_layers if name == "t5" else a.num_layers
    assert tensors[f"{stack}.layers.self_attention.linear_qkv.weight"].global_shape[0] == n_layers
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"), progress=False)
    _assert_hf_equal(tmp_path / "back", hf)  # the padding rows are gone: shapes and values as the input's


def test_legacy_tp2_pp2_round_trip_and_a_foreign_checkpoint(tmp_path):
    """HF -> legacy (TP=2, PP=2) -> HF bit-exact; then the same files as Megatron-LM with Transformer Engine
    writes them (TE's norm names, no `megatron_plugin` entry) convert with --hf_config."""
    hf = tiny_gpt2("tied", n_layer=4)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, pp=2, progress=False,
                           checkpoint_format="torch")
    ckpt = tmp_path / "mg" / "release"
    assert sorted(os.listdir(ckpt)) == ["megatron_plugin_checksums.json", "mp_rank_00_000", "mp_rank_00_001",
                                        "mp_rank_01_000", "mp_rank_01_001"]
    last = torch.load(ckpt / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    model = last["model"]
    # stage-local layer numbers; the last stage carries its copy of the tied embeddings, each rank its half
    assert {k.split(".")[2] for k in model if k.startswith("decoder.layers.")} == {"0", "1"}
    assert model["output_layer.weight"].shape == (512, 64) and model["output_layer.weight"].dtype == torch.float32
    assert (last["checkpoint_version"], last["args"].tensor_model_parallel_size) == (3.0, 2)
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"), progress=False)
    _assert_hf_equal(tmp_path / "back", hf)

    te = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    (ckpt / "megatron_plugin_checksums.json").unlink()  # ours; Megatron-LM writes none
    for path in ckpt.glob("mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        del state["megatron_plugin"]
        renamed = {}
        for k, v in state["model"].items():
            for local, fused in te.items():
                k = k.replace(local, fused)
            renamed[k] = v
        state["model"] = renamed
        torch.save(state, path)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in renamed
    with pytest.raises(MegatronPluginConfigError, match="--hf_config"):
        convert_megatron_to_hf(str(ckpt), str(tmp_path / "nope"), progress=False)
    assert not (tmp_path / "nope").exists()
    convert_megatron_to_hf(str(ckpt), str(tmp_path / "foreign"), hf_config=str(tmp_path / "hf"), progress=False)
    _assert_hf_equal(tmp_path / "foreign", hf)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_megatron_core_loads_converted_torch_dist(tmp_path, name):
    """megatron-core's own dist_checkpointing.load, into a plain GPTModel of its local spec, reads the
    converted checkpoint: every tensor equals what the mapping table makes of the HF weights."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from checkpoint_utils.process import one_process
    from megatron_plugin.models import get_family
    from megatron_plugin.models.convert import model_dims
    from megatron_plugin.models.mapping import StagePlan, TensorSlice, hf_to_mcore

    hf, _ = _tiny(name)
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, progress=False)
    family = get_family(hf.config)
    tc = family.transformer_config(hf.config)
    dims = model_dims(family, hf.config, 128, 2)
    with one_process():
        # mcore's own rope (not the fused slot the package fills with HF's tables): the weights don't care
        config = TransformerConfig(**dict(tc, apply_rope_fusion=False), use_cpu_initialization=True)
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=tc["normalization"]),
            vocab_size=dims.padded_vocab, max_sequence_length=family.max_positions(hf.config),
            position_embedding_type="rope" if family.rotary else "learned_absolute",
            share_embeddings_and_output_weights=family.tied_embeddings(hf.config),
        )
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "mg" / "release"))
    state = hf.state_dict()
    expected = dict(hf_to_mcore(lambda n: TensorSlice(state[n]), family.table(hf.config, "lm"), dims,
                                StagePlan.single(tc["num_layers"])))
    assert "decoder.layers.3.mlp.linear_fc1.weight" in expected
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    weights = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    assert weights == set(expected)  # nothing of the model left unread


def test_torch_dist_command_line_bf16_and_structure(tmp_path):
    from megatron.core import dist_checkpointing

    from checkpoint_utils.process import one_process

    hf = tiny_gpt2("tied")
    hf.save_pretrained(tmp_path / "hf")
    run = lambda *a: subprocess.run([sys.executable, "-m", "checkpoint_utils.convert", "--no_progress", *map(str, a)],
                                    capture_output=True, text=True, cwd=ROOT, timeout=300)
    p = run("--load_path", tmp_path / "hf", "--save_path", tmp_path / "mg", "--target_tensor_model_parallel_size", 2,
            "--target_data_parallel_size", 2, "--use_distributed_optimizer", "--target_params_dtype", "bf16",
            "--print_checkpoint_structure")
    assert p.returncode == 0, p.stderr
    # the guide's spelling and the underscore one both print every key with its global shape and dtype
    assert "decoder.layers.self_attention.linear_qkv.weight: (2, 192, 64) bfloat16" in p.stdout
    assert "embedding.word_embeddings.weight: (1024, 64) bfloat16" in p.stdout
    with one_process():
        common = dist_checkpointing.load_common_state_dict(str(tmp_path / "mg" / "release"))
        dtypes = {t.dtype for t in dist_checkpointing.load_tensors_metadata(str(tmp_path / "mg" / "release")).values()}
    assert dtypes == {torch.bfloat16}
    a = common["args"]
    assert (a.bf16, a.data_parallel_size, a.world_size, a.use_distributed_optimizer) == (True, 2, 4, True)
    p = run("--convert_checkpoint_from_megatron_to_transformers", "--load_path", tmp_path / "mg" / "release",
            "--save_path", tmp_path / "out", "--print-checkpoint-structure")
    assert p.returncode == 0, p.stderr
    assert "transformer.h.1.attn.c_attn.weight: (64, 192) bfloat16" in p.stdout
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k].float(), v.to(torch.bfloat16).float()), k


def test_megatron_lm_bad_input_leaves_no_output(tmp_path):
    hf = tiny_gpt2("tied")
    hf.save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), progress=False)
    out = tmp_path / "out"

    def refused(match, fn):
        with pytest.raises(MegatronPluginConfigError, match=match):
            fn()
        assert not out.exists()

    refused("--checkpoint_format", lambda: convert_hf_to_megatron(str(tmp_path / "hf"), str(out), checkpoint_format="zarr"))
    # another model's config: 4 layers against the checkpoint's 2
    other = tmp_path / "other"
    tiny_gpt2("tied", n_layer=4).config.save_pretrained(other)
    refused("holds 2 layers", lambda: convert_megatron_to_hf(str(tmp_path / "mg"), str(out), hf_config=str(other)))
    refused("config.json", lambda: convert_megatron_to_hf(str(tmp_path / "mg"), str(out), hf_config=str(tmp_path)))
    # a tracker naming no folder, then a .distcp file cut short
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("7")
    refused("the tracker names iter_0000007, which holds no checkpoint", lambda: convert_megatron_to_hf(str(tmp_path / "mg"), str(out)))
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("release")
    data = tmp_path / "mg" / "release" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    refused("__0_0.distcp'.*damaged", lambda: convert_megatron_to_hf(str(tmp_path / "mg"), str(out)))
    # without the checksums (as Megatron-LM writes it), the cut file is found when read
    (tmp_path / "mg" / "release" / "megatron_plugin_checksums.json").unlink()
    refused("is the checkpoint complete", lambda: convert_megatron_to_hf(str(tmp_path / "mg"), str(out)))


def test_legacy_checkpoint_with_virtual_pipeline_stages_converts(tmp_path):
    """Megatron-LM's interleaved layout: each pipeline rank's file holds `model0`, `model1` (its chunks),
    layers numbered within the chunk; written here as Megatron-LM lays it out, it converts to HF bit-exact."""
    from megatron_plugin.models import get_family
    from megatron_plugin.models.convert import model_dims
    from megatron_plugin.models.mapping import StagePlan, TensorSlice, hf_to_mcore

    hf = tiny_gpt2("untied", n_layer=4)
    hf.save_pretrained(tmp_path / "hf")
    family, state = get_family(hf.config), hf.state_dict()
    rules, dims = family.table(hf.config, "lm"), model_dims(family, hf.config, 128, 1)
    for p in range(2):
        chunks = {f"model{v}": dict(hf_to_mcore(lambda n: TensorSlice(state[n]), rules, dims, StagePlan.for_rank(4, 2, p, v, 2)))
                  for v in range(2)}
        folder = tmp_path / "mg" / "iter_0000007" / f"mp_rank_00_{p:03d}"
        folder.mkdir(parents=True)
        torch.save(dict(chunks, iteration=7, checkpoint_version=3.0), folder / "model_optim_rng.pt")
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("7")
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in chunks["model1"]  # global layer 3, chunk-local 0
    convert_megatron_to_hf(str(tmp_path / "mg"), str(tmp_path / "back"), hf_config=str(tmp_path / "hf"), progress=False)
    _assert_hf_equal(tmp_path / "back", hf)
    # and a reshape keeps the iteration: a torch_dist checkpoint of iteration 7, as Megatron-LM names it
    reshape_megatron(str(tmp_path / "mg"), str(tmp_path / "td"), hf_config=str(tmp_path / "hf"), progress=False)
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (tmp_path / "td" / "iter_0000007" / "metadata.json").exists()
