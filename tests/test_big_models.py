"""Models no process materializes whole: prepare of a meta-device model reads each rank's slices from
the checkpoint; the result equals the materialized path bit for bit. Plus the bad inputs of that path."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from tests.spawn import run_on_ranks


def test_each_rank_reads_only_its_part_bit_exact():
    """`read_shard` (slices read lazily) equals sharding the whole converted tensor, for every rule of
    every family and TP = 1, 2, 4, and keeps the weights' device."""
    from megatron_plugin.models.mapping import TensorSlice
    from megatron_plugin.models import get_family
    from megatron_plugin.models.convert import model_dims
    from megatron_plugin.models.mapping import TRANSFORMS, StagePlan, expand, read_shard, shard

    models = [tiny_gpt2(), tiny_gpt2("untied"), tiny_llama("llama"), tiny_llama("qwen2"), tiny_llama("qwen3"),
              tiny_bert("bert", "pretraining"), tiny_t5("t5_v1_1")]
    checked = 0
    for m in models:
        family, variant, sd = get_family(m.config), None, m.state_dict()
        variant = family.variant_of(m)
        for tp in (1, 2, 4):
            dims = model_dims(family, m.config, 128, tp)
            for rule, names, mcore in expand(family.table(m.config, variant), StagePlan.single(family.num_layers(m.config))):
                full = TRANSFORMS[rule.transform].to_mcore([sd[n] for n in names], dims)
                for r in range(tp):
                    got = read_shard(lambda n: TensorSlice(sd[n]), rule, names, dims, tp, r)
                    assert torch.equal(got, shard(full, rule, tp, r)), (type(m).__name__, tp, r, mcore)
                    # weights elsewhere than on the CPU (an HF model already on the GPU) stay there, with
                    # the padding rows too
                    elsewhere = read_shard(lambda n: TensorSlice(sd[n].to("meta")), rule, names, dims, tp, r)
                    assert elsewhere.is_meta and elsewhere.shape == got.shape, (type(m).__name__, tp, r, mcore)
                    checked += 1
    assert checked > 300


def _save(model, path):
    model.save_pretrained(path, max_shard_size="30KB")  # several shards and an index
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    return path


def _prepared_weights(path, meta):
    """This rank's Megatron weights after prepare under TP=2, from a materialized or a meta-device model."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import token_dataset

    if meta:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        assert all(p.is_meta for p in model.parameters())
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2),
                             DataLoader(token_dataset(4, 300), batch_size=2))
    return {k: v.clone() for k, v in engine.model.module.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_meta_device_model_equals_materialized_under_tp2(tmp_path, name):
    hf = tiny_gpt2("untied") if name == "gpt2" else tiny_llama("llama")  # 2 KV heads, untied head
    path = _save(hf, str(tmp_path / name))
    materialized = run_on_ranks(_prepared_weights, 2, path, False)
    meta = run_on_ranks(_prepared_weights, 2, path, True)
    for a, b in zip(materialized, meta):
        assert set(a) == set(b) and len(a) > 10
        assert all(torch.equal(a[k], b[k]) for k in a)


def _stages_from_files(path, tp, pp):
    from transformers import AutoModelForCausalLM

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.engine.hf_io import HFReader
    from megatron_plugin.models.modeling import MegatronModel

    hf = AutoModelForCausalLM.from_pretrained(path)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp)
    initialize(plugin, hf.config)
    from_memory = MegatronModel.from_hf(hf, plugin)
    from_files = MegatronModel(hf.config, plugin, variant="lm")
    reader = HFReader(path, variant="lm", setting="hf_checkpoint")
    from_files.load_hf(reader.get_slice, reader.names)
    a, b = from_memory.module.state_dict(), from_files.module.state_dict()
    return all(torch.equal(a[k], b[k]) for k in a if not k.endswith("_extra_state"))


def test_pipeline_stages_read_from_files_equal_in_memory(tmp_path):
    path = _save(tiny_llama("llama", num_hidden_layers=4, tie_word_embeddings=True), str(tmp_path / "llama"))
    assert all(run_on_ranks(_stages_from_files, 4, path, 2, 2))


def _meta_error(path, plugin_path, config_path, drop_name):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.errors import refusal
    from tests.training import token_dataset

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))
    if drop_name:
        model.config._name_or_path = ""
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(hf_checkpoint=plugin_path))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return refusal(acc.prepare, model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2),
                   DataLoader(token_dataset(4, 300), batch_size=2))


def test_meta_device_bad_inputs(tmp_path):
    import json

    good = _save(tiny_llama("llama"), str(tmp_path / "good"))
    wider = _save(tiny_llama("llama", intermediate_size=128), str(tmp_path / "wider"))  # another model size
    missing = _save(tiny_llama("llama"), str(tmp_path / "missing"))
    index_file = os.path.join(missing, "model.safetensors.index.json")
    index = json.load(open(index_file))
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    json.dump(index, open(index_file, "w"))
    truncated = _save(tiny_llama("llama"), str(tmp_path / "truncated"))
    shard = os.path.join(truncated, json.load(open(os.path.join(truncated, "model.safetensors.index.json")))["weight_map"]["model.layers.1.mlp.down_proj.weight"])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) - 200])
    cases = {
        "no_source": (good, None, good, True),
        "missing_tensor": (missing, missing, good, False),
        "other_size": (wider, wider, good, False),
        "truncated": (truncated, truncated, good, False),
    }
    out = {case: run_on_ranks(_meta_error, 1, *args)[0] for case, args in cases.items()}
    assert out["no_source"][0] == "hf_checkpoint" and "meta device" in out["no_source"][1]
    assert "model.layers.1.mlp.down_proj.weight" in out["missing_tensor"][1] and "lacks" in out["missing_tensor"][1]
    assert "another model size" in out["other_size"][1] and "mlp" in out["other_size"][1]
    assert out["truncated"][0] == "hf_checkpoint" and "complete" in out["truncated"][1], out["truncated"]


# -- load_state across layouts, save_model, get_state_dict ---------------------------------------------------
def _train_resume(tp, steps, start, total, save_dir=None, load_dir=None):
    """GPT-2 training steps [start, start + steps) of a `total`-step run at this layout; optional save/load."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import WARMUP, optimizer_for, token_dataset

    world = int(os.environ["WORLD_SIZE"])
    model = tiny_gpt2("tied")
    data = token_dataset(total * 4, model.config.vocab_size)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=total, warmup_num_steps=WARMUP),
        DataLoader(data, batch_size=4 // (world // tp)))
    if load_dir:
        assert acc.load_state(load_dir)["iteration"] == start
    engine.train()
    losses = []
    for i, batch in enumerate(loader):
        if i < start:
            continue
        losses.append(engine(**batch).loss.item())
        if len(losses) == steps:
            break
    if save_dir:
        acc.save_state(save_dir)
    return losses


def test_checkpoint_of_tp2_resumes_at_tp1_dp2(tmp_path):
    """Weights and the optimizer's moments are resharded on load: the continued losses equal those of a
    resume at the saved layout."""
    ckpt = str(tmp_path / "ckpt")
    first = run_on_ranks(_train_resume, 2, 2, 6, 0, 12, ckpt)[0]
    same = run_on_ranks(_train_resume, 2, 2, 6, 6, 12, None, ckpt)[0]
    other = run_on_ranks(_train_resume, 2, 1, 6, 6, 12, None, ckpt)
    straight = run_on_ranks(_train_resume, 2, 2, 12, 0, 12)[0]
    assert first + same == pytest.approx(straight, rel=1e-6)
    for losses in other:
        for a, b in zip(losses, same):
            assert abs(a - b) / b < 1e-5, (losses, same)


def _trained_then_saved(path, tp):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import optimizer_for, token_dataset

    model = tiny_llama("llama", tie_word_embeddings=True)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=3), DataLoader(token_dataset(12, 333), batch_size=4))
    engine.train()
    for batch in loader:
        engine(**batch)
    streamed = [(n, t.clone()) for n, t in engine.iter_hf_weights()]
    state = acc.get_state_dict(engine)
    acc.save_model(engine, path, max_shard_size="40KB")
    return streamed, state


def test_save_model_is_a_loadable_hf_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "hf")
    results = run_on_ranks(_trained_then_saved, 2, path, 2)
    streamed, state = results[0]
    assert [n for n, _ in streamed] == list(state) and all(torch.equal(t, state[n]) for n, t in streamed)
    assert all(torch.equal(state[k], results[1][1][k]) for k in state)  # every rank gets the whole model
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # sharded
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    initial = tiny_llama("llama", tie_word_embeddings=True).state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k  # bit for bit what was trained
    assert not torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], initial["model.layers.0.self_attn.q_proj.weight"])
    assert set(loaded) == set(initial)
