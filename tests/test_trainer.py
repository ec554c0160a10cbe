"""`megatron_plugin.integrations.Trainer`: HF Trainer's loop on Megatron parallelism, held to plain
transformers.Trainer in one process (same seed, data, global batch) on a tiny Llama (CPU, gloo)."""

import os
import tempfile

import pytest
import torch

from megatron_plugin.errors import MegatronPluginConfigError
from tests.models import tiny_llama
from tests.spawn import run_on_ranks
from tests.training import token_dataset

STEPS = 20
LR = 3e-3
VOCAB = 333


def _arguments(out_dir, micro, accumulation, steps=STEPS, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=out_dir, per_device_train_batch_size=micro, per_device_eval_batch_size=micro,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=LR, warmup_steps=3,
        lr_scheduler_type="cosine", weight_decay=0.1, adam_beta2=0.99, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _logged(trainer):
    """(loss, learning rate, grad norm) of every logged training step, and the eval losses."""
    train = [(h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    evals = [(h["eval_loss"], h.get("eval_rows"), h.get("eval_label_logit"))
             for h in trainer.state.log_history if "eval_loss" in h]
    return train, evals


def _metrics(prediction):
    """compute_metrics on the gathered logits: how many rows came back, and the mean logit of each next token."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    picked = logits[:, :-1].gather(-1, labels[:, 1:, None])
    return {"rows": logits.shape[0], "label_logit": picked.double().mean().item()}


def _data(n=96, seed=2):
    # no token is the pad id 0, so these Trainer tests do not depend on how the pad row's embedding is trained
    # (tested with the embedding layer)
    rows = token_dataset(n, VOCAB - 1, seed=seed)
    return [{k: v + 1 if k != "attention_mask" else v for k, v in row.items()} for row in rows]


def _model(lora=False):
    model = tiny_llama()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    return model


def hf_run(out_dir, global_batch, steps=STEPS, eval_steps=None, lora=False, export=None, **overrides):
    """The reference: transformers.Trainer, one process, the whole global batch by gradient accumulation."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import Trainer, default_data_collator

    micro = 2
    evaluating = dict(eval_strategy="steps", eval_steps=eval_steps) if eval_steps else {}
    args = _arguments(out_dir, micro, global_batch // micro, steps, **evaluating, **overrides)
    trainer = Trainer(model=_model(lora), args=args, train_dataset=_data(),
                      eval_dataset=_data(16, seed=7) if eval_steps else None, data_collator=default_data_collator,
                      compute_metrics=_metrics if eval_steps else None)
    try:
        trainer.train()
        if export:
            trainer.save_model(export)
        return _logged(trainer)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def megatron_run(out_dir, tp, micro, num_micro, steps=STEPS, eval_steps=None, resume=None, save_steps=None,
                 export=None, lora=False, eval_first=False, **overrides):
    """Our Trainer on this rank of the spawned world: the logs, and (export) the saved HF weights' folder."""
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer

    evaluating = dict(eval_strategy="steps", eval_steps=eval_steps) if eval_steps else {}
    saving = dict(save_strategy="steps", save_steps=save_steps, save_total_limit=2) if save_steps else {}
    args = _arguments(out_dir, micro, num_micro, steps, **evaluating, **saving, **overrides)
    evaluated = eval_steps or eval_first
    trainer = Trainer(model=_model(lora), args=args, train_dataset=_data(),
                      eval_dataset=_data(16, seed=7) if evaluated else None, data_collator=default_data_collator,
                      compute_metrics=_metrics if eval_steps else None,
                      megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp))
    result = {"first_eval": trainer.evaluate()["eval_loss"]} if eval_first else {}
    trainer.train(resume_from_checkpoint=resume)
    result["logs"] = _logged(trainer)
    if export:
        trainer.save_model(export)
        if not lora:
            result["weights"] = trainer.accelerator.get_state_dict(trainer.megatron_engine)
    trainer.accelerator.end_training()
    return result


def _close(a, b, rel=1e-4):
    return abs(a - b) <= rel * abs(b)


@pytest.mark.parametrize("tp,world,micro,num_micro", [(2, 2, 4, 2), (1, 2, 2, 2)], ids=["tp2", "dp2"])
def test_trainer_matches_hf_trainer(tp, world, micro, num_micro):
    global_batch = micro * num_micro * (world // tp)
    with tempfile.TemporaryDirectory() as d:
        ref_train, ref_eval = hf_run(os.path.join(d, "hf"), global_batch, eval_steps=10)
        ranks = run_on_ranks(megatron_run, world, os.path.join(d, "mp"), tp, micro, num_micro, STEPS, 10)
    assert len(ref_train) == STEPS and ref_train[-1][0] < ref_train[0][0]
    for rank, got in enumerate(ranks):
        train, evals = got["logs"]
        assert len(train) == STEPS
        for step, ((loss, lr, norm), (ref_loss, ref_lr, ref_norm)) in enumerate(zip(train, ref_train)):
            assert _close(loss, ref_loss), f"rank {rank} step {step}: loss {loss} vs HF {ref_loss}"
            assert lr == pytest.approx(ref_lr, rel=1e-12, abs=0), f"step {step}: lr {lr} vs HF {ref_lr}"
            assert _close(norm, ref_norm, 1e-3), f"step {step}: grad norm {norm} vs HF {ref_norm}"
        assert len(evals) == len(ref_eval) == 2
        for (loss, rows, logit), (ref_loss, ref_rows, ref_logit) in zip(evals, ref_eval):
            assert _close(loss, ref_loss), (evals, ref_eval)
            assert rows == ref_rows == 16  # every eval row once: gathered over data-parallel ranks only
            assert _close(logit, ref_logit), (evals, ref_eval)


def test_resume_from_checkpoint_continues_bit_identically_and_save_model_loads():
    """checkpoint-N holds the Megatron state (rotated by save_total_limit); a new Trainer resumed from it logs
    exactly the uninterrupted run's next steps; save_model writes HF weights equal to the engine's."""
    from transformers import AutoModelForCausalLM

    steps = 12
    with tempfile.TemporaryDirectory() as d:
        out, export = os.path.join(d, "run"), os.path.join(d, "hf")
        whole = run_on_ranks(megatron_run, 2, out, 2, 2, 2, steps, None, None, 4, export)
        assert sorted(os.listdir(out)) == ["checkpoint-12", "checkpoint-8"]  # checkpoint-4 rotated out
        assert os.path.isfile(os.path.join(out, "checkpoint-8", "trainer_state.json"))
        # evaluate() before train() builds the engine; resuming then loads the checkpoint into it
        again = run_on_ranks(megatron_run, 2, os.path.join(d, "again"), 2, 2, 2, steps, None,
                             os.path.join(out, "checkpoint-8"), None, None, False, True)
        saved = AutoModelForCausalLM.from_pretrained(export).state_dict()
    rows = _data(16, seed=7)
    with torch.no_grad():
        ids = torch.stack([r["input_ids"] for r in rows])
        initial_loss = tiny_llama()(input_ids=ids, labels=ids).loss.item()
    assert _close(again[0]["first_eval"], initial_loss), (again[0]["first_eval"], initial_loss)
    full, resumed = whole[0]["logs"][0], again[0]["logs"][0]
    assert len(full) == len(resumed) == steps
    assert resumed[8:] == full[8:]  # loss, learning rate and grad norm of steps 9-12, bit for bit
    engine_weights = whole[0]["weights"]
    assert set(saved) == set(engine_weights)
    for name, tensor in engine_weights.items():
        assert torch.equal(saved[name], tensor), name
    initial = tiny_llama().state_dict()
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("setting,value", [
    ("fp16", True), ("torch_compile", True), ("neftune_noise_alpha", 5.0),
    ("label_smoothing_factor", 0.1), ("optim", "adafactor"), ("lr_scheduler_type", "polynomial"),
    ("train_sampling_strategy", "group_by_length"), ("load_best_model_at_end", True), ("data_seed", 3),
    ("enable_jit_checkpoint", True),
])
def test_unsupported_training_arguments_are_refused_by_name(setting, value):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer
    from megatron_plugin.integrations.trainer import check_training_arguments

    with tempfile.TemporaryDirectory() as d:
        extra = dict(eval_strategy="steps", save_strategy="steps") if setting == "load_best_model_at_end" else {}
        try:
            args = _arguments(d, 2, 1, **extra, **{setting: value})
        except ValueError:  # TrainingArguments refuses it itself on this machine (fp16 needs a GPU)
            args = _arguments(d, 2, 1, **extra)
            object.__setattr__(args, setting, value)
        with pytest.raises(MegatronPluginConfigError) as err:
            check_training_arguments(args)
        assert err.value.setting == setting
        with pytest.raises(MegatronPluginConfigError, match=setting):
            Trainer(model=tiny_llama(), args=args, train_dataset=_data(8),
                    megatron_lm_plugin=MegatronLMPlugin(tp_degree=1))


def _megatron_groups():
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def test_without_megatron_settings_the_trainer_says_how_to_launch(monkeypatch):
    from megatron_plugin.integrations import Trainer

    monkeypatch.delenv("ACCELERATE_USE_MEGATRON_LM", raising=False)
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(MegatronPluginConfigError, match="accelerate launch"):
            Trainer(model=tiny_llama(), args=_arguments(d, 2, 1), train_dataset=_data(8))


def test_example_trains_under_accelerate_launch_and_saves_hf_weights(tmp_path):
    """examples/megatron_lm_trainer_sft.py under `accelerate launch` (CPU, TP=2): the loss falls, checkpoint-N
    folders hold the Megatron state, and the HF weights it saves give, in plain transformers, the eval loss the
    Megatron run printed."""
    import re

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from examples.megatron_lm_trainer_sft import lm_datasets
    from tests.launch import CONFIGS, ROOT, accelerate_launch

    out = accelerate_launch(
        os.path.join(CONFIGS, "cpu_tp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_trainer_sft.py"),
        "--output_dir", tmp_path, "--max_steps", 12, "--eval_steps", 6, "--save_steps", 6, "--logging_steps", 2,
        timeout=400,
    )
    evals = [float(v) for v in re.findall(r"'eval_loss': '([0-9.]+)'", out)]
    assert len(evals) >= 2 and evals[1] < evals[0], out[-3000:]
    for step in (6, 12):
        assert os.path.isdir(tmp_path / f"checkpoint-{step}" / "megatron")
    printed = float(re.findall(r"final eval_loss: (\S+)", out)[-1])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path / "tokenizer")
    _, eval_dataset = lm_datasets(os.path.join(ROOT, "examples", "data", "corpus.txt"), tokenizer, 64, 0, 64)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    rows = eval_dataset.with_format("torch")[:]
    with torch.no_grad():
        loss = model(input_ids=rows["input_ids"], labels=rows["labels"]).loss.item()
    assert len(eval_dataset) == 64 and abs(loss - printed) <= 1e-4 * loss, (loss, printed)


def test_lora_trainer_matches_hf_trainer_with_peft_and_saves_the_adapter():
    """A peft PeftModel through our Trainer (TP=2) trains as through transformers' Trainer, and save_model writes
    the adapter folder peft loads, with HF's adapters."""
    from safetensors.torch import load_file

    steps = 8
    with tempfile.TemporaryDirectory() as d:
        ref_train, _ = hf_run(os.path.join(d, "hf"), 4, steps, lora=True, export=os.path.join(d, "hf_adapter"))
        got = run_on_ranks(megatron_run, 2, os.path.join(d, "mp"), 2, 2, 2, steps, None, None, None,
                           os.path.join(d, "adapter"), True)
        ours = load_file(os.path.join(d, "adapter", "adapter_model.safetensors"))
        ref = load_file(os.path.join(d, "hf_adapter", "adapter_model.safetensors"))
        assert os.path.isfile(os.path.join(d, "adapter", "adapter_config.json"))
    train = got[0]["logs"][0]
    assert len(train) == steps
    for (loss, lr, _), (ref_loss, ref_lr, _) in zip(train, ref_train):
        assert _close(loss, ref_loss) and lr == pytest.approx(ref_lr, rel=1e-12)
    assert set(ours) == set(ref)
    assert all(ref[k].abs().max() > 1e-3 for k in ref if "lora_B" in k)  # trained away from peft's zeros
    for name, tensor in ref.items():
        assert (ours[name] - tensor).abs().max() <= 1e-4 * tensor.abs().max() + 1e-7, name


def gpt2_first_loss(out_dir):
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer
    from tests.models import tiny_gpt2

    args = _arguments(out_dir, 4, 2, 1, learning_rate=0.0, warmup_steps=0, train_sampling_strategy="sequential")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=token_dataset(16, 1000),
                      data_collator=default_data_collator, megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    trainer.train()
    return _logged(trainer)[0][0][0]


def test_gpt2_logs_the_true_token_mean():
    """GPT-2 through this Trainer logs the mean over the step's shifted tokens (transformers' Trainer logs it
    x (S - 1) / S: the README says why)."""
    from tests.models import tiny_gpt2

    rows = token_dataset(16, 1000)[:8]  # the first step's rows: sequential sampling, micro 4 x 2 micro-batches
    ids = torch.stack([r["input_ids"] for r in rows])
    with torch.no_grad():
        true_mean = tiny_gpt2()(input_ids=ids, labels=ids).loss.item()
    with tempfile.TemporaryDirectory() as d:
        logged = run_on_ranks(gpt2_first_loss, 2, d)
    assert all(_close(loss, true_mean, 1e-5) for loss in logged), (logged, true_mean)


@pytest.mark.parametrize("case,setting", [
    ("train_set_not_filling_steps", "dataloader_drop_last"), ("eval_set_not_filling_batches", "dataloader_drop_last"),
    ("warmup_as_long_as_the_run", "warmup_steps"), ("resume_from_a_folder_without_state", "resume_from_checkpoint"),
    ("resume_true_without_a_complete_checkpoint", "resume_from_checkpoint"),
])
def test_train_refuses_before_prepare(case, setting, monkeypatch):
    """What only train() can see is refused there, by the TrainingArguments' name, before prepare starts any
    Megatron process group."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer, trainer as trainer_module

    if case == "eval_set_not_filling_batches":  # only data-parallel ranks need whole rounds of eval batches
        monkeypatch.setattr(trainer_module, "_dp_size", lambda plugin: 2)

    overrides = {
        "train_set_not_filling_steps": dict(dataloader_drop_last=False),
        "eval_set_not_filling_batches": dict(dataloader_drop_last=False, eval_strategy="steps", eval_steps=5),
        "warmup_as_long_as_the_run": dict(warmup_steps=4),
        "resume_from_a_folder_without_state": {},
        "resume_true_without_a_complete_checkpoint": {},
    }[case]
    train = _data(40 if case == "eval_set_not_filling_batches" else 41)  # micro-batches of 2 rows: 41 leaves one
    with tempfile.TemporaryDirectory() as d:
        args = _arguments(d, 2, 2, 4, **overrides)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=train, eval_dataset=_data(6),
                          data_collator=default_data_collator, megatron_lm_plugin=MegatronLMPlugin(tp_degree=1))
        try:
            resume = d if case == "resume_from_a_folder_without_state" else None  # an HF checkpoint, say
            if case == "resume_true_without_a_complete_checkpoint":  # a save cut short: no tracker in megatron/
                os.makedirs(os.path.join(d, "checkpoint-3", "megatron"))
                open(os.path.join(d, "checkpoint-3", "trainer_state.json"), "w").write("{}")
                resume = True
            with pytest.raises(MegatronPluginConfigError) as err:
                trainer.train(resume_from_checkpoint=resume)
            assert err.value.setting == setting
            assert trainer.megatron_engine is None and not _megatron_groups()
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def epochs_run(out_dir):
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer

    args = _arguments(out_dir, 2, 2, -1, num_train_epochs=2, warmup_steps=0, lr_scheduler_type="linear")
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=_data(40), data_collator=default_data_collator,
                      megatron_lm_plugin=MegatronLMPlugin(tp_degree=1))
    trainer.train()
    # what Trainer reads after each step to decide whether to step its (do-nothing) scheduler: never the engine's
    # flag, which on CUDA would wait for the step
    trainer.megatron_engine.last_step_skipped = True
    assert trainer.optimizer.step_was_skipped and not trainer.accelerator.optimizer_step_was_skipped
    return trainer.state.max_steps, [h["epoch"] for h in trainer.state.log_history if "loss" in h], \
        [lr for _, lr, _ in _logged(trainer)[0]]


def test_epochs_count_steps_of_the_megatron_batch():
    """num_train_epochs at DP=2: 40 samples, steps of 2 x 2 micro-batches x 2 ranks = 8 rows, so 5 steps an
    epoch; the linear schedule decays over the 10 steps as HF's would."""
    with tempfile.TemporaryDirectory() as d:
        max_steps, epochs, lrs = run_on_ranks(epochs_run, 2, d)[0]
    assert max_steps == 10 and epochs == pytest.approx([(i + 1) / 5 for i in range(10)])
    assert lrs == pytest.approx([LR * (10 - i) / 10 for i in range(10)], rel=1e-12)


def test_an_epoch_ends_on_a_partial_step_as_hf_does():
    """44 rows, steps of 2 rows x 2 micro-batches x 2 data-parallel ranks: 5 whole steps, then the 4 rows left make
    one micro-batch on each rank (HF's last step of the epoch, with the micro-batches that are left); the rows of
    each step are HF's (its one-process loader takes them in the same order)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from megatron_plugin.integrations.trainer import _StepBatches

    ranks = []
    for rank in range(2):
        shard = BatchSamplerShard(BatchSampler(range(44), 4, drop_last=True), num_processes=2, process_index=rank)
        shard.batch_sampler = _StepBatches(shard.batch_sampler.sampler, 2, 2, 2)
        shard.batch_size = None
        ranks.append(list(shard))
        assert len(shard) == 6
    steps = [sorted(a + b) for a, b in zip(*ranks)]
    assert steps == [list(range(8 * i, 8 * i + 8)) for i in range(5)] + [[40, 41, 42, 43]]
    assert [len(b) for b in ranks[0]] == [4] * 5 + [2]


_CUDA_AVAILABLE = torch.cuda.is_available


def _plugin_for(monkeypatch, cuda, world=1, plugin=None, **overrides):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations.trainer import megatron_plugin_for

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # a previous call's
    monkeypatch.setattr(torch.cuda, "is_available", _CUDA_AVAILABLE)
    with tempfile.TemporaryDirectory() as d:
        args = _arguments(d, 2, 2, **overrides)
    assert args.device.type == "cpu"  # set up now: on the machine as it is, in one process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return megatron_plugin_for(args, plugin or MegatronLMPlugin())


def test_gradient_checkpointing_is_megatron_full_recompute(monkeypatch, caplog):
    """HF's gradient checkpointing (on in TRL's configs) -> full recompute of each layer on the CUDA engine; the
    user's recompute setting wins; on CPU (no recompute there) it is left off, and said once."""
    from megatron_plugin import MegatronLMPlugin

    for name in ("gradient_checkpointing", "activation_checkpointing"):  # transformers 5's name, and the old one
        gpu = _plugin_for(monkeypatch, True, **{name: True})
        assert (gpu.recompute_granularity, gpu.recompute_method, gpu.recompute_num_layers) == ("full", "uniform", 1)
    assert _plugin_for(monkeypatch, True).recompute_granularity is None
    mine = _plugin_for(monkeypatch, True, plugin=MegatronLMPlugin(recompute_activations=True),
                       gradient_checkpointing=True)
    assert mine.recompute_granularity == "selective"
    import logging

    logging.Logger.warning_once.cache_clear()  # transformers' once-only warnings: said here, whatever ran before
    with caplog.at_level("WARNING"):
        cpu = _plugin_for(monkeypatch, False, gradient_checkpointing=True)
        _plugin_for(monkeypatch, False, gradient_checkpointing=True)
    assert cpu.recompute_granularity is None
    assert caplog.text.count("does not recompute activations") == 1


def test_settings_that_need_a_refusal(monkeypatch):
    """average_tokens_across_devices=False weighs data-parallel ranks by their own token counts (exact only with
    one); use_cpu=True cannot keep the run off a machine's GPUs."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations.trainer import check_training_arguments

    with tempfile.TemporaryDirectory() as d:
        args = _arguments(d, 2, 1)  # use_cpu=True, as every test here
    with pytest.raises(MegatronPluginConfigError) as err:
        _plugin_for(monkeypatch, False, world=2, average_tokens_across_devices=False)
    assert err.value.setting == "average_tokens_across_devices"
    assert _plugin_for(monkeypatch, False, world=2, plugin=MegatronLMPlugin(tp_degree=2),
                       average_tokens_across_devices=False).tp_degree == 2  # one data-parallel rank: exact
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(MegatronPluginConfigError) as err:
        check_training_arguments(args)
    assert err.value.setting == "use_cpu"
    object.__setattr__(args, "use_cpu", False)
    check_training_arguments(args)


def test_the_engine_takes_a_checked_micro_batch_count():
    """The engine seam the partial step and the eval batches use: 1..num_micro_batches micro-batches for the calls
    inside the block, the plugin's count again after it; anything else refused by name."""
    from types import SimpleNamespace

    from megatron_plugin.engine.base import MegatronEngine

    engine = SimpleNamespace(plugin=SimpleNamespace(num_micro_batches=4), _micro_batch_count=None)
    for bad in (0, 5, True, 1.5):
        with pytest.raises(MegatronPluginConfigError) as err:
            with MegatronEngine.micro_batch_count(engine, bad):
                pass
        assert err.value.setting == "micro_batch_count"
    with MegatronEngine.micro_batch_count(engine, 3):
        assert MegatronEngine._micro_count(engine) == 3
        with MegatronEngine.micro_batch_count(engine, 1):
            assert MegatronEngine._micro_count(engine) == 1
        assert MegatronEngine._micro_count(engine) == 3
    assert MegatronEngine._micro_count(engine) == 4


def test_without_drop_last_whole_micro_batches_end_the_epoch_on_a_partial_step():
    """dataloader_drop_last=False: 42 rows are 21 micro-batches of 2, so 10 steps of 2 and a last step of one, as
    HF's Trainer counts them (nothing dropped); 41 rows would leave a partial micro-batch (refused above)."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer

    with tempfile.TemporaryDirectory() as d:
        args = _arguments(d, 2, 2, 4, dataloader_drop_last=False)
        trainer = Trainer(model=tiny_llama(), args=args, train_dataset=_data(42), data_collator=default_data_collator,
                          megatron_lm_plugin=MegatronLMPlugin(tp_degree=1))
        try:
            assert len(trainer.get_train_dataloader()) == 11
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


class _OwnLoss:
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return torch.zeros(())


@pytest.mark.parametrize("case,setting", [
    ("compute_loss_func", "compute_loss_func"),
    ("compute_loss_override", "compute_loss"),
    ("split_batches", "accelerator_config.split_batches"),
    ("even_batches", "accelerator_config.even_batches"),
    ("use_seedable_sampler", "accelerator_config.use_seedable_sampler"),
    ("dispatch_batches", "accelerator_config.dispatch_batches"),
    ("gradient_accumulation_kwargs", "accelerator_config.gradient_accumulation_kwargs"),
    ("plugin_clipping", "gradient_clipping"),
    ("plugin_decay_style", "lr_decay_style"),
    ("plugin_min_lr", "min_lr"),
    ("plugin_step_class_for_dpo_like_trainer", "custom_train_step_class"),
])
def test_trainer_refusals(case, setting):
    """Settings Trainer would honour and the Megatron run would silently not (a loss computed outside the
    engine's step, accelerate's batch handling, a plugin value the TrainingArguments overwrite): refused by name
    when the Trainer is built, before any Megatron process group."""
    from accelerate.state import AcceleratorState, GradientState

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer
    from train_steps import DPOTrainStep, GPTTrainStep

    cls, extra, plugin, overrides = Trainer, {}, {}, {}
    accelerator = {"split_batches": True, "even_batches": False, "use_seedable_sampler": False,
                   "dispatch_batches": True, "gradient_accumulation_kwargs": {"num_steps": 2}}
    if case == "compute_loss_func":
        extra = {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss}
    elif case == "compute_loss_override":
        cls = type("MyTrainer", (_OwnLoss, Trainer), {})
    elif case in accelerator:
        overrides = {"accelerator_config": {case: accelerator[case]}}
    elif case == "plugin_step_class_for_dpo_like_trainer":
        cls = type("StepTrainer", (Trainer,), {"megatron_train_step": lambda self: (DPOTrainStep, {})})
        plugin = {"custom_train_step_class": GPTTrainStep}
    else:
        plugin = {"plugin_clipping": {"gradient_clipping": 0.5}, "plugin_decay_style": {"lr_decay_style": "constant"},
                  "plugin_min_lr": {"min_lr": 1e-5}}[case]  # the arguments give max_grad_norm 1.0, cosine, 0
    with tempfile.TemporaryDirectory() as d:
        args = _arguments(d, 2, 1, **overrides)
        try:
            with pytest.raises(MegatronPluginConfigError) as err:
                cls(model=tiny_llama(), args=args, train_dataset=_data(8),
                    megatron_lm_plugin=MegatronLMPlugin(tp_degree=1, **plugin), **extra)
            assert err.value.setting == setting
            assert not _megatron_groups()
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def test_without_training_arguments_the_defaults_are_mapped_onto_a_copy_of_the_plugin(tmp_path, monkeypatch):
    """Trainer(model, megatron_lm_plugin=p) with no args: Trainer's default TrainingArguments are checked and
    mapped as given ones are (token-mean loss, seed, schedule, clipping), onto a copy: p is left as it was."""
    from accelerate.state import AcceleratorState, GradientState

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer

    monkeypatch.chdir(tmp_path)  # Trainer's default output_dir is relative
    mine = MegatronLMPlugin(tp_degree=1)
    before = dict(vars(mine))
    try:
        trainer = Trainer(model=tiny_llama(), train_dataset=_data(8), megatron_lm_plugin=mine)
        plugin = trainer._megatron_plugin
        assert plugin is not mine and vars(mine) == before
        assert plugin.calculate_per_token_loss is True and plugin.seed == trainer.args.seed == 42
        assert (plugin.lr_decay_style, plugin.gradient_clipping, plugin.min_lr) == ("linear", 1.0, 0.0)
        assert trainer.args.gradient_accumulation_steps == 1
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_resume_true_takes_the_newest_complete_checkpoint(tmp_path):
    """checkpoint-10's Megatron save was never committed (no tracker), checkpoint-7 has no trainer_state.json:
    resume_from_checkpoint=True resumes checkpoint-5, not the highest number Trainer would pick."""
    from megatron_plugin.engine.checkpointing.megatron_lm_layout import TRACKER
    from megatron_plugin.integrations.trainer import last_complete_checkpoint

    assert last_complete_checkpoint(str(tmp_path)) is None
    for n, tracker, state in ((5, True, True), (7, True, False), (10, False, True), (3, True, True)):
        folder = tmp_path / f"checkpoint-{n}" / "megatron"
        folder.mkdir(parents=True)
        if tracker:
            (folder / TRACKER).write_text(str(n))
        if state:
            (tmp_path / f"checkpoint-{n}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-5")


@pytest.mark.parametrize("rows,batch,drop_last,refused", [
    (12, 4, False, False), (10, 4, False, False), (12, 3, False, True), (9, 4, False, True), (9, 4, True, False),
])
def test_interleaved_eval_sizes_are_checked_with_the_eval_sets(rows, batch, drop_last, refused, monkeypatch):
    """On the interleaved pipeline schedule (here 2 micro-batches a step) every eval batch, the last one too, must
    be a whole number of micro-batches: checked with the eval sets when the engine is built (the check
    `_megatron_build` runs before prepare), not at the first such batch mid-run."""
    from types import SimpleNamespace

    from megatron_plugin.integrations.trainer import MegatronTrainerMixin

    monkeypatch.setenv("WORLD_SIZE", "2")
    plugin = SimpleNamespace(pp_degree=2, num_layers_per_virtual_pipeline_stage=1, num_micro_batches=2,
                             tp_degree=1, context_parallel_size=1)
    trainer = SimpleNamespace(_megatron_plugin=plugin, args=SimpleNamespace(dataloader_drop_last=drop_last))
    check = lambda: MegatronTrainerMixin._check_eval_size(trainer, list(range(rows)), batch)  # noqa: E731
    if refused:
        with pytest.raises(MegatronPluginConfigError) as err:
            check()
        assert err.value.setting == "per_device_eval_batch_size"
    else:
        check()
