"""TRL's SFTTrainer and DPOTrainer on Megatron parallelism (`megatron_plugin.integrations`), held to TRL's own
trainers on plain HF in one process (same seed, data and global batch) on a tiny Llama (CPU, gloo): the logged
losses and metrics step by step, and the settings we cannot honour refused by name."""

import os
import random
import tempfile

import pytest

from megatron_plugin.errors import MegatronPluginConfigError
from tests.models import tiny_llama
from tests.spawn import run_on_ranks

STEPS = 10
LR = 3e-3
DIGITS = [str(i) for i in range(10)]


def tokenizer():
    """A word-level tokenizer built here (no hub): digits, a few words, <pad>/<s>/</s> at 0/1/2 as in the tiny
    Llama's config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", *DIGITS, "Q:", "A:", "sorted", "big", "small"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def sft_data(n=96, seed=0):
    """Prompt-completion pairs of different lengths: "Q: 3 1 2 A:" -> " 1 2 3" (TRL adds the eos)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [rng.choice(DIGITS) for _ in range(rng.randrange(1, 7))]
        rows.append({"prompt": "Q: " + " ".join(digits) + " A:", "completion": " sorted " + " ".join(sorted(digits))})
    return Dataset.from_list(rows)


def dpo_data(n=96, seed=1):
    """Preference pairs: the larger digit (and a word) chosen, the smaller rejected, of different lengths."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(range(10), 2)
        rows.append({"prompt": f"Q: {a} {b} A:", "chosen": f" {max(a, b)} big" + " big" * rng.randrange(2),
                     "rejected": f" {min(a, b)}" + " small" * rng.randrange(3)})
    return Dataset.from_list(rows)


def _config(kind, out_dir, micro, accumulation, **overrides):
    from trl import DPOConfig, SFTConfig

    kwargs = dict(output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                  max_steps=STEPS, learning_rate=LR, warmup_steps=2, lr_scheduler_type="linear", logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True,
                  disable_tqdm=True, bf16=False, max_length=32)  # TRL's default gradient_checkpointing=True
    kwargs.update(overrides)
    return (SFTConfig if kind == "sft" else DPOConfig)(**kwargs)


def _history(trainer):
    return [h for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]


def _data(kind, overrides):
    """(train set, eval set or None: one when the config evaluates)."""
    make = sft_data if kind == "sft" else dpo_data
    return make(), make(16, seed=9) if overrides.get("eval_steps") else None


def _model_dir(root):
    """TRL's DPOTrainer loads its reference model from the policy's path: the tiny Llama saved there."""
    path = os.path.join(root, "tiny_llama")
    if not os.path.isdir(path):
        tiny_llama().save_pretrained(path)
    return path


def _lora(overrides):
    """A LoraConfig when the test asks for one (`lora=True`), taken out of the config's overrides."""
    if not overrides.pop("lora", False):
        return None
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                      task_type="CAUSAL_LM")


def _trl_run(kind, root, global_batch, **overrides):
    """TRL's own trainer on plain HF, one process, the global batch by gradient accumulation."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM

    micro = 4
    overrides = dict(overrides)
    peft_config = _lora(overrides)
    args = _config(kind, os.path.join(root, f"trl_{kind}"), micro, global_batch // micro, **overrides)
    model = AutoModelForCausalLM.from_pretrained(_model_dir(root), attn_implementation="sdpa")
    try:
        train, evaluation = _data(kind, overrides)
        if kind == "sft":
            from trl import SFTTrainer

            trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                 processing_class=tokenizer())
        else:
            from trl import DPOTrainer

            trainer = DPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                 processing_class=tokenizer(), peft_config=peft_config)
        trainer.train()
        return _history(trainer)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _megatron_run(kind, root, tp, micro, num_micro, overrides, resume=None):
    from transformers import AutoModelForCausalLM

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer, SFTTrainer

    overrides = dict(overrides)
    peft_config = _lora(overrides)
    args = _config(kind, os.path.join(root, f"mp_{kind}"), micro, num_micro, **overrides)
    model = AutoModelForCausalLM.from_pretrained(_model_dir(root), attn_implementation="sdpa")
    plugin = MegatronLMPlugin(tp_degree=tp)
    train, evaluation = _data(kind, overrides)
    if kind == "sft":
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer(), megatron_lm_plugin=plugin)
    else:
        trainer = DPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer(), peft_config=peft_config, megatron_lm_plugin=plugin)
    trainer.train(resume_from_checkpoint=resume)
    history = _history(trainer)
    trainer.accelerator.end_training()
    # what TRL's data preparation gave the Megatron step (completion-only: the prompt's labels are -100)
    first = trainer.train_dataset[0]
    return history, first.get("labels", first.get("prompt_ids"))


def _close(a, b, rel=1e-4, abs_=0.0):
    return abs(a - b) <= rel * abs(b) + abs_


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _same_metrics(kind, ours, theirs, where, prefix=""):
    loss = prefix + "loss"
    assert _close(ours[loss], theirs[loss]), f"{where}: {loss} {ours[loss]} vs TRL {theirs[loss]}"
    tokens = prefix + "num_tokens"
    assert ours[tokens] == theirs[tokens], f"{where}: {tokens} {ours[tokens]} vs TRL {theirs[tokens]}"
    if kind == "dpo":
        for key in (prefix + k for k in DPO_METRICS):
            # rewards start at 0 (policy == reference): an absolute slack for float noise around it
            assert _close(ours[key], theirs[key], 1e-4, 1e-5), f"{where}: {key} {ours[key]} vs TRL {theirs[key]}"
        key = prefix + "rewards/accuracies"
        assert ours[key] == theirs[key], f"{where}: {key} {ours[key]} vs TRL {theirs[key]}"


def _compare(kind, tp, world, micro, num_micro, trl_only=None, **overrides):
    """`trl_only`: settings of the TRL run alone."""
    steps = overrides.get("max_steps", STEPS)
    global_batch = micro * num_micro * (world // tp)
    with tempfile.TemporaryDirectory() as root:
        _model_dir(root)
        ref = _trl_run(kind, root, global_batch, **{**overrides, **(trl_only or {})})
        ranks = run_on_ranks(_megatron_run, world, kind, root, tp, micro, num_micro, overrides)
    ref_train = [h for h in ref if "loss" in h]
    ref_eval = [h for h in ref if "eval_loss" in h]
    assert len(ref_train) == steps and ref_train[-1]["loss"] < ref_train[0]["loss"]  # it learns
    assert len(ref_eval) == (steps // overrides["eval_steps"] if "eval_steps" in overrides else 0)
    for rank, (got, _) in enumerate(ranks):
        train = [h for h in got if "loss" in h]
        evals = [h for h in got if "eval_loss" in h]
        assert len(train) == steps and len(evals) == len(ref_eval)
        for step, (ours, theirs) in enumerate(zip(train, ref_train)):
            _same_metrics(kind, ours, theirs, f"rank {rank} step {step + 1}")
            assert ours["learning_rate"] == pytest.approx(theirs["learning_rate"], rel=1e-12), step
        for i, (ours, theirs) in enumerate(zip(evals, ref_eval)):
            _same_metrics(kind, ours, theirs, f"rank {rank} evaluation {i + 1}", prefix="eval_")
        if kind == "dpo":  # the reference is not the policy: the rewards moved away from 0
            assert abs(train[-1]["rewards/margins"]) > 1e-2
    return ranks[0][1]


EVALUATING = dict(eval_strategy="steps", eval_steps=5, per_device_eval_batch_size=4)


def test_sft_completion_only_matches_trl():
    # the eval loss is HF's mean of each eval batch's token mean, batches of per_device_eval_batch_size rows (of
    # different lengths here), not of the train step's micro x num_micro
    labels = _compare("sft", 2, 2, 4, 2, **EVALUATING)
    assert labels[0] == -100 and labels[-1] != -100  # the prompt carries no loss, the completion does


def test_sft_packing_matches_trl_dp2():
    """Packed rows (TRL's bfd packing, several documents a row, position ids restarting): TRL flattens the batch
    into one padding-free row, we keep rows; documents attend only within themselves on both sides. The packed
    set's 44 rows make 5 steps of 8 and a last step of one micro-batch (4 rows, its own token mean), as HF's
    Trainer ends an epoch; steps 7-8 are the next epoch's. The evaluations average each data-parallel rank's own
    batch loss, as HF's processes do."""
    _compare("sft", 1, 2, 2, 2, packing=True, max_length=24, max_steps=8, eval_strategy="steps", eval_steps=4,
             per_device_eval_batch_size=2)


def test_dpo_matches_trl_tp2():
    """Reference log-probs from a snapshot of the initial weights (TRL: a second copy of the model); the
    evaluations (between steps) too."""
    _compare("dpo", 2, 2, 4, 2, **EVALUATING)


def test_dpo_lora_matches_trl_dp2():
    """With LoRA the reference is the base model, adapters off (TRL's way with peft)."""
    _compare("dpo", 1, 2, 2, 2, lora=True, learning_rate=2e-2)


def test_dpo_resumed_from_a_checkpoint_keeps_the_initial_reference():
    """The reference snapshot is taken when the engine is built, before checkpoint-3's trained weights load: a
    resumed run's steps 4-6 (loss and rewards, which read the reference) are the uninterrupted run's, bit for bit."""
    saving = dict(max_steps=6, save_strategy="steps", save_steps=3)
    with tempfile.TemporaryDirectory() as root:
        _model_dir(root)
        whole = run_on_ranks(_megatron_run, 2, "dpo", root, 2, 4, 2, saving)
        again = run_on_ranks(_megatron_run, 2, "dpo", root, 2, 4, 2, {**saving, "output_dir": os.path.join(root, "again")},
                             os.path.join(root, "mp_dpo", "checkpoint-3"))
    keys = ("loss", "learning_rate", *DPO_METRICS, "rewards/accuracies")
    full, resumed = ([{k: h[k] for k in keys} for h in run[0][0] if "loss" in h] for run in (whole, again))
    assert len(full) == len(resumed) == 6
    assert resumed[3:] == full[3:]
    assert abs(full[-1]["rewards/margins"]) > 1e-2


# -- refusals, by name, before any Megatron process group -----------------------------------------------------------
def _refused(build):
    with pytest.raises(MegatronPluginConfigError) as e:
        build()
    return e.value.setting


@pytest.mark.parametrize("setting,overrides", [
    ("loss_type", {"loss_type": ["hinge"]}),
    ("loss_type", {"loss_type": ["sigmoid", "sft"]}),
    ("loss_weights", {"loss_weights": [0.5]}),
    ("f_divergence_type", {"f_divergence_type": "js_divergence"}),
    ("ld_alpha", {"ld_alpha": 0.5}),
    ("use_weighting", {"use_weighting": True}),
    ("sync_ref_model", {"sync_ref_model": True}),
    ("precompute_ref_log_probs", {"precompute_ref_log_probs": True}),
])
def test_dpo_refusals(setting, overrides):
    import torch.distributed as dist

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer

    with tempfile.TemporaryDirectory() as root:
        args = _config("dpo", root, 4, 1, **overrides)
        assert _refused(lambda: DPOTrainer(model=tiny_llama(), args=args, train_dataset=dpo_data(8),
                                           processing_class=tokenizer(),
                                           megatron_lm_plugin=MegatronLMPlugin())) == setting
    assert not dist.is_initialized()


def test_dpo_refuses_a_ref_model():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer

    with tempfile.TemporaryDirectory() as root:
        args = _config("dpo", root, 4, 1)
        assert _refused(lambda: DPOTrainer(model=tiny_llama(), ref_model=tiny_llama(), args=args,
                                           train_dataset=dpo_data(8), processing_class=tokenizer(),
                                           megatron_lm_plugin=MegatronLMPlugin())) == "ref_model"


@pytest.mark.parametrize("setting,overrides,extra", [
    ("loss_type", {"loss_type": "dft"}, {}),
    ("activation_offloading", {"activation_offloading": True}, {}),
    ("compute_loss_func", {}, {"compute_loss_func": lambda *a, **k: 0.0}),
])
def test_sft_refusals(setting, overrides, extra):
    import torch.distributed as dist

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import SFTTrainer

    with tempfile.TemporaryDirectory() as root:
        args = _config("sft", root, 4, 1, **overrides)
        assert _refused(lambda: SFTTrainer(model=tiny_llama(), args=args, train_dataset=sft_data(8),
                                           processing_class=tokenizer(), megatron_lm_plugin=MegatronLMPlugin(),
                                           **extra)) == setting
    assert not dist.is_initialized()


def test_vision_datasets_are_refused():
    from datasets import Dataset

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer, SFTTrainer

    images = Dataset.from_list([{"prompt": "Q: 1 A:", "completion": " 1", "chosen": " 1", "rejected": " 2",
                                 "images": []}] * 4)
    with tempfile.TemporaryDirectory() as root:
        for kind, cls in (("sft", SFTTrainer), ("dpo", DPOTrainer)):
            args = _config(kind, root, 4, 1)
            assert _refused(lambda: cls(model=tiny_llama(), args=args, train_dataset=images,
                                        processing_class=tokenizer(),
                                        megatron_lm_plugin=MegatronLMPlugin())) == "train_dataset"


@pytest.mark.parametrize("case,setting", [("dpo_moe", "model"), ("sft_own_collator_packed", "data_collator")])
def test_trl_model_and_collator_refusals(case, setting):
    """DPO on a Mixture-of-Experts model (TRL adds router_aux_loss_coef x the routers' loss, the Megatron DPO step
    does not), and packed SFT with a collator other than TRL's (which is turned into rows here): refused by name."""
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer, SFTTrainer
    from tests.models import tiny_moe

    with tempfile.TemporaryDirectory() as root:
        if case == "dpo_moe":
            build = lambda: DPOTrainer(model=tiny_moe(), args=_config("dpo", root, 4, 1),  # noqa: E731
                                       train_dataset=dpo_data(8), processing_class=tokenizer(),
                                       megatron_lm_plugin=MegatronLMPlugin())
        else:
            build = lambda: SFTTrainer(model=tiny_llama(), args=_config("sft", root, 4, 1, packing=True),  # noqa: E731
                                       train_dataset=sft_data(8), processing_class=tokenizer(),
                                       data_collator=default_data_collator, megatron_lm_plugin=MegatronLMPlugin())
        assert _refused(build) == setting


def test_dpo_loads_a_policy_given_as_a_path_and_leaves_the_plugin_alone():
    """DPOTrainer(model="<folder>"): TRL loads the policy from the path; only its second load (the reference,
    which the Megatron run takes from a weight snapshot) is skipped. The user's plugin object is not written (the
    DPO step and dropouts go into the run's copy)."""
    import torch
    import trl.trainer.dpo_trainer as trl_dpo

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import DPOTrainer
    from train_steps import DPOTrainStep

    loads = []
    original = trl_dpo.create_model_from_path

    with tempfile.TemporaryDirectory() as root:
        saved = tiny_llama()
        saved.save_pretrained(os.path.join(root, "policy"))
        mine = MegatronLMPlugin()
        before = dict(vars(mine))
        trl_dpo.create_model_from_path = lambda *a, **k: loads.append(a) or original(*a, **k)
        try:
            trainer = DPOTrainer(model=os.path.join(root, "policy"), args=_config("dpo", root, 4, 1),
                                 train_dataset=dpo_data(8), processing_class=tokenizer(), megatron_lm_plugin=mine)
        finally:
            trl_dpo.create_model_from_path = original
        assert len(loads) == 1 and trainer.ref_model is None
        for name, tensor in saved.state_dict().items():
            assert torch.equal(trainer.model.state_dict()[name], tensor), name
        assert vars(mine) == before
        plugin = trainer._megatron_plugin
        assert plugin.custom_train_step_class is DPOTrainStep and plugin.hidden_dropout == 0.0
