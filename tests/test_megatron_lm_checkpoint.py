"""Megatron-LM's checkpoints: save_state writes `latest_checkpointed_iteration.txt` and `iter_NNNNNNN/` in
megatron-core's torch_dist format; load_state reads it (and Megatron-LM's legacy torch layout) at any
TP/DP layout.

- A run at TP=2 saves after 2 steps and goes on 2 more (the uninterrupted losses); its GPT-2 has an untied
  head and a vocabulary of 333, padded to 512 rows at TP=2 but to 384 at TP=1. Loaded at TP=2 the
  weights are bit for bit the saved ones and the next losses are exactly the uninterrupted ones; at TP=1
  and at TP=2 x DP=2 the weights are bit-exact too, and the losses equal the uninterrupted ones up to the
  float order a layout changes (TP splits the matmul sums).
- megatron-core's own `dist_checkpointing.load` into a plain GPTModel (mcore's local spec) reads it.
- A legacy checkpoint laid out as Megatron-LM writes it (per TP rank, TE's layer-norm names) loads.
- no_save_optim / no_load_optim; a damaged file is named on every rank.
"""

import os
import shutil

import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, refusal
from tests.models import GPT2_CONFIGS, tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks
from tests.training import model_weights, optimizer_for, prepared_gpt2, token_dataset

SAVED_AT, MORE = 2, 2  # steps before the save, steps after it
MICRO = 4


def _prepared(tp, seed, num_micro, name="untied"):
    """Tiny GPT-2 at `tp`, global batch MICRO * num_micro * dp. "untied": vocabulary 333, padded to a multiple of
    128 * tp (other rows at each TP), LM head apart from the embedding; "tied": vocabulary 1000, tied head."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2(name, seed=seed) if name in GPT2_CONFIGS else tiny_llama(name, seed=seed)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp, num_micro_batches=num_micro))
    data = token_dataset(64, model.config.vocab_size)
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=10, warmup_num_steps=2),
        DataLoader(data, batch_size=MICRO))
    engine.train()
    return acc, engine, iter(loader)


def _save_at_tp2(root, name="untied"):
    import torch.distributed as dist

    acc, engine, batches = _prepared(tp=2, seed=0, num_micro=2, name=name)
    for _ in range(SAVED_AT):
        engine(**next(batches))
    written = acc.save_state(os.path.join(root, "ckpt"))
    hf = engine.hf_state_dict()
    if dist.get_rank() == 0:
        torch.save(hf, os.path.join(root, "saved_hf.pt"))
    losses = [engine(**next(batches)).loss.item() for _ in range(MORE)]
    return {"written": written, "losses": losses}


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2")
    first, second = run_on_ranks(_save_at_tp2, 2, str(root))
    assert first["losses"] == second["losses"]
    return str(root), first


def _resume(root, tp, num_micro, name="untied"):
    acc, engine, batches = _prepared(tp=tp, seed=7, num_micro=num_micro, name=name)  # the load replaces the weights
    meta = acc.load_state(os.path.join(root, "ckpt"))
    iteration = engine.iteration
    hf, saved = engine.hf_state_dict(), torch.load(os.path.join(root, "saved_hf.pt"))
    exact = hf.keys() == saved.keys() and all(torch.equal(hf[k], saved[k]) for k in saved)
    for _ in range(SAVED_AT):  # the samples the saved run had read
        next(batches)
    losses = [engine(**next(batches)).loss.item() for _ in range(MORE)]
    return {"meta": {k: meta[k] for k in ("format", "iteration", "tp", "pp", "dp", "optimizer_loaded")},
            "exact": exact, "losses": losses, "iteration": iteration}


def test_torch_dist_layout_on_disk(saved_tp2):
    root, res = saved_tp2
    ckpt = os.path.join(root, "ckpt")
    assert res["written"] == os.path.join(ckpt, "iter_0000002")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"  # Megatron-LM's tracker: the iteration, nothing else
    files = set(os.listdir(res["written"]))
    assert {"metadata.json", "common.pt", ".metadata", "megatron_plugin_checksums.json"} <= files
    assert any(f.endswith(".distcp") for f in files)
    import json

    with open(os.path.join(res["written"], "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    import megatron.core  # noqa: F401  (registers argparse.Namespace as a safe global, as Megatron-LM's readers have it)

    common = torch.load(os.path.join(res["written"], "common.pt"), weights_only=True)  # what Megatron-LM reads
    assert common["iteration"] == 2 and common["checkpoint_version"] == 3.0
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.num_layers, args.hidden_size,
            args.padded_vocab_size, args.iteration, args.consumed_train_samples) == (2, 1, 2, 32, 512, 2, 16)
    assert args.untie_embeddings_and_output_weights and args.position_embedding_type == "learned_absolute"
    assert common["megatron_plugin"]["family"] == "gpt2" and common["megatron_plugin"]["hf_config"]["n_embd"] == 32
    assert common["opt_param_scheduler"]["num_steps"] == 2
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(res["written"]).read_metadata().state_dict_metadata)
    # Megatron-LM's names: the pre-attention / pre-MLP norms as TE's fused linears hold them, stacked layers
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.mlp.linear_fc1.layer_norm_bias",
            "embedding.word_embeddings.weight", "output_layer.weight",
            "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight",
            "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"} <= keys
    assert not any("input_layernorm" in k for k in keys)
    assert any(k.startswith("rng_state/shard_0.0_1.2") for k in keys)


def test_resumed_at_the_same_layout_bit_exact(saved_tp2):
    root, saved = saved_tp2
    for res in run_on_ranks(_resume, 2, root, 2, 2):
        assert res["exact"] and res["iteration"] == SAVED_AT
        assert res["meta"] == {"format": "torch_dist", "iteration": 2, "tp": 2, "pp": 1, "dp": 1, "optimizer_loaded": True}
        assert res["losses"] == saved["losses"]  # optimizer, schedule and data position all resumed


def test_saved_at_tp2_loads_at_tp1(saved_tp2):
    root, saved = saved_tp2
    (res,) = run_on_ranks(_resume, 1, root, 1, 2)
    assert res["exact"] and res["iteration"] == SAVED_AT and res["meta"]["optimizer_loaded"]
    assert res["losses"] == pytest.approx(saved["losses"], rel=1e-5)


def test_saved_at_tp2_loads_at_tp2_dp2(saved_tp2):
    root, saved = saved_tp2
    for res in run_on_ranks(_resume, 4, root, 2, 1):  # the same global batch: 4 x 1 micro-batch x 2 replicas
        assert res["exact"] and res["iteration"] == SAVED_AT and res["meta"]["optimizer_loaded"]
        assert res["losses"] == pytest.approx(saved["losses"], rel=1e-5)


def test_llama_saved_at_tp2_loads_at_tp1(tmp_path):
    """Grouped-query attention (QKV rows per query group), SwiGLU (mcore writes fc1's gate and up halves of each
    TP rank apart: a ShardedTensorFactory, for the weight and its optimizer state alike), RMSNorm, untied head."""
    first, _ = run_on_ranks(_save_at_tp2, 2, str(tmp_path), "llama")
    (res,) = run_on_ranks(_resume, 1, str(tmp_path), 1, 2, "llama")
    assert res["exact"] and res["iteration"] == SAVED_AT and res["meta"]["optimizer_loaded"]
    assert res["losses"] == pytest.approx(first["losses"], rel=1e-5)


def _plain_mcore_reads(root):
    """megatron-core's own reader and model, none of ours: mcore's local GPT spec, `dist_checkpointing.load`."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    acc, engine, _ = _prepared(tp=1, seed=7, num_micro=2)
    acc.load_state(os.path.join(root, "ckpt"))
    config = engine.model.config
    plain = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=engine.model.dims.padded_vocab, max_sequence_length=32,
                     share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
    loaded = dist_checkpointing.load(plain.sharded_state_dict(), os.path.join(root, "ckpt", "iter_0000002"))
    plain.load_state_dict(loaded, strict=False)
    theirs = {k: v for k, v in plain.state_dict().items() if not k.endswith("_extra_state")}
    ours = model_weights(engine)
    return {"same_keys": sorted(theirs) == sorted(ours), "equal": all(torch.equal(theirs[k], ours[k]) for k in ours),
            "rows": tuple(theirs["output_layer.weight"].shape)}


def test_megatron_core_reads_it_into_a_plain_gpt_model(saved_tp2):
    root, _ = saved_tp2
    (res,) = run_on_ranks(_plain_mcore_reads, 1, root)
    assert res == {"same_keys": True, "equal": True, "rows": (384, 32)}  # padded for TP=1, saved at TP=2 (512)


# -- Megatron-LM's legacy torch layout ------------------------------------------------------------------
def _write_legacy(root):
    """A run at TP=2 writes iter_0000003/mp_rank_0T/model_optim_rng.pt as Megatron-LM does with TE layers:
    each rank's mcore state dict, the pre-attention / pre-MLP norms named as TE's fused linears hold them."""
    from argparse import Namespace

    import torch.distributed as dist
    from megatron.core import parallel_state

    acc, engine, batches = _prepared(tp=2, seed=0, num_micro=1)
    for _ in range(3):
        engine(**next(batches))
    te_names = {".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
                ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_"}
    model = {}
    for k, v in engine.model.module.state_dict().items():
        for ours, theirs in te_names.items():
            k = k.replace(ours, theirs)
        model[k] = v
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    args = Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_layers=2, hidden_size=32,
                     num_attention_heads=4, ffn_hidden_size=128, make_vocab_size_divisible_by=128, padded_vocab_size=512)
    folder = os.path.join(root, "legacy", "iter_0000003", f"mp_rank_{tp_rank:02d}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model, "args": args, "iteration": 3, "checkpoint_version": 3.0,
                "optimizer": {"optimizer": engine.optimizer.state_dict()},
                "opt_param_scheduler": engine.scheduler.state_dict(), "rng_state": [{}]},
               os.path.join(folder, "model_optim_rng.pt"))
    hf = engine.hf_state_dict()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
        torch.save(hf, os.path.join(root, "legacy_hf.pt"))


def _load_legacy(root):
    import warnings

    acc, engine, _ = _prepared(tp=1, seed=7, num_micro=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = acc.load_state(os.path.join(root, "legacy"))
    hf, saved = engine.hf_state_dict(), torch.load(os.path.join(root, "legacy_hf.pt"))
    return {"format": meta["format"], "iteration": engine.iteration, "steps": engine.scheduler.num_steps,
            "exact": hf.keys() == saved.keys() and all(torch.equal(hf[k], saved[k]) for k in saved),
            "warnings": [str(w.message) for w in caught if "load_state" in str(w.message)]}


def _legacy_of_uneven_stages(root):
    """The legacy checkpoint changed as Megatron-LM's uneven pipelines would leave it: args naming an uneven
    last stage; a stage's file holding more layers than an even split gives it. Both refused, naming why."""
    acc, engine, _ = _prepared(tp=1, seed=7, num_micro=1)
    out = {}
    for case in ("args", "depth"):
        bad = os.path.join(root, f"legacy_{case}")
        shutil.copytree(os.path.join(root, "legacy"), bad)
        for t in range(2):
            path = os.path.join(bad, "iter_0000003", f"mp_rank_{t:02d}", "model_optim_rng.pt")
            saved = torch.load(path, weights_only=False)
            if case == "args":
                saved["args"].decoder_last_pipeline_num_layers = 1
            else:
                saved["model"].update({k.replace(".layers.1.", ".layers.2."): v for k, v in saved["model"].items()
                                       if ".layers.1." in k})
            torch.save(saved, path)
        out[case] = refusal(acc.load_state, bad)
    return out


def test_a_legacy_megatron_lm_checkpoint_loads_resharded(tmp_path):
    run_on_ranks(_write_legacy, 2, str(tmp_path))
    (res,) = run_on_ranks(_load_legacy, 1, str(tmp_path))
    assert res["format"] == "torch" and res["exact"] and res["iteration"] == 3 and res["steps"] == 3
    assert any("legacy" in w and "optimizer starts fresh" in w for w in res["warnings"]), res["warnings"]
    (bad,) = run_on_ranks(_legacy_of_uneven_stages, 1, str(tmp_path))
    check_refusal(bad["args"], "load_state", "decoder_last_pipeline_num_layers", "even stages only", exact=True)
    check_refusal(bad["depth"], "load_state", "holds 3 layers in decoder.layers", "gives 2", exact=True)


# -- no_save_optim, no_load_optim, RNG, registered objects, release (one process) -------------------------
class Cursor:
    """A registered object whose state is no tensor and not weights-only loadable (a class of the script)."""

    def __init__(self):
        self.position = Position(0)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class Position:
    def __init__(self, n):
        self.n = n


def _optimizer_flags(root):
    import warnings

    def opt_state(engine):
        return {i: {k: v.clone() for k, v in s.items()} for i, s in engine.optimizer.state_dict()["state"].items()}

    def same(a, b):
        return a.keys() == b.keys() and all(a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i])
                                            for i in a)

    out = {}
    dropout = {"resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1}  # the RNG streams decide the losses
    for fmt in ("torch_dist", "megatron_plugin"):
        acc, engine, batches = prepared_gpt2(2, model_overrides=dropout, ckpt_format=fmt)
        cursor = Cursor()
        acc.register_for_checkpointing(cursor)
        cursor.position = Position(5)
        full, slim = os.path.join(root, fmt, "full"), os.path.join(root, fmt, "slim")
        acc.save_state(full)
        acc.save_state(full)  # the same iteration again: the folder is replaced in place
        entries = sorted(os.listdir(full))
        cursor.position = Position(9)
        weights, optimizer, steps = model_weights(engine), opt_state(engine), engine.scheduler.num_steps
        next_batches = [next(batches) for _ in range(2)]
        after = [engine(**b).loss.item() for b in next_batches]
        # the default: everything back, and the run goes on as if never stopped (dropout masks included)
        acc.load_state(full)
        resumed = [engine(**b).loss.item() for b in next_batches]
        out[fmt] = {"resumed_exact": resumed == after, "after": after, "cursor": cursor.position.n, "entries": entries}

        acc2, engine2, _ = prepared_gpt2(0, model_overrides=dropout, ckpt_format=fmt, no_save_optim=True)
        acc2.load_state(full)  # loads everything: no_save_optim is about saving
        acc2.save_state(slim)
        ckpt = os.path.join(slim, sorted(os.listdir(slim))[0])
        files = sorted(os.path.relpath(os.path.join(d, f), ckpt) for d, _, fs in os.walk(ckpt) for f in fs)

        def weights_only_load(path, warning, **fields):
            """A fresh run loads `path`: its weights, whether its optimizer stayed empty, its schedule, and
            whether `warning` was given."""
            acc_n, engine_n, _ = prepared_gpt2(0, model_overrides=dropout, ckpt_format=fmt, **fields)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                acc_n.load_state(path)
            return {"weights": all(torch.equal(v, weights[k]) for k, v in model_weights(engine_n).items()),
                    "optimizer_empty": not engine_n.optimizer.state_dict()["state"],
                    "steps": engine_n.scheduler.num_steps == steps,
                    "warned": any(warning in str(w.message) for w in caught)}

        out[fmt]["no_save_optim"] = dict(weights_only_load(slim, "no optimizer state"), files=files)
        out[fmt]["no_load_optim"] = weights_only_load(full, "optimizer starts fresh", no_load_optim=True)

        acc5, engine5, _ = prepared_gpt2(0, model_overrides=dropout, ckpt_format=fmt)
        acc5.load_state(full)
        out[fmt]["optimizer_restored"] = same(opt_state(engine5), optimizer)

    # Megatron-LM's converted checkpoints: the tracker says "release", the folder is release/ (weights only)
    release = os.path.join(root, "release")
    shutil.copytree(os.path.join(root, "torch_dist", "full", "iter_0000002"), os.path.join(release, "release"))
    with open(os.path.join(release, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    acc6, engine6, _ = prepared_gpt2(0, model_overrides=dropout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = acc6.load_state(release)
    out["release"] = {"iteration": (meta["iteration"], engine6.iteration), "release": meta["release"],
                      "weights": all(torch.equal(v, weights[k]) for k, v in model_weights(engine6).items()),
                      "optimizer_empty": not engine6.optimizer.state_dict()["state"],
                      "warned": any("release checkpoint" in str(w.message) for w in caught)}
    return out


def test_no_save_optim_and_no_load_optim_in_both_formats(tmp_path):
    (res,) = run_on_ranks(_optimizer_flags, 1, str(tmp_path))
    assert res.pop("release") == {"iteration": (0, 0), "release": True, "weights": True, "optimizer_empty": True,
                                  "warned": True}
    for fmt, got in res.items():
        assert got["resumed_exact"], (fmt, got)
        assert got["cursor"] == 5, fmt  # the registered object is back as saved
        assert got["optimizer_restored"], fmt
        slim = got["no_save_optim"]
        assert slim["weights"] and slim["steps"] and slim["optimizer_empty"] and slim["warned"], (fmt, slim)
        assert got["no_load_optim"] == {"weights": True, "optimizer_empty": True, "steps": True, "warned": False}, fmt
    assert not any(f.startswith("optimizer") for f in res["megatron_plugin"]["no_save_optim"]["files"])
    assert res["torch_dist"]["entries"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]


# -- a damaged checkpoint ------------------------------------------------------------------------------
def _damaged(root):
    import torch.distributed as dist

    acc, engine, batches = _prepared(tp=2, seed=0, num_micro=1, name="tied")
    engine(**next(batches))
    good = os.path.join(root, "good")
    written = acc.save_state(good)
    before = model_weights(engine)
    out = {}

    def case(name, damage):
        folder = os.path.join(root, name)
        if dist.get_rank() == 0:
            shutil.copytree(good, folder)
            damage(os.path.join(folder, os.path.basename(written)))
        dist.barrier()
        out[name] = refusal(acc.load_state, folder)

    shard = sorted(f for f in os.listdir(written) if f.endswith(".distcp"))[-1]

    def truncate(ckpt):
        path = os.path.join(ckpt, shard)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    def flip(ckpt):
        with open(os.path.join(ckpt, shard), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(ckpt, shard)) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))

    def flip_unchecked(ckpt):  # a checkpoint Megatron-LM wrote has no checksums: sizes still catch a cut
        os.remove(os.path.join(ckpt, "megatron_plugin_checksums.json"))
        truncate(ckpt)

    case("truncated", truncate)
    case("flipped", flip)
    case("no_common", lambda ckpt: os.remove(os.path.join(ckpt, "common.pt")))
    case("truncated_unchecked", flip_unchecked)

    def dangling(ckpt):  # the tracker names a checkpoint that is gone
        with open(os.path.join(os.path.dirname(ckpt), "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("7")

    case("dangling", dangling)
    out["shard"] = shard
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in model_weights(engine).items())
    return out


def test_a_damaged_file_is_named_on_every_rank(tmp_path):
    for res in run_on_ranks(_damaged, 2, str(tmp_path)):  # returns: no rank hangs
        shard = res["shard"]
        check_refusal(res["truncated"], "load_state", os.path.join("truncated", "iter_0000001", shard), "damaged")
        check_refusal(res["flipped"], "load_state", os.path.join("flipped", "iter_0000001", shard), "CRC-32")
        check_refusal(res["no_common"], "load_state", os.path.join("no_common", "iter_0000001", "common.pt"), "lacks")
        check_refusal(res["truncated_unchecked"], "load_state",
                      os.path.join("truncated_unchecked", "iter_0000001", shard), "damaged")
        check_refusal(res["dangling"], "load_state", os.path.join("dangling", "latest_checkpointed_iteration.txt"),
                      "iter_0000007", "holds no checkpoint")
        assert res["untouched"]
