"""MoE checkpoints (Mixtral, Qwen2-MoE with its shared expert and a dense layer, Qwen3-MoE): checkpoint_utils
converts HF <-> Megatron-LM's torch_dist and legacy torch and the native format at any TP / EP / expert TP,
bit-exact; the big-model path reads only each rank's experts from the HF files; save_state / load_state
resume an expert-parallel run bit-exact and load a torch_dist checkpoint at another EP and TP."""

import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_utils import convert_hf_to_megatron, convert_megatron_to_hf, reshape_megatron
from megatron_plugin import MegatronPluginConfigError
from tests.models import tiny_llama, tiny_moe
from tests.spawn import run_on_ranks


def _hf_folder(tmp_path, name, **save):
    folder = tmp_path / f"hf_{name}"
    tiny_moe(name).save_pretrained(folder, **save)
    return str(folder)


def _weights(folder):
    """Every tensor of an HF folder's safetensors files (the checkpoint names, one tensor per expert)."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def _assert_bit_exact(got, ref):
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def _model_files(ckpt):
    return sorted(os.listdir(os.path.join(ckpt, "iter_0000000", "model")))


@pytest.mark.parametrize("name,fmt,tp,ep,etp", [
    ("mixtral", "torch", 2, 2, None),            # Megatron-LM's mp_rank_TT_EEE folders
    ("qwen2_moe", "megatron_plugin", 2, 2, 1),   # experts whole on each rank, dense layers split over TP
    ("qwen3_moe", "torch_dist", 2, 4, None),     # layout-free; EP recorded in args
])
def test_hf_to_megatron_to_hf_bit_exact(tmp_path, name, fmt, tp, ep, etp):
    hf = _hf_folder(tmp_path, name, max_shard_size="40KB")
    assert os.path.exists(os.path.join(hf, "model.safetensors.index.json"))  # several shards, read by the index
    ref = _weights(hf)
    assert any(".experts.7." in k for k in ref)  # per-expert checkpoint names, as the Hub holds them
    mg = str(tmp_path / "mg")
    convert_hf_to_megatron(hf, mg, checkpoint_format=fmt, tp=tp, ep=ep, etp=etp, progress=False)
    if fmt == "torch":
        assert sorted(os.listdir(os.path.join(mg, "release"))) == sorted(
            ["megatron_plugin_checksums.json"] + [f"mp_rank_{t:02d}_{e:03d}" for t in range(tp) for e in range(ep)])
        first = torch.load(os.path.join(mg, "release", "mp_rank_01_001", "model_optim_rng.pt"), weights_only=False)
        assert first["args"].expert_model_parallel_size == ep and first["args"].num_experts == 8
        local = [k for k in first["model"] if ".local_experts." in k and k.endswith("linear_fc2.weight")]
        # each EP rank holds its 4 experts, under their local index 0..3, TP-split
        assert sorted(local) == [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight"
                                 for i in range(2) for j in range(4)]
    if fmt == "megatron_plugin":
        assert _model_files(mg) == sorted(
            [f"tp{t:02d}_pp000.safetensors" for t in range(tp)]
            + [f"experts_etp00_ep{e:03d}_pp000.safetensors" for e in range(ep)])
    if fmt == "torch_dist":
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(os.path.join(mg, "release")).read_metadata().state_dict_metadata
        # megatron-core's SequentialMLP keys: one tensor per layer holding every (global) expert
        assert tuple(md["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].size) == (8, 48, 32)
        assert tuple(md["decoder.layers.1.mlp.router.weight"].size) == (8, 32)
        args = torch.load(os.path.join(mg, "release", "common.pt"), weights_only=False)["args"]
        assert (args.num_experts, args.expert_model_parallel_size, args.moe_router_topk) == (8, ep, 2)
    convert_megatron_to_hf(mg, str(tmp_path / "back"), progress=False)
    _assert_bit_exact(_weights(tmp_path / "back"), ref)
    from transformers import AutoModelForCausalLM

    # transformers 5 stacks the experts again as it loads them
    _assert_bit_exact(AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict(), tiny_moe(name).state_dict())


def test_reshape_across_expert_layouts_bit_exact(tmp_path):
    """native EP=2 x expert TP=2 -> legacy PP=2 x EP=2 (mp_rank_TT_PPP_EEE) -> native EP=1 -> torch_dist EP=4
    -> HF: every step reads the one before, and the weights come back bit for bit."""
    hf = _hf_folder(tmp_path, "qwen2_moe")
    ref = _weights(hf)
    a, b, c, d = (str(tmp_path / x) for x in ("a", "b", "c", "d"))
    convert_hf_to_megatron(hf, a, checkpoint_format="megatron_plugin", tp=1, ep=2, etp=2, progress=False)
    assert "experts_etp01_ep001_pp000.safetensors" in _model_files(a)
    reshape_megatron(a, b, checkpoint_format="torch", tp=1, pp=2, ep=2, progress=False)
    assert sorted(n for n in os.listdir(os.path.join(b, "release")) if n.startswith("mp_rank")) == [
        f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
    reshape_megatron(b, c, checkpoint_format="megatron_plugin", tp=2, progress=False)
    assert _model_files(c) == ["experts_etp00_ep000_pp000.safetensors", "experts_etp01_ep000_pp000.safetensors",
                               "tp00_pp000.safetensors", "tp01_pp000.safetensors"]
    reshape_megatron(c, d, checkpoint_format="torch_dist", ep=4, progress=False)
    convert_megatron_to_hf(d, str(tmp_path / "back"), progress=False)
    _assert_bit_exact(_weights(tmp_path / "back"), ref)


def test_expert_layout_bad_input_leaves_no_output(tmp_path):
    hf = _hf_folder(tmp_path, "mixtral")
    dense = tmp_path / "dense"
    tiny_llama("qwen2").save_pretrained(dense)
    out = tmp_path / "out"

    def refused(setting, match, **kwargs):
        with pytest.raises(MegatronPluginConfigError, match=match) as err:
            convert_hf_to_megatron(kwargs.pop("src", hf), str(out), progress=False, **kwargs)
        assert err.value.setting == setting
        assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out.partial")]

    refused("--target_expert_model_parallel_size", "8 experts must split evenly", ep=3)
    refused("--target_expert_model_parallel_size", "has no experts", src=str(dense), ep=2)
    refused("--target_expert_tensor_parallel_size", "legacy torch files", checkpoint_format="torch", tp=2, ep=2, etp=1)
    refused("--target_data_parallel_size", "must divide", tp=1, ep=2, dp=1)
    refused("--target_expert_tensor_parallel_size", "MLP width 48", ep=2, etp=5)


def test_command_line_expert_parallel(tmp_path):
    from checkpoint_utils.convert import main

    hf = _hf_folder(tmp_path, "mixtral")
    mg = str(tmp_path / "mg")
    assert main(["--load_path", hf, "--save_path", mg, "--checkpoint_format", "megatron_plugin",
                 "--target_expert_model_parallel_size", "2", "--no_progress"]) == 0
    assert _model_files(mg) == ["experts_etp00_ep000_pp000.safetensors", "experts_etp00_ep001_pp000.safetensors",
                                "tp00_pp000.safetensors"]
    assert main(["--load_path", hf, "--save_path", str(tmp_path / "bad"), "--target_expert_model_parallel_size",
                 "3", "--no_progress"]) == 2
    assert main(["--convert_checkpoint_from_megatron_to_transformers", "--load_path", mg, "--save_path",
                 str(tmp_path / "back"), "--no_progress"]) == 0
    _assert_bit_exact(_weights(tmp_path / "back"), _weights(hf))


# -- save_state / load_state of an expert-parallel run ---------------------------------------------------------
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _prepared_moe(tp=1, ep=1, etp=None, seed=0, name="qwen2_moe"):
    """A tiny MoE model prepared over TP x EP (expert TP `etp`), 2 micro-batches of 2 per step and replica."""
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import optimizer_for, token_dataset

    model = tiny_moe("mixtral", seed=seed, num_local_experts=4) if name == "mixtral_4" else tiny_moe(name, seed=seed)
    opt = optimizer_for(model)
    # every position labelled: the mean of each data-parallel rank's mean is the global one at any layout
    plugin = MegatronLMPlugin(tp_degree=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                              sequence_parallelism=tp > 1, num_micro_batches=2)
    acc = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=10, warmup_num_steps=1),
        DataLoader(token_dataset(32, model.config.vocab_size), batch_size=4 // (int(os.environ["WORLD_SIZE"]) // tp)))
    engine.train()
    return acc, engine, iter(loader)


def _save_moe(root, tp, ep, etp):
    """Train, save in both formats, train on (the uninterrupted losses); rank 0 keeps the HF weights saved."""
    import torch.distributed as dist

    from megatron_plugin.engine import checkpoint

    acc, engine, batches = _prepared_moe(tp, ep, etp)
    for _ in range(STEPS_BEFORE):
        engine(**next(batches))
    checkpoint.save_state(os.path.join(root, "torch_dist"), engine)
    checkpoint.save_state(os.path.join(root, "native"), engine, format_name="megatron_plugin")
    hf = engine.hf_state_dict()
    if dist.get_rank() == 0:
        torch.save(hf, os.path.join(root, "saved_hf.pt"))
    losses = [engine(**next(batches)).loss.item() for _ in range(STEPS_AFTER)]
    return {"losses": losses, "files": sorted(os.listdir(os.path.join(root, "native", "iter_0000002", "model")))}


def _resume_moe(root, fmt, tp, ep, etp):
    acc, engine, batches = _prepared_moe(tp, ep, etp, seed=7)  # other weights: the load replaces them
    meta = acc.load_state(os.path.join(root, fmt))
    iteration = engine.iteration
    hf, saved = engine.hf_state_dict(), torch.load(os.path.join(root, "saved_hf.pt"))
    exact = hf.keys() == saved.keys() and all(torch.equal(hf[k], saved[k]) for k in saved)
    for _ in range(STEPS_BEFORE):  # the samples the saved run had read
        next(batches)
    losses = [engine(**next(batches)).loss.item() for _ in range(STEPS_AFTER)]
    return {"exact": exact, "iteration": iteration, "losses": losses,
            "optimizer_loaded": meta.get("optimizer_loaded"), "ep": meta.get("ep")}


@pytest.fixture(scope="module")
def saved_ep2(tmp_path_factory):
    """A run over 2 processes: the experts split over EP=2, the dense layers replicated (DP=2)."""
    root = str(tmp_path_factory.mktemp("ep2"))
    first, second = run_on_ranks(_save_moe, 2, root, 1, 2, None)
    assert first["losses"] == second["losses"]
    return root, first


def test_expert_parallel_run_saves_experts_apart_and_resumes_bit_exact(saved_ep2):
    root, saved = saved_ep2
    assert saved["files"] == ["experts_etp00_ep000_pp000.safetensors", "experts_etp00_ep001_pp000.safetensors",
                              "tp00_pp000.safetensors"]
    for fmt in ("torch_dist", "native"):
        for res in run_on_ranks(_resume_moe, 2, root, fmt, 1, 2, None):
            assert res["exact"] and res["iteration"] == STEPS_BEFORE, fmt
            assert res["losses"] == saved["losses"], fmt  # weights, optimizer, schedule and data position resumed


def test_expert_parallel_checkpoint_loads_on_one_rank(saved_ep2):
    root, saved = saved_ep2
    for fmt in ("torch_dist", "native"):
        (res,) = run_on_ranks(_resume_moe, 1, root, fmt, 1, 1, None)
        assert res["exact"] and res["iteration"] == STEPS_BEFORE, fmt
        if fmt == "torch_dist":  # its optimizer state reshards like the weights
            assert res["optimizer_loaded"] and res["ep"] == 2
            assert res["losses"] == pytest.approx(saved["losses"], rel=1e-5)


def test_expert_parallel_run_converts_to_hf_bit_exact(saved_ep2, tmp_path):
    """Both formats of the EP=2 run, read offline in one process, give back the weights the run held."""
    root, _ = saved_ep2
    saved = torch.load(os.path.join(root, "saved_hf.pt"))
    for fmt in ("torch_dist", "native"):
        convert_megatron_to_hf(os.path.join(root, fmt), str(tmp_path / fmt), progress=False)
        _assert_bit_exact(_weights(tmp_path / fmt), saved)


# -- the big-model path: each rank reads its own experts only ---------------------------------------------------
def _prepared_from_files(path, meta):
    """This rank's Megatron weights after prepare over EP=2 of a materialized or a meta-device Mixtral, and
    every HF tensor name the meta-device path read from the files."""
    import re

    from accelerate import init_empty_weights
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.engine import hf_io
    from tests.training import token_dataset

    read, original = [], hf_io.HFReader.get_slice

    def counting(self, name):
        read.append(name)
        return original(self, name)

    hf_io.HFReader.get_slice = counting
    try:
        if meta:
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        else:
            model = AutoModelForCausalLM.from_pretrained(path)
        acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(expert_model_parallel_size=2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2),
                                 DataLoader(token_dataset(4, 300), batch_size=2))
    finally:
        hf_io.HFReader.get_slice = original
    experts = sorted({int(m.group(1)) for n in read for m in [re.search(r"\.experts\.(\d+)\.", n)] if m})
    return {"weights": {k: v.clone() for k, v in engine.model.module.state_dict().items()
                        if not k.endswith("_extra_state")},
            "experts_read": experts, "reads": len(read), "distinct": len(set(read))}


def test_meta_device_ranks_read_only_their_experts(tmp_path):
    path = _hf_folder(tmp_path, "mixtral", max_shard_size="40KB")
    materialized = run_on_ranks(_prepared_from_files, 2, path, False)
    meta = run_on_ranks(_prepared_from_files, 2, path, True)
    # 2 layers x (4 experts x 3 tensors + router) + attention, norms, embeddings, head: nothing twice
    per_rank = 2 * (4 * 3 + 1 + 4 + 2) + 3
    for rank, (a, b) in enumerate(zip(materialized, meta)):
        assert b["experts_read"] == list(range(4 * rank, 4 * rank + 4))  # never another EP rank's experts
        assert b["reads"] == b["distinct"] == per_rank
        assert set(a["weights"]) == set(b["weights"])
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


# -- converted checkpoints load with load_state at another expert layout ---------------------------------------
def _load_converted(ckpt, hf_path, ep):
    acc, engine, _ = _prepared_moe(1, ep, None, seed=7, name="mixtral")  # other weights: the load replaces them
    acc.load_state(ckpt)
    hf, ref = engine.hf_state_dict(), _weights(hf_path)
    return hf.keys() == ref.keys() and all(torch.equal(hf[k], ref[k]) for k in ref)


@pytest.mark.parametrize("fmt,tp,ep,run_ep", [
    ("torch", 1, 2, 1),             # Megatron-LM's mp_rank_00_EEE folders, read into one rank
    ("megatron_plugin", 2, 4, 2),   # resharded over TP, EP and expert TP
    ("torch_dist", 1, 4, 2),
])
def test_converted_checkpoint_loads_at_another_expert_layout(tmp_path, fmt, tp, ep, run_ep):
    hf = _hf_folder(tmp_path, "mixtral")
    convert_hf_to_megatron(hf, str(tmp_path / "mg"), checkpoint_format=fmt, tp=tp, ep=ep, progress=False)
    assert all(run_on_ranks(_load_converted, run_ep, str(tmp_path / "mg"), hf, run_ep))


def _load_refused(ckpt):
    from tests.errors import refusal

    acc, engine, _ = _prepared_moe(1, 1, None, name="mixtral_4")
    return refusal(acc.load_state, ckpt)


@pytest.mark.parametrize("fmt,says", [
    ("torch_dist", "num_moe_experts: checkpoint 8, this model 4"),  # the HF config it records
    ("torch", "num_experts: checkpoint 8, this model 4"),           # Megatron-LM's args, as in its own checkpoints
])
def test_checkpoint_of_other_experts_is_refused(tmp_path, fmt, says):
    hf = _hf_folder(tmp_path, "mixtral")
    convert_hf_to_megatron(hf, str(tmp_path / "mg"), checkpoint_format=fmt, ep=2, progress=False)
    (setting, message), = run_on_ranks(_load_refused, 1, str(tmp_path / "mg"))
    assert setting == "load_state" and says in message


# -- torch_dist across tensor parallelism: experts and dense layers on other groups ------------------------------
def _sharded_save_or_load(folder, tp, ep, etp, save):
    """The Mixtral twin at TP x EP (expert TP `etp`): its model part saved as save_state writes it, or a twin of
    other weights filled from it; returns whether its HF tensors are the HF model's, bit for bit."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.checkpointing.megatron_lm_state import model_sharded_state_dict, sharding_metadata
    from megatron_plugin.engine.checkpointing.torch_dist_io import load_sharded, save_sharded
    from megatron_plugin.models.moe_names import checkpoint_state_dict
    from tests.models import megatron_twin

    plugin = MegatronLMPlugin(tp_degree=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    ref = tiny_moe("mixtral")
    model = megatron_twin(ref if save else tiny_moe("mixtral", seed=7), plugin)
    sd = model_sharded_state_dict([model], sharding_metadata(False))
    if save:
        save_sharded(sd, folder)
    else:
        loaded = load_sharded(sd, folder)
        with torch.no_grad():
            model.module.load_state_dict(loaded["model"], strict=False)
    hf, want = model.hf_state_dict(), checkpoint_state_dict(ref)  # the HF model's under its checkpoint names
    return hf.keys() == want.keys() and all(torch.equal(hf[k], want[k]) for k in want)


def test_torch_dist_of_tp2_with_whole_experts_loads_at_tp1_ep1(tmp_path):
    """Saved over 2 ranks as TP=2 for the dense layers and EP=2 x expert TP=1 for the experts (the two grids
    megatron-core lays over the same ranks), loaded by one rank holding everything."""
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    assert all(run_on_ranks(_sharded_save_or_load, 2, folder, 2, 2, 1, True))
    assert all(run_on_ranks(_sharded_save_or_load, 1, folder, 1, 1, None, False))
    assert all(run_on_ranks(_sharded_save_or_load, 2, folder, 2, 1, 2, False))  # TP=2, experts split by TP


def _plain_mcore_reads(ckpt, name):
    """megatron-core's own MoE model (its SequentialMLP experts, TopKRouter and SharedExpertMLP from its local
    block spec) and reader, none of ours, filled from the converted checkpoint: (keys ours lacks or has
    beyond it, whether every tensor equals ours)."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_plugin import MegatronLMPlugin
    from tests.models import megatron_twin

    ref = tiny_moe(name)
    ours = megatron_twin(ref, MegatronLMPlugin())
    config = ours.config
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for layer, moe in zip(spec.layer_specs, config.moe_layer_freq):
        if moe:  # as Megatron-LM's TE spec files it: an MoE layer's pre-MLP norm has no fused fc1 to live in
            layer.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    plain = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=ours.dims.padded_vocab,
                     max_sequence_length=64, share_embeddings_and_output_weights=ref.config.tie_word_embeddings,
                     position_embedding_type="rope")
    plain.load_state_dict(dist_checkpointing.load(plain.sharded_state_dict(), ckpt), strict=False)
    theirs = {k: v for k, v in plain.state_dict().items() if not k.endswith("_extra_state")}
    mine = {k: v for k, v in ours.module.state_dict().items() if not k.endswith("_extra_state")}
    return sorted(set(theirs) ^ set(mine)), all(torch.equal(theirs[k], mine[k]) for k in mine if k in theirs)


def test_megatron_core_reads_converted_moe_torch_dist(tmp_path):
    hf = _hf_folder(tmp_path, "qwen2_moe")  # shared expert with its gate, a dense layer, QKV bias
    convert_hf_to_megatron(hf, str(tmp_path / "mg"), ep=2, progress=False)
    (res,) = run_on_ranks(_plain_mcore_reads, 1, str(tmp_path / "mg" / "release"), "qwen2_moe")
    assert res == ([], True)


def test_native_format_with_distributed_optimizer_and_experts_refused_at_construction():
    """megatron-core's expert optimizer is sharded over the expert data-parallel group: the native format's one
    file per rank cannot hold it, so the plugin says so when it is made, not at the first save."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.errors import MegatronPluginConfigError

    with pytest.raises(MegatronPluginConfigError, match="ckpt_format='torch_dist'") as err:
        MegatronLMPlugin(ckpt_format="megatron_plugin", use_distributed_optimizer=True, expert_model_parallel_size=2)
    assert err.value.setting == "ckpt_format"
    MegatronLMPlugin(ckpt_format="megatron_plugin", use_distributed_optimizer=True, expert_model_parallel_size=2,
                     no_save_optim=True)
