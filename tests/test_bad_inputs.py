"""Bad input, tried as a user would: each gets a clear error (the setting or file, the value, a fix)
before work is lost, or a verified correct result. Nothing trains silently wrong, nothing hangs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_plugin import MegatronLMPlugin
from tests.errors import check_refusal, expecter, refusal
from tests.launch import ROOT
from tests.models import tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks
from tests.training import optimizer_for, token_dataset


# -- the plugin ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "1.0"])
def test_gradient_clipping_must_be_finite(value):
    check_refusal(refusal(lambda: MegatronLMPlugin(gradient_clipping=value)), "gradient_clipping", "finite")


def test_gradient_clipping_nan_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEGATRON_LM_GRADIENT_CLIPPING", "nan")
    check_refusal(refusal(MegatronLMPlugin), "gradient_clipping", "nan")


def test_custom_train_step_class_as_a_string():
    assert MegatronLMPlugin(custom_train_step_class="tests.seed_custom_step.GPTTrainStepWithCustomLoss") \
        .custom_train_step_class.__name__ == "GPTTrainStepWithCustomLoss"
    assert MegatronLMPlugin(custom_train_step_class="train_steps:GPTTrainStep").custom_train_step_class.__name__ == "GPTTrainStep"
    check_refusal(refusal(lambda: MegatronLMPlugin(custom_train_step_class="no_such.Step")),
                  "custom_train_step_class", "import path")
    check_refusal(refusal(lambda: MegatronLMPlugin(custom_train_step_class="torch.nn.Linear")),
                  "custom_train_step_class", "AbstractTrainStep")


def test_world_of_zero_processes():
    check_refusal(refusal(lambda: MegatronLMPlugin().validate(world_size=0)), "num_processes", "at least one")


# -- the questionnaire and the launch config -------------------------------------------------------
def _cli(*args, stdin=""):
    proc = subprocess.run([sys.executable, "-m", "megatron_plugin.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_questionnaire_bad_answers_name_the_flag(tmp_path):
    out = str(tmp_path / "c.yaml")
    code, _, err = _cli("config", "--config_file", out, "--num_processes", "0", "--non_interactive")
    assert code == 2 and "--num_processes=0" in err and not os.path.exists(out)
    code, _, err = _cli("config", "--config_file", out, "--tp", "two", "--non_interactive")
    assert code == 2 and "--tp='two'" in err and "whole number" in err
    code, _, err = _cli("config", "--config_file", out, stdin="yes\n")  # the input ends mid-way
    assert code == 2 and "input ended" in err and "--non_interactive" in err and "Traceback" not in err
    code, _, err = _cli("config", "--config_file", str(tmp_path / "file" / "c.yaml"), "--non_interactive")
    assert code == 0  # a missing folder is made
    (tmp_path / "afile").write_text("x")
    code, _, err = _cli("config", "--config_file", str(tmp_path / "afile" / "c.yaml"), "--non_interactive")
    assert code == 2 and "--config_file" in err and "not a folder" in err and "Traceback" not in err


def test_questionnaire_cpu_turns_cuda_only_answers_off(tmp_path):
    import yaml

    out = tmp_path / "cpu.yaml"
    code, stdout, err = _cli("config", "--config_file", str(out), "--cpu", "--tp", "2", "--num_processes", "2",
                             "--non_interactive")  # bare --cpu, as the docstring shows
    assert code == 0, err
    cfg = yaml.safe_load(out.read_text())
    m = cfg["megatron_lm_config"]
    assert cfg["use_cpu"] is True and m["megatron_lm_tp_degree"] == 2
    assert not m["megatron_lm_sequence_parallelism"] and not m["megatron_lm_recompute_activations"]
    assert not m["megatron_lm_use_distributed_optimizer"] and m["megatron_lm_pp_degree"] == 1
    # interactively: after "cpu: yes" the CUDA-only questions are not asked
    code, stdout, err = _cli("config", "--config_file", str(out), stdin="yes\n2\n1\n1.0\n2\nno\n")
    assert code == 0, err
    assert "Sequence Parallelism" not in stdout and "distributed optimizer" not in stdout


def test_help_is_fast_and_quiet():
    import time

    for cmd in (["-m", "megatron_plugin.cli", "--help"], ["-m", "checkpoint_utils.convert", "--help"]):
        start = time.time()
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 0 and time.time() - start < 3, (cmd, time.time() - start)
        assert "Warning" not in proc.stderr, proc.stderr
    assert "--target_tensor_model_parallel_size 2 --target_pipeline_model_parallel_size 2" in proc.stdout  # not cut off


def test_launch_config_checks(tmp_path):
    from megatron_plugin.launch_config import check_config, load_config

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("distributed_type: MEGATRON_LM\nmegatron_lm_config:\n  megatron_lm_tp_degree: [2\n")
    check_refusal(refusal(lambda: load_config(str(bad_yaml))), "--config_file", "not valid YAML", "line")
    check_refusal(refusal(lambda: check_config({"megatron_lm_config": {"megatron_lm_tp_degre": 2}}, "c.yaml")),
                  "megatron_lm_tp_degre", "megatron_lm_tp_degree", "no effect")
    check_refusal(refusal(lambda: check_config({"num_processes": 0}, "c.yaml")), "num_processes", ">= 1")
    # `megatron-plugin launch` refuses before any process starts
    code, _, err = _cli("launch", "--config_file", str(bad_yaml), "train.py")
    assert code == 2 and "not valid YAML" in err and "Traceback" not in err


def test_misspelled_key_under_accelerate_launch(tmp_path):
    """`accelerate launch` drops unknown megatron_lm_* keys; the launched script refuses them."""
    from tests.launch import accelerate_launch

    cfg = tmp_path / "typo.yaml"
    text = open(os.path.join(ROOT, "examples", "configs", "cpu_tp2.yaml")).read()
    cfg.write_text(text.replace("megatron_lm_tp_degree: 2", "megatron_lm_tp_degre: 2").replace("num_processes: 2", "num_processes: 1"))
    with pytest.raises(AssertionError) as err:
        accelerate_launch(str(cfg), os.path.join(ROOT, "tests", "scripts", "print_plugin.py"), timeout=300)
    assert "megatron_lm_tp_degre" in str(err.value) and "did you mean 'megatron_lm_tp_degree'" in str(err.value)


def test_converter_refuses_uneven_tensor_parallel_shards(tmp_path):
    from checkpoint_utils import convert_hf_to_megatron

    tiny_gpt2(n_inner=65).save_pretrained(tmp_path / "hf")
    got = refusal(lambda: convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=2, progress=False))
    check_refusal(got, "tp_degree", "65", "divisor")
    assert not os.path.exists(tmp_path / "mg")


# -- prepare and the training step (on the launched processes) ---------------------------------------
def _prepare(plugin=None, model=None, opt=None, data=None, micro=4, mixed_precision=None):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler

    model = model if model is not None else tiny_gpt2()
    data = data if data is not None else token_dataset(16, 1000)
    opt = opt if opt is not None else optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=plugin or MegatronLMPlugin(), mixed_precision=mixed_precision)
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4), DataLoader(data, batch_size=micro))
    return acc, engine


def _prepare_errors():
    from megatron.core import parallel_state

    from tests.models import tiny_gpt2 as tiny

    out = {}
    expect = expecter(out, state=lambda name: parallel_state.model_parallel_is_initialized())

    expect("base_model", lambda: _prepare(model=tiny(lm_head=False)))
    expect("contradicting_args", lambda: _prepare(plugin=MegatronLMPlugin(other_megatron_args={"num_layers": 4})))
    for key, value in (("apply_rope_fusion", False), ("rotary_interleaved", True)):  # the rope our tables need
        expect(key, lambda: _prepare(plugin=MegatronLMPlugin(other_megatron_args={key: value}), model=tiny_llama()))
    expect("step_as_instance", lambda: _prepare(plugin=MegatronLMPlugin(custom_train_step_class=object())))
    # Megatron's TE-only switch, done here through torch's symmetric memory on CUDA: never silently ignored
    expect("tp_comm_overlap_on_cpu", lambda: _prepare(plugin=MegatronLMPlugin(other_megatron_args={"tp_comm_overlap": True})))
    expect("full_iteration_graph_on_cpu", lambda: _prepare(plugin=MegatronLMPlugin(
        other_megatron_args={"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"})))

    def missing_from_optimizer():
        model = tiny()
        left_out = model.transformer.h[1].mlp.c_fc.weight  # trainable, but the optimizer doesn't hold it
        return _prepare(model=model, opt=torch.optim.AdamW([p for p in model.parameters() if p is not left_out]))

    expect("trainable_not_in_optimizer", missing_from_optimizer)

    def warmup_too_long():
        from megatron_plugin import Accelerator, MegatronLMDummyScheduler

        model = tiny()
        opt = optimizer_for(model)
        Accelerator(megatron_lm_plugin=MegatronLMPlugin()).prepare(
            model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4, warmup_num_steps=4),
            DataLoader(token_dataset(8, 1000), batch_size=4))

    expect("warmup", warmup_too_long)
    return out


def test_prepare_refuses_before_distributed_work():
    (got,) = run_on_ranks(_prepare_errors, 1)
    expected = {
        "base_model": ("model", "no head", "GPT2LMHeadModel"),
        "contradicting_args": ("other_megatron_args['num_layers']", "gives 2"),
        "apply_rope_fusion": ("other_megatron_args['apply_rope_fusion']", "gives True", "remove the key"),
        "rotary_interleaved": ("other_megatron_args['rotary_interleaved']", "gives False", "remove the key"),
        "step_as_instance": ("custom_train_step_class", "subclass"),
        "tp_comm_overlap_on_cpu": ("other_megatron_args['tp_comm_overlap']", "symmetric memory", "remove it for a CPU run"),
        "full_iteration_graph_on_cpu": ("other_megatron_args['cuda_graph_scope']", "needs the CUDA engine",
                                        "for a CPU run"),
        "trainable_not_in_optimizer": ("optimizer", "transformer.h.1.mlp.c_fc.weight", "requires_grad_(False)"),
        "warmup": ("warmup_num_steps", "shorter than the 4"),
    }
    for name, (setting, *words) in expected.items():
        check_refusal(got[name], setting, *words)
        assert got[name][2] is False, f"{name}: raised after Megatron's groups were built"


def _step_errors(defer=False):
    acc, engine = _prepare()
    engine.train()
    if defer:  # as the CUDA engine reads the flags: after the first micro-batch's forward is queued
        engine.can_defer_batch_check = lambda: True
    good = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "attention_mask", "labels")}
    out = {}
    expect = expecter(out, keep_result=True)

    def step(batch):
        return "ok", engine(**batch).loss.item(), engine.last_step_skipped

    before = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    expect("ids_over_vocab", step, dict(good, input_ids=good["input_ids"].clone().fill_(1000)))
    expect("negative_ids", step, dict(good, input_ids=good["input_ids"].clone().fill_(-2000)))
    expect("labels_over_vocab", step, dict(good, labels=good["labels"].clone().fill_(5000)))
    expect("labels_negative", step, dict(good, labels=good["labels"].clone().fill_(-5)))
    long = torch.randint(0, 1000, (4, 40))  # 32 positions
    expect("too_long", step, {"input_ids": long, "labels": long})
    expect("no_input_ids", step, {"labels": good["labels"]})
    expect("zero_rows", step, {"input_ids": good["input_ids"][:0]})
    expect("float_ids", step, {"input_ids": good["input_ids"].float()})
    expect("rows_differ", step, dict(good, labels=good["labels"][:2]))
    expect("short_mask", step, dict(good, attention_mask=good["attention_mask"][:, :-3]))
    expect("mask_3d", step, dict(good, attention_mask=good["attention_mask"][:, None, :]))
    expect("shift_labels_shape", step, dict(good, shift_labels=good["labels"][:, 1:]))
    expect("shift_labels_over_vocab", step, dict(good, shift_labels=good["labels"].clone().fill_(1000)))
    untouched = all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in before.items())
    expect("all_ignored", step, dict(good, labels=torch.full_like(good["labels"], -100)))
    skipped_untouched = all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in before.items())
    expect("fine_after", step, good)
    return out, untouched, skipped_untouched


@pytest.mark.parametrize("defer", [False, True], ids=["read_before_step", "read_after_first_forward"])
def test_bad_batches(defer):
    for out, untouched, skipped_untouched in run_on_ranks(_step_errors, 2, defer):
        check_refusal(out["ids_over_vocab"], "input_ids", "[0, 1000)", "max 1000", "tokenizer")
        check_refusal(out["negative_ids"], "input_ids", "min -2000")
        check_refusal(out["labels_over_vocab"], "labels", "-100")
        check_refusal(out["labels_negative"], "labels", "-100")
        check_refusal(out["too_long"], "sequence length", "40 > 32")
        check_refusal(out["no_input_ids"], "batch", "input_ids")
        check_refusal(out["zero_rows"], "input_ids", "at least one row")
        check_refusal(out["float_ids"], "input_ids", "integer")
        check_refusal(out["rows_differ"], "labels", "4 rows")
        check_refusal(out["short_mask"], "attention_mask", "padding mask", "1 for a token")
        check_refusal(out["mask_3d"], "attention_mask", "padding mask", "1 for a token")
        check_refusal(out["shift_labels_shape"], "shift_labels", "(4, 15)", "shaped like input_ids")
        check_refusal(out["shift_labels_over_vocab"], "shift_labels", "-100")
        assert untouched  # none of the refused batches moved a weight
        status, loss, skipped = out["all_ignored"]
        assert status == "ok" and loss != loss and skipped and skipped_untouched  # nan, skipped, weights kept
        status, loss, skipped = out["fine_after"]
        assert status == "ok" and loss == loss and not skipped


def _counting_reads(fn):
    """fn() with every host read of a tensor's value counted (each is a sync on a GPU)."""
    reads = dict.fromkeys(("tolist", "item", "__bool__", "__int__", "__float__"), 0)
    own = {name: torch.Tensor.__dict__.get(name) for name in reads}

    def counting(name, read):
        def counted(self, *args, **kwargs):
            reads[name] += 1
            return read(self, *args, **kwargs)
        return counted

    for name in reads:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        return fn(), reads
    finally:
        for name, read in own.items():
            if read is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, read)


def _check_reads():
    """How often the batch check reads device values back on the host, for a good batch."""
    acc, engine = _prepare()
    engine.train()
    batch = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "labels")}
    return _counting_reads(lambda: engine.check_batch(batch, engine.train_step_handler))


def test_batch_check_reads_the_device_once():
    """Each read is a host-device sync that drains the GPU's queue before the step: one for all flags."""
    for ok, reads in run_on_ranks(_check_reads, 2):
        assert ok
        assert reads == {"tolist": 1, "item": 0, "__bool__": 0, "__int__": 0, "__float__": 0}, reads


def _mask_reads(key, padded):
    """Reads in a whole step of 2 micro-batches whose batch has an attention mask or position ids; the
    loss too, against the same batch given to the engine without its all-ones mask / plain positions."""
    acc, engine = _prepare(plugin=MegatronLMPlugin(num_micro_batches=2), micro=2)
    engine.train()
    batch = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "labels")}
    rows, seq = batch["input_ids"].shape
    if key == "attention_mask":
        batch[key] = torch.ones(rows, seq, dtype=torch.long)
        if padded:
            batch[key][3, seq // 2:] = 0
    else:
        batch[key] = torch.arange(seq).repeat(rows, 1)
        if padded:  # two sequences packed into row 3
            batch[key][3, seq // 2:] -= seq // 2
    engine.eval()  # no update between the two losses
    plain = engine(**{k: v for k, v in batch.items() if k == "input_ids" or k == "labels"}).loss.item()
    loss, reads = _counting_reads(lambda: engine(**batch).loss)
    return reads, plain, loss.item()


@pytest.mark.parametrize("key", ["attention_mask", "position_ids"])
def test_masks_and_positions_are_read_with_the_batch_check(key):
    """Whether a micro-batch's mask pads, or its positions pack sequences, decides the attention path
    on the host. The batch check reads that once for every micro-batch, with its own flags, instead of
    once per micro-batch in the train step."""
    (reads, plain, loss), = run_on_ranks(_mask_reads, 1, key, False)
    assert reads["tolist"] == 1 and reads["__bool__"] == 0, reads
    assert loss == plain  # all ones / plain positions: the same (flash) path as without the key
    (reads, plain, loss), = run_on_ranks(_mask_reads, 1, key, True)
    assert reads["tolist"] == 1 and reads["__bool__"] == 0, reads
    assert loss != plain  # the padding / packing was seen (the same path would give the same bits)


def _one_rank_bad_batch(defer=False):
    """Only rank 1's batch is bad: both ranks must raise (no rank left waiting in a collective)."""
    import torch.distributed as dist

    acc, engine = _prepare(plugin=MegatronLMPlugin(), micro=2)
    engine.train()
    if defer:
        engine.can_defer_batch_check = lambda: True
    batch = {k: torch.stack([d[k] for d in token_dataset(2, 1000)]) for k in ("input_ids", "labels")}
    if dist.get_rank() == 1:
        batch["labels"][0, 3] = 7777
    got = refusal(engine, **batch)
    return None if got is None else got[1]


@pytest.mark.parametrize("defer", [False, True], ids=["read_before_step", "read_after_first_forward"])
def test_a_bad_batch_on_one_rank_stops_all_ranks(defer):
    got = run_on_ranks(_one_rank_bad_batch, 2, defer)
    assert "this rank's batch" in got[1] and "another rank's batch" in got[0]


def _rank_batches(tp, differ, defer=False):
    """Two ranks at TP=`tp` (else DP=2), each generating its own rows: with `differ`, seeded by its rank
    (as a script without a shared seed would). Returns (refusal, weights untouched), or (loss, skipped)."""
    import torch.distributed as dist

    acc, engine = _prepare(plugin=MegatronLMPlugin(tp_degree=tp), micro=4)
    engine.train()
    if defer:
        engine.can_defer_batch_check = lambda: True
    data = token_dataset(4, 1000, seed=10 + (dist.get_rank() if differ else 0))
    batch = {k: torch.stack([d[k] for d in data]) for k in ("input_ids", "attention_mask", "labels")}
    before = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    got = refusal(engine, **batch)
    if got is not None:
        return got, all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in before.items())
    return engine(**batch).loss.item(), engine.last_step_skipped


@pytest.mark.parametrize("defer", [False, True], ids=["read_before_step", "read_after_first_forward"])
def test_tensor_parallel_ranks_given_different_batches_are_refused(defer):
    """TP ranks compute one model: given different batches they would train on a mixture of both. Every
    rank refuses, before any weight moves; the same batch trains; data-parallel ranks may differ."""
    for got, untouched in run_on_ranks(_rank_batches, 2, 2, True, defer):
        check_refusal(got, "batch", "tensor-parallel ranks were given different batches", "tp rank 1",
                      "the same batch on every rank", "DataLoader", "seed", exact=True)
        assert untouched
    same = run_on_ranks(_rank_batches, 2, 2, False, defer)
    assert same[0] == same[1] and same[0][0] == same[0][0] and not same[0][1], same  # one finite loss, trained
    dp = run_on_ranks(_rank_batches, 2, 1, True, defer)
    assert dp[0] == dp[1] and dp[0][0] == dp[0][0] and not dp[0][1], dp  # DP-averaged loss, no refusal


def _checksum_collisions():
    """The batch checksum of batches that differ a little: a row swap, one token, one mask bit, a
    label moved to another key, one more column."""
    from megatron_plugin.engine.batch_check import batch_checksum

    ids = torch.arange(32).reshape(4, 8) * 37 % 1000
    base = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    variants = [
        dict(base, input_ids=ids[[1, 0, 2, 3]]),
        dict(base, input_ids=ids.clone().index_put_((torch.tensor(2), torch.tensor(5)), torch.tensor(999))),
        dict(base, attention_mask=torch.ones_like(ids).index_put_((torch.tensor(3), torch.tensor(7)), torch.tensor(0))),
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "shift_labels": ids.clone()},
        dict(base, input_ids=torch.cat([ids, ids[:, :1]], 1)),
        dict(base, labels=ids.clone().fill_(-100)),
        dict(base, input_ids=ids + 2**40),  # beyond any vocabulary: still exact
    ]
    sums = [int(batch_checksum(b)) for b in [base] + variants]
    return sums, int(batch_checksum(dict(base))), int(batch_checksum({k: v.int() for k, v in base.items()}))


def test_batch_checksum_tells_batches_apart():
    sums, again, as_int32 = _checksum_collisions()
    assert len(set(sums)) == len(sums), sums
    assert again == sums[0] == as_int32  # the same values give the same sum, whatever the integer type
    assert all(0 <= s < 2**31 for s in sums)  # summed over thousands of ranks in int64 without overflow


def _labels_shaped_unlike_ids(one_rank):
    """GPT labels one token short of input_ids (on both ranks, or on rank 1 only)."""
    import torch.distributed as dist

    acc, engine = _prepare(plugin=MegatronLMPlugin(), micro=4)
    engine.train()
    batch = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "labels")}
    if not one_rank or dist.get_rank() == 1:
        batch["labels"] = batch["labels"][:, 1:]
    out = {}
    expect = expecter(out)
    expect("step", engine, **batch)
    expect("log_probs", engine.compute_log_probs, batch)
    return out


def test_labels_shaped_unlike_input_ids():
    for got in run_on_ranks(_labels_shaped_unlike_ids, 2, False):
        for case in ("step", "log_probs"):
            check_refusal(got[case], "batch['labels']", "(4, 15)", "(4, 16)", "one label per token", exact=True)
    got = run_on_ranks(_labels_shaped_unlike_ids, 2, True)  # only rank 1's: both ranks stop, none hangs
    check_refusal(got[1]["step"], "batch['labels']", "(4, 15)")
    check_refusal(got[0]["step"], "batch", "another rank", exact=True)


def _bert_and_t5_label_shapes():
    from tests.models import tiny_bert, tiny_t5
    from tests.training import mlm_dataset, seq2seq_dataset

    out = {}
    expect = expecter(out, keep_result=True)
    data = mlm_dataset(4, 333)
    acc, engine = _prepare(model=tiny_bert("bert", "mlm"), data=data, micro=4)
    engine.train()
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    expect("bert", engine, **dict(batch, labels=batch["labels"][:, :-2]))
    data = seq2seq_dataset(4, 99)
    acc, engine = _prepare(model=tiny_t5(), data=data, micro=4)
    engine.train()
    batch = {k: torch.stack([d[k] for d in data]) for k in data[0]}
    assert batch["labels"].shape != batch["input_ids"].shape  # decoder-side: a valid T5 batch
    expect("t5", lambda: engine(**batch).loss.item())
    expect("t5_decoder_mask", engine, **dict(batch, decoder_attention_mask=batch["decoder_attention_mask"][:, :-1]))
    return out


def test_bert_and_t5_label_shapes():
    (got,) = run_on_ranks(_bert_and_t5_label_shapes, 1)
    check_refusal(got["bert"], "batch['labels']", "(4, 14)", "(4, 16)", exact=True)
    assert got["t5"] == got["t5"] and isinstance(got["t5"], float), got  # T5 labels need not be input_ids' length
    check_refusal(got["t5_decoder_mask"], "batch['decoder_attention_mask']", "(4, 7)", "(4, 8)", exact=True)


def _backward_on_the_returned_loss():
    """A script calling loss.backward() on the loss the step returned (the step already ran backward)."""
    import warnings

    acc, engine = _prepare(plugin=MegatronLMPlugin(), micro=4)
    engine.train()
    batch = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "labels")}
    loss = engine(**batch).loss
    value = loss.item()
    after_step = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.backward()
        loss.backward()  # again: harmless
        acc.backward(loss)  # the right call: a no-op, silent
        unchanged = all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in after_step.items())
        grads = [n for n, p in engine.named_parameters() if p.grad is not None]
        second = engine(**batch).loss
        second.backward()  # a later step's: the warning was given once
        moved = not all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in after_step.items())
    return dict(messages=[str(w.message) for w in caught if "backward" in str(w.message)], value=value,
                item=loss.item(), detached=loss.detach().item(), as_float=float(loss), unchanged=unchanged,
                grads=grads, moved=moved, second=second.item())


def test_loss_backward_on_the_returned_loss_warns_once():
    for got in run_on_ranks(_backward_on_the_returned_loss, 2):
        assert len(got["messages"]) == 1, got["messages"]
        assert "accelerator.backward" in got["messages"][0] and "already" in got["messages"][0], got["messages"]
        assert got["item"] == got["detached"] == got["as_float"] == got["value"]  # the value is the step's
        assert got["unchanged"] and got["grads"] == [], got  # loss.backward() changed no weight, left no grad
        assert got["moved"] and got["second"] == got["second"] and got["second"] != got["value"]  # training goes on


# -- checkpoints ---------------------------------------------------------------------------------------
def _save_into(path):
    acc, engine = _prepare(plugin=MegatronLMPlugin(tp_degree=2), micro=4)
    return refusal(acc.save_state, path)


def test_save_state_into_a_file_path_is_refused_on_every_rank(tmp_path):
    (tmp_path / "f").write_text("not a folder")
    for got in run_on_ranks(_save_into, 2, str(tmp_path / "f")):
        check_refusal(got, "save_state(output_dir)", "not a folder")
    for got in run_on_ranks(_save_into, 2, str(tmp_path / "f" / "sub")):
        check_refusal(got, "save_state(output_dir)", "is a file")


def _save_then_load(save_dir, damage, tp=2):
    import shutil

    acc, engine = _prepare(plugin=MegatronLMPlugin(tp_degree=tp, ckpt_format="megatron_plugin"))
    engine.train()
    batch = {k: torch.stack([d[k] for d in token_dataset(4, 1000)]) for k in ("input_ids", "labels")}
    engine(**batch)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    dist.barrier()
    ckpt = acc.save_state(save_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        damage(ckpt)
    dist.barrier()
    return refusal(acc.load_state, save_dir)


def _flip_byte(ckpt):
    path = os.path.join(ckpt, "model", "tp01_pp000.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0x01  # one bit of one weight
    open(path, "wb").write(bytes(data))


def _truncate(ckpt):
    path = os.path.join(ckpt, "model", "tp00_pp000.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _garble_meta(ckpt):
    with open(os.path.join(ckpt, "meta.json"), "w") as f:
        f.write('{"format": "megatron_plugin/1", "iter')


def _other_model(ckpt):
    """The shard of a model with a wider MLP, with a matching checksum (a consistent, other model)."""
    from safetensors.torch import load_file, save_file

    from megatron_plugin.fs import file_checksum

    path = os.path.join(ckpt, "model", "tp00_pp000.safetensors")
    tensors = load_file(path)
    tensors["decoder.layers.0.mlp.linear_fc1.weight"] = torch.zeros(300, 64)
    save_file(tensors, path)
    meta_path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(meta_path))
    meta["files"]["model/tp00_pp000.safetensors"] = file_checksum(path)
    json.dump(meta, open(meta_path, "w"))


@pytest.mark.parametrize("damage,words", [
    (_flip_byte, ("tp01_pp000.safetensors", "damaged", "CRC-32")),
    (_truncate, ("tp00_pp000.safetensors", "damaged")),
    (_garble_meta, ("meta.json", "cannot read")),
    (_other_model, ("tp00_pp000.safetensors", "decoder.layers.0.mlp.linear_fc1.weight", "another model size")),
], ids=["flipped_byte", "truncated_shard", "corrupt_meta", "other_model_size"])
def test_damaged_checkpoints_are_refused_naming_the_file(tmp_path, damage, words):
    results = run_on_ranks(_save_then_load, 2, str(tmp_path / "ckpt"), damage)
    for got in results:  # every rank raises, so none waits
        check_refusal(got, "load_state", *words)


# -- accelerate's own Accelerator under a Megatron config -------------------------------------------
def _accelerate_accelerator():
    import os

    os.environ["ACCELERATE_USE_MEGATRON_LM"] = "true"
    from accelerate import Accelerator

    import megatron_plugin

    megatron_plugin.MegatronLMDummyScheduler  # the script imports something of ours
    try:
        Accelerator()
    except ImportError as err:
        return str(err)
    return None


def test_accelerate_accelerator_under_megatron_config_says_what_to_import():
    (msg,) = run_on_ranks(_accelerate_accelerator, 1)
    assert msg and "from megatron_plugin import Accelerator" in msg


# -- the Llama family ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,tp,setting,words", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 1, "rope_scaling", ("'dynamic'", "supported")),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}), 1,
     "rope_scaling", ("'yarn'",)),
    (dict(hidden_act="gelu"), 1, "hidden_act", ("SwiGLU",)),
    (dict(attention_bias=True), 1, "attention_bias/mlp_bias", ("Qwen2",)),
    (dict(num_key_value_heads=4), 16, "tp_degree", ("8 attention heads",)),
    (dict(), 3, "tp_degree", ("8 attention heads",)),
    (dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=96), 2, "tp_degree", ("3 key/value heads",)),
    (dict(intermediate_size=90), 4, "tp_degree", ("MLP width 90",)),
], ids=["rope_dynamic", "rope_yarn", "gelu", "o_proj_bias_only", "tp_over_heads", "tp3", "kv_heads_3_tp2", "ffn_90_tp4"])
def test_llama_family_bad_configs(overrides, tp, setting, words):
    from megatron_plugin.models import check_model
    from tests.models import llama_config

    cfg = llama_config("llama", **overrides)
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(tp_degree=tp), cfg)), setting, *words)


def test_sliding_window_on_some_layers_only_is_refused():
    from megatron_plugin.models import check_model
    from tests.models import llama_config

    cfg = llama_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(), cfg)), "layer_types", "some layers only")
    every = llama_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert check_model(MegatronLMPlugin(), every).sliding_window(every) == 4  # on every layer: mapped


# -- BERT and T5 ----------------------------------------------------------------------------------------
def test_bert_and_t5_unmapped_variants_are_refused():
    from transformers import BertConfig, T5Config, T5EncoderModel

    from megatron_plugin.models import check_model, get_family

    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(), BertConfig(position_embedding_type="relative_key"))),
                  "position_embedding_type", "absolute")
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(), BertConfig(is_decoder=True))),
                  "is_decoder", "encoder")
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(), BertConfig(hidden_act="silu"))), "hidden_act", "gelu")
    bert_sp = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True)
    check_refusal(refusal(lambda: check_model(bert_sp, BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64),
                                              world_size=2)), "sequence_parallelism", "BertLMHead")
    t5 = T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(pp_degree=2), t5)), "pp_degree", "encoder-decoder")
    encoder_only = T5EncoderModel(t5)
    check_refusal(refusal(lambda: get_family(t5).variant_of(encoder_only)), "model", "T5ForConditionalGeneration")


def _nsp_without_binary_head():
    from tests.models import tiny_bert
    from tests.training import mlm_dataset

    data = mlm_dataset(8, 333, nsp=True)
    model = tiny_bert("bert", "mlm")
    acc, engine = _prepare(model=model, data=data, micro=4)
    engine.train()
    batch = {k: torch.stack([d[k] for d in data[:4]]) for k in data[0]}
    return refusal(engine, **batch)


def test_nsp_labels_without_a_binary_head():
    for got in run_on_ranks(_nsp_without_binary_head, 2):
        check_refusal(got, "next_sentence_label", "ForPreTraining")


# -- mixture of experts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,overrides,settings,world,setting,words", [
    ("mixtral", {}, dict(expert_model_parallel_size=3), 3, "expert_model_parallel_size", ("8 experts", "divisor")),
    ("mixtral", {}, dict(expert_model_parallel_size=2), 3, "expert_model_parallel_size",
     ("world size 3", "expert_tensor_parallel_size x expert_model_parallel_size x pp_degree")),
    ("qwen3_moe", {}, dict(tp_degree=2, expert_model_parallel_size=2), 2, "expert_model_parallel_size",
     ("world size 2", "2 x 2 x 1 = 4")),
    ("qwen2_moe", {}, dict(other_megatron_args={"moe_expert_capacity_factor": 0.0}), 1,
     "other_megatron_args['moe_expert_capacity_factor']", ("> 0", "dropless")),
    ("qwen2_moe", {}, dict(other_megatron_args={"moe_expert_capacity_factor": -1.0}), 1,
     "other_megatron_args['moe_expert_capacity_factor']", ("> 0",)),
    ("mixtral", dict(router_jitter_noise=0.1), {}, 1, "router_jitter_noise", ("not mapped", "0.0")),
    ("qwen3_moe", dict(output_router_logits=True), dict(pp_degree=2), 2, "other_megatron_args['moe_aux_loss_coeff']",
     ("all layers", "pp_degree=1")),
    ("qwen3_moe", {}, dict(pp_degree=2, other_megatron_args={"moe_aux_loss_coeff": 0.01}), 2,
     "other_megatron_args['moe_aux_loss_coeff']", ("all layers",)),
    ("qwen3_moe", {}, dict(pp_degree=2, other_megatron_args={"moe_z_loss_coeff": 0.001}), 2,
     "other_megatron_args['moe_z_loss_coeff']", ("one pipeline stage", "pp_degree=1")),
    ("qwen3_moe", {}, dict(tp_degree=2, expert_tensor_parallel_size=5), 10, "expert_tensor_parallel_size",
     ("MLP width 24",)),
    ("qwen3_moe", {}, dict(other_megatron_args={"moe_token_dispatcher_type": "alltoall"}), 1,
     "other_megatron_args['moe_token_dispatcher_type']", ("remove the key",)),
], ids=["ep_not_dividing_experts", "world_not_divisible", "world_not_divisible_tp_ep", "capacity_zero",
        "capacity_negative", "jitter", "hf_aux_loss_with_pp", "aux_loss_with_pp", "z_loss_with_pp", "etp_not_dividing_width",
        "other_dispatcher"])
def test_moe_bad_configs(name, overrides, settings, world, setting, words):
    from megatron_plugin.models import check_model, check_moe_training
    from tests.models import moe_config

    cfg = moe_config(name, **overrides)

    def prepare_checks():  # what resolve runs on the model before any process group
        plugin = MegatronLMPlugin(**settings)
        check_model(plugin, cfg, world_size=world)
        check_moe_training(plugin, cfg)

    check_refusal(refusal(prepare_checks), setting, *words)


def test_moe_top1_router_dense_expert_tp_and_conversion_with_pp():
    """A renormalized top-1 router (megatron-core's config refuses it later, with a Megatron-LM flag name);
    an expert TP size on a dense model; router losses with PP refused for training but not for an offline
    conversion, which trains nothing (check_model alone)."""
    from transformers import LlamaConfig

    from megatron_plugin.models import check_model
    from tests.models import moe_config

    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(), moe_config("mixtral", num_experts_per_tok=1))),
                  "num_experts_per_tok", "norm_topk_prob=False")
    check_model(MegatronLMPlugin(), moe_config("qwen2_moe", num_experts_per_tok=1, norm_topk_prob=False))
    dense = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(expert_tensor_parallel_size=2, tp_degree=1), dense,
                                              world_size=2)), "expert_tensor_parallel_size", "no experts")
    check_model(MegatronLMPlugin(pp_degree=2), moe_config("qwen2_moe", output_router_logits=True), world_size=2)


def test_moe_training_refusals():
    """For training (resolve), not for conversion: a pipeline stage without an MoE layer would never enter
    the expert gradient norm's all-reduce (a hang); full recompute runs the routers under no_grad, so the
    router losses would train nothing."""
    from megatron_plugin.models import check_model, check_moe_training
    from tests.models import moe_config

    qwen2 = moe_config("qwen2_moe")  # layer 0 MoE, layer 1 dense (mlp_only_layers)
    check_model(MegatronLMPlugin(pp_degree=2), qwen2, world_size=2)  # converting it to PP=2 is fine
    check_refusal(refusal(lambda: check_moe_training(MegatronLMPlugin(pp_degree=2), qwen2)), "pp_degree",
                  "stage 1 would hold only dense layers")
    check_moe_training(MegatronLMPlugin(pp_degree=2), moe_config("qwen3_moe"))  # every layer MoE
    aux = moe_config("qwen2_moe", output_router_logits=True)
    check_refusal(refusal(lambda: check_moe_training(MegatronLMPlugin(recompute_granularity="full"), aux)),
                  "recompute_granularity", "outside activation recompute")
    check_moe_training(MegatronLMPlugin(recompute_activations=True), aux)  # selective: attention only
    check_moe_training(MegatronLMPlugin(recompute_granularity="full"), moe_config("qwen2_moe"))  # no router loss


def test_moe_settings_that_fit_are_taken():
    """The refusals above stop where the layout fits: the same settings on a world that fits pass, and the
    aux-loss coefficient defaults to HF's only when the config asks for router logits."""
    from megatron_plugin.models import check_model
    from tests.models import moe_config

    cfg = moe_config("qwen3_moe")
    check_model(MegatronLMPlugin(tp_degree=2, expert_model_parallel_size=2), cfg, world_size=4)
    check_model(MegatronLMPlugin(tp_degree=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1), cfg,
                world_size=2)
    check_model(MegatronLMPlugin(pp_degree=2, other_megatron_args={"moe_expert_capacity_factor": 1.5}), cfg, world_size=2)
    family = check_model(MegatronLMPlugin(), moe_config("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.02))
    assert family.transformer_config(moe_config("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.02))[
        "moe_aux_loss_coeff"] == 0.02
    assert family.transformer_config(moe_config("qwen2_moe"))["moe_aux_loss_coeff"] == 0.0
    # Qwen's dense layers (mlp_only_layers, decoder_sparse_step) are HF's: its layers' MLP classes say which
    from transformers import AutoModelForCausalLM

    from megatron_plugin.models.moe import moe_layers

    for overrides in (dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[]),
                      dict(num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[0, 3])):
        cfg = moe_config("qwen2_moe", **overrides)
        hf = AutoModelForCausalLM.from_config(cfg)
        assert moe_layers(cfg) == [int(hasattr(layer.mlp, "experts")) for layer in hf.model.layers], overrides
        assert 0 < sum(moe_layers(cfg)) < 4


def test_expert_parallel_on_a_dense_model_is_refused():
    from megatron_plugin.models import check_model
    from tests.models import llama_config

    check_refusal(refusal(lambda: check_model(MegatronLMPlugin(expert_model_parallel_size=2), llama_config("llama"),
                                              world_size=2)), "expert_model_parallel_size", "no experts")


def test_moe_with_tensor_parallel_trains_only_with_sequence_parallel():
    """megatron-core's MoE layer refuses TP > 1 without SP in training: prepare says so before any group."""
    from megatron_plugin.resolve import Inputs, resolve
    from tests.models import tiny_moe

    model = tiny_moe("qwen3_moe")
    loader = DataLoader(token_dataset(4, model.config.vocab_size), batch_size=2)
    inputs = Inputs(model=model, optimizer=optimizer_for(model), scheduler=None, loaders=(loader,), indexed=())
    got = refusal(lambda: resolve(inputs, MegatronLMPlugin(tp_degree=2), world_size=2, device_type="cuda",
                                  mixed_precision="no"))
    check_refusal(got, "sequence_parallelism", "sequence_parallelism=True", "expert_model_parallel_size")


# -- context parallelism ----------------------------------------------------------------------------------
def _t5_config():
    from transformers import T5Config

    return T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)


def _bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _moe_config(name):
    from tests.models import moe_config

    return lambda: moe_config(name)


@pytest.mark.parametrize("config,words", [
    (_bert_config, ("bert", "bidirectional", "context_parallel_size=1", "GPT-2, Llama")),
    (_t5_config, ("t5", "encoder-decoder", "cross-attention", "context_parallel_size=1")),
    (_moe_config("mixtral"),
     ("mixture-of-experts", "mixtral", "not combined over the context-parallel ranks", "context_parallel_size=1")),
    (_moe_config("qwen3_moe"), ("mixture-of-experts", "qwen3_moe", "context_parallel_size=1")),
], ids=["bert", "t5", "mixtral", "qwen3_moe"])
def test_context_parallel_refused_for_families_it_does_not_split(config, words):
    """BERT and T5 (bidirectional / encoder-decoder attention) and the MoE families are refused by name at
    CP > 1 in check_model, which resolve runs before any process group; at CP = 1 they pass."""
    from megatron_plugin.models import check_model

    cfg = config()
    got = refusal(lambda: check_model(MegatronLMPlugin(context_parallel_size=2), cfg, world_size=2))
    check_refusal(got, "context_parallel_size", "=2", *words, exact=True)
    assert refusal(lambda: check_model(MegatronLMPlugin(), cfg, world_size=2)) is None


def test_context_parallel_taken_by_causal_families_and_checked_against_the_world():
    from megatron_plugin.models import check_model
    from tests.models import gpt2_config, llama_config

    for cfg in (gpt2_config(), llama_config("llama"), llama_config("mistral"), llama_config("qwen2"),
                llama_config("qwen3")):
        assert check_model(MegatronLMPlugin(context_parallel_size=2, tp_degree=2), cfg, world_size=8) is not None
    got = refusal(lambda: check_model(MegatronLMPlugin(context_parallel_size=2, tp_degree=2), gpt2_config(),
                                      world_size=6))
    check_refusal(got, "tp_degree*context_parallel_size*pp_degree", "2*2*1=4", "world size 6", "multiple of 4",
                  exact=True)
    got = refusal(lambda: MegatronLMPlugin(context_parallel_size=2, custom_model_provider_function=lambda *a: None))
    check_refusal(got, "context_parallel_size", "custom_model_provider_function", "context_parallel_size=1", exact=True)
    got = refusal(lambda: MegatronLMPlugin(context_parallel_size=2, custom_get_batch_function=lambda it: next(it)))
    check_refusal(got, "custom_get_batch_function", "two chunks", "global positions", "context_parallel_size=1",
                  exact=True)

    def loss(loss_mask, output):
        return output.sum(), {}

    got = refusal(lambda: MegatronLMPlugin(context_parallel_size=2, custom_loss_function=loss))
    check_refusal(got, "custom_loss_function", "calculate_per_token_loss=True", "(loss sum, token count, logs)",
                  exact=True)
    # (sum, count) is weighed over DP x CP by the engine: taken; and every hook at CP=1
    assert MegatronLMPlugin(context_parallel_size=2, custom_loss_function=loss, calculate_per_token_loss=True)
    assert MegatronLMPlugin(custom_loss_function=loss, custom_get_batch_function=lambda it: next(it))

    # a custom step must shift over the whole sequence before the split: GPT steps do, others say how
    from train_steps import AbstractTrainStep, GPTTrainStep

    class OwnStep(AbstractTrainStep):
        pass

    class OwnSplit(AbstractTrainStep):
        def before_sequence_split(self, micro_batch):
            return micro_batch

    class MyGPT(GPTTrainStep):
        pass

    got = refusal(lambda: MegatronLMPlugin(context_parallel_size=2, custom_train_step_class=OwnStep))
    check_refusal(got, "custom_train_step_class", "OwnStep", "GPTTrainStep", "before_sequence_split",
                  "context_parallel_size=1", exact=True)
    for ok in (OwnSplit, MyGPT):
        assert MegatronLMPlugin(context_parallel_size=2, custom_train_step_class=ok)
    assert MegatronLMPlugin(custom_train_step_class=OwnStep)


def test_context_parallel_sequence_length_rule():
    """A sequence must cut into 2 x CP chunks (and, under SP, each rank's 2 chunks over TP): the batch check
    refuses any other length naming the length, CP and the multiple to pad to."""
    from types import SimpleNamespace

    from megatron_plugin.engine.batch_check import (Findings, context_parallel_error, sequence_multiple,
                                                    sequence_parallel_error)

    def found(length, tp, cp, sp=False):
        ids = torch.zeros(2, length, dtype=torch.long)
        return Findings({"input_ids": ids}, ["input_ids"], [], {}, 1000, None, length, 0, layout=(tp, cp, 1),
                        sequence_parallel=sp)

    def errors(length, tp, cp, sp=False):
        f = found(length, tp, cp, sp)
        err = context_parallel_error(f) or sequence_parallel_error(f, SimpleNamespace(sequence_parallelism=sp))
        return None if err is None else (err.setting, str(err))

    assert [sequence_multiple((tp, cp, 1), sp) for tp, cp, sp in (
        (1, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (2, 2, True), (4, 2, True), (2, 3, True), (4, 3, True))
    ] == [1, 2, 4, 4, 4, 8, 6, 12]
    for length, tp, cp, sp in ((16, 1, 2, False), (12, 2, 2, True), (24, 4, 2, True), (12, 1, 3, False), (30, 1, 1, False)):
        assert errors(length, tp, cp, sp) is None, (length, tp, cp, sp)
    check_refusal(errors(14, 1, 2), "context_parallel_size", "=2", "sequence length 14 of 'input_ids'",
                  "2 x context_parallel_size = 4", "pad_to_multiple_of=4", "-100", exact=True)
    check_refusal(errors(16, 1, 3), "context_parallel_size", "=3", "sequence length 16", "= 6", "pad_to_multiple_of=6",
                  exact=True)
    # CP fits, SP's split of each rank's 2 chunks over TP does not: named with both degrees and the multiple
    check_refusal(errors(12, 4, 2, True), "sequence_parallelism", "sequence length 12",
                  "tp_degree x context_parallel_size = 8", "pad_to_multiple_of=8", exact=True)
    check_refusal(errors(10, 4, 2, True), "context_parallel_size", "sequence length 10", "pad_to_multiple_of=8", exact=True)
    check_refusal(errors(15, 2, 1, True), "sequence_parallelism", "multiple of tp_degree=2", "pad_to_multiple_of=2",
                  exact=True)

    # what the engine splits is each micro-batch's input_ids after the step's before_sequence_split: DPO's two
    # sides joined (padded to the longer), and a micro-batch already split counts by its whole length
    from megatron_plugin.layers.context_parallel import SHARD, SequenceShard, cp_index

    def dpo(chosen, rejected, joined):
        batch = {"chosen_input_ids": torch.zeros(2, chosen, dtype=torch.long),
                 "rejected_input_ids": torch.zeros(2, rejected, dtype=torch.long)}
        f = Findings(batch, sorted(batch), [], {}, 1000, None, max(chosen, rejected), 0, layout=(1, 2, 1))
        f.micro_batches = [dict(batch, input_ids=torch.zeros(4, joined, dtype=torch.long))]
        return context_parallel_error(f)

    assert dpo(6, 8, 8) is None
    check_refusal((dpo(6, 6, 6).setting, str(dpo(6, 6, 6))), "context_parallel_size",
                  "sequence length 6 of 'chosen_input_ids and rejected_input_ids (joined)'", "pad_to_multiple_of=4")
    split = found(16, 1, 2)
    local = torch.zeros(2, 8, dtype=torch.long)
    setattr(local, SHARD, SequenceShard(2, 0, None, 16, cp_index(16, 2, 0)))
    split.micro_batches = [{"input_ids": local}]
    assert context_parallel_error(split) is None  # 8 local tokens of a whole 16


def _context_parallel_lengths():
    """CP=2 on two ranks, or DP=2 x CP=2 on four with only data-parallel replica 1 given a bad length: every
    rank refuses before any forward, the weights stay; then a good batch trains."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    acc, engine = _prepare(plugin=MegatronLMPlugin(context_parallel_size=2), micro=2)
    engine.train()
    data = token_dataset(2, 1000, seed=5)
    good = {k: torch.stack([d[k] for d in data]) for k in ("input_ids", "attention_mask", "labels")}
    short = {k: v[:, :14] for k, v in good.items()}  # 14: not a multiple of 2 x CP = 4
    whole_world = dist.get_world_size() == 2
    bad = short if whole_world or parallel_state.get_data_parallel_rank() == 1 else good
    before = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    out = {"refused": refusal(engine, **bad)}
    engine.can_defer_batch_check = lambda: True  # as the CUDA engine reads the flags
    out["refused_deferred"] = refusal(engine, **bad)
    out["untouched"] = all(torch.equal(v, engine.hf_state_dict()[k]) for k, v in before.items())
    out["bad_here"] = bad is short
    loss = engine(**good).loss.item()
    out["trained"] = loss == loss and not engine.last_step_skipped
    return out


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "dp2_cp2_one_replica_bad"])
def test_context_parallel_length_not_a_multiple_of_2cp_is_refused_on_every_rank(world):
    for rank, out in enumerate(run_on_ranks(_context_parallel_lengths, world)):
        for key in ("refused", "refused_deferred"):
            if out["bad_here"]:
                check_refusal(out[key], "context_parallel_size", "=2", "sequence length 14",
                              "2 x context_parallel_size = 4", "pad_to_multiple_of=4", exact=True, where=(rank, key))
            else:  # the other replica's batch: refused all the same, nobody is left waiting in a collective
                check_refusal(out[key], "batch", "another rank's batch", exact=True, where=(rank, key))
        assert out["untouched"] and out["trained"], (rank, out)
