"""TRL's `SFTTrainer` and `DPOTrainer` on Megatron-Core parallelism: TRL prepares the data (tokenizing, completion
and assistant masks as labels of -100, packing, preference pairs), `MegatronTrainerMixin` (`trainer.py`) runs
Trainer's loop on the engine, and the steps are ours: the GPT step for SFT, `DPOTrainStep` for DPO.

What TRL computes in `compute_loss` (TRL 1.16: `trl/trainer/sft_trainer.py`, `dpo_trainer.py`), and how it is
matched here:
- SFT, loss_type "nll": the summed token losses over the step's token count across accumulation steps and devices
  (`num_items_in_batch`), i.e. the token mean of the global batch: the GPT step with calculate_per_token_loss (the
  mixin sets it). Packed batches (`packing=True`, TRL's padding-free collator flattening every row into one) stay
  rows here, with position ids restarting per document (which keeps documents apart in attention,
  `layers/masks.py`) and no padding mask, labels -100 at each document's first token as TRL's collator sets them:
  the same tokens, losses and attention as TRL's one flat row, cut into the engine's micro-batches.
- DPO, loss_type "sigmoid": -log sigmoid(beta * margin) averaged over the pairs of the global batch, margin the
  difference of (policy - reference) summed completion log-probs: `DPOTrainStep` with label_smoothing 0 (TRL
  1.16's "sigmoid" does not read label_smoothing). The reference log-probs are computed each step as TRL does
  (precompute_ref_log_probs=False), from a snapshot of the initial weights taken when the engine is built
  (`use_weights`, no second model on the device), or, for a PeftModel, from the base model (`disable_adapter`,
  TRL's way with peft).
- Logged metrics under TRL's names where the step gives them: SFT `num_tokens`; DPO `rewards/chosen`,
  `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected` (the policy's
  summed log-probs: reward / beta + reference), `num_tokens`. TRL's `entropy`, `mean_token_accuracy` and
  `logits/*` need the full logits the Megatron steps never gather: they are not logged.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
import transformers
from packaging.version import Version

try:
    import trl
    import trl.trainer.dpo_trainer as trl_dpo
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
except ImportError as e:  # the integrations' Trainer needs only transformers; these two need TRL
    raise ImportError("megatron_plugin.integrations' SFTTrainer and DPOTrainer need TRL: pip install 'trl>=1.16' "
                      f"({e})") from e

from ..errors import MegatronPluginConfigError
from .trainer import MegatronTrainerMixin

IGNORE_INDEX = -100
SFT_INPUTS = ("input_ids", "attention_mask", "labels", "position_ids")
# read against TRL 1.16's trainers (their data preparation, `_metrics`, the DPO reference loading)
TRL_MIN = "1.16.0"
# SFT and DPO refuse TRL's activation offloading alike
_ACTIVATION_OFFLOADING_FIX = ("Megatron keeps its activations on the device: leave it False "
                              "(megatron_lm_recompute_activations trades compute for memory)")


def _check_trl_version():
    if Version(trl.__version__) < Version(TRL_MIN):
        raise MegatronPluginConfigError("trl", trl.__version__,
                                        f"these trainers follow TRL {TRL_MIN}'s: pip install 'trl>={TRL_MIN}'")


def _bound(cls, args, kwargs):
    """The trainer's arguments by name, as `cls.__init__` would bind them (the mixin's own keyword left out)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "megatron_lm_plugin"}
    return inspect.signature(cls.__init__).bind_partial(None, *args, **kwargs).arguments


def _is_vision(dataset) -> bool:
    if dataset is None:
        return False
    sample = next(iter(dataset))
    return isinstance(sample, dict) and ("image" in sample or "images" in sample)


def _refuse_vision(train_dataset):
    if _is_vision(train_dataset):
        raise MegatronPluginConfigError(
            "train_dataset", "a vision dataset ('image' / 'images' columns)",
            "the Megatron steps here train causal language models on text: pass a text dataset",
        )


class _TRLMetrics:
    """TRL's metric bookkeeping (`self._metrics[mode]`, averaged and cleared by `log`) read from the engine's
    step instead of TRL's `compute_loss`, which never runs."""

    def _mode(self) -> str:
        # TRL asks the HF model, which the engine replaced: the engine knows whether it trains
        engine = self.megatron_engine
        return "train" if engine is None or engine.training else "eval"

    def log(self, logs, start_time=None):
        mode = self._mode()
        metrics = {key: sum(val) / len(val) for key, val in self._metrics[mode].items() if len(val)}
        if mode == "eval":
            metrics = {f"eval_{key}": val for key, val in metrics.items()}
        logs.update(metrics)
        transformers.Trainer.log(self, logs, start_time)
        self._metrics[mode].clear()

    def _dp_sum(self, value: torch.Tensor) -> float:
        """A per-rank count summed over the data-parallel ranks (the TP / PP peers of a replica hold the same
        rows, so gathering over every process would count them several times)."""
        return float(self._gather_over_data_parallel(value.detach().reshape(1).float()).sum())

    def _dp_mean(self, value: torch.Tensor) -> float:
        """The mean of per-row values over the rows of every data-parallel rank."""
        return float(self._gather_over_data_parallel(value.detach().reshape(-1).float()).mean())

    def _count_tokens(self, attention_mask, mode):
        if mode == "train":
            self._total_train_tokens += int(self._dp_sum(attention_mask.sum()))
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]


def _padding_free(config) -> bool:
    """TRL 1.16's rule (`SFTTrainer.__init__`) for flattening each batch into one row."""
    if config is None:
        return False
    return bool(getattr(config, "padding_free", False)) or (
        bool(getattr(config, "packing", False)) and getattr(config, "packing_strategy", None) in {"bfd", "bfd_split"})


class SFTTrainer(_TRLMetrics, MegatronTrainerMixin, trl.SFTTrainer):
    """TRL's `SFTTrainer` on Megatron-Core parallelism: the same arguments (plus `megatron_lm_plugin=`), TRL's data
    preparation, the loss TRL logs (loss_type "nll"). See the module docstring and `MegatronTrainerMixin`.

    Refused by name, before any Megatron process group: loss_type other than "nll", compute_loss_func (TRL's loss
    is not computed: the Megatron step's is), activation_offloading, vision datasets, with packing / padding_free a
    data_collator other than TRL's, and what the mixin refuses.
    gradient_checkpointing (on by default in TRL's configs) becomes Megatron's full recompute on the CUDA engine
    (`trainer._map_gradient_checkpointing`)."""

    def __init__(self, *args, **kwargs):
        _check_trl_version()
        given = _bound(trl.SFTTrainer, args, kwargs)
        config = given.get("args")
        if config is not None:
            if getattr(config, "loss_type", "nll") != "nll":
                raise MegatronPluginConfigError(
                    "loss_type", config.loss_type,
                    "the Megatron GPT step computes TRL's 'nll' loss (token mean over the global batch): use 'nll'",
                )
            if getattr(config, "activation_offloading", False):
                raise MegatronPluginConfigError("activation_offloading", True, _ACTIVATION_OFFLOADING_FIX)
        # compute_loss_func: refused by the mixin (the loss is the Megatron step's, TRL's 'nll')
        _refuse_vision(given.get("train_dataset"))
        collator = given.get("data_collator")
        if collator is not None and _padding_free(config) and type(collator) is not DataCollatorForLanguageModeling:
            raise MegatronPluginConfigError(
                "data_collator", type(collator).__name__,
                "packed (padding-free) batches are made by TRL's DataCollatorForLanguageModeling, which is turned "
                "into rows with restarting position ids here: leave data_collator unset, or set packing=False and "
                "padding_free=False",
            )
        super().__init__(*args, **kwargs)
        if self.padding_free:
            # TRL's padding-free collator flattens the whole batch into one row, which the engine cannot cut into
            # micro-batches: rows with restarting position ids instead (see `megatron_batch`)
            collator = self.data_collator
            if type(collator) is not DataCollatorForLanguageModeling:
                raise MegatronPluginConfigError(
                    "data_collator", type(collator).__name__,
                    "packed batches need TRL's DataCollatorForLanguageModeling: leave data_collator unset",
                )
            self.data_collator = DataCollatorForLanguageModeling(
                pad_token_id=collator.pad_token_id, padding_free=False, return_position_ids=True,
                pad_to_multiple_of=collator.pad_to_multiple_of,
            )

    def megatron_batch(self, inputs, training: bool):
        batch = {k: inputs[k] for k in SFT_INPUTS if torch.is_tensor(inputs.get(k))}
        self._count_tokens(batch["attention_mask"] if "attention_mask" in batch else batch["input_ids"].new_ones(
            batch["input_ids"].shape), "train" if training else "eval")
        if self.padding_free and "position_ids" in batch:
            # packed documents: the restarting position ids, not a padding mask, say what attends to what; the
            # first token of a document is not predicted from the previous document's last (TRL's padding-free
            # collator masks it the same way)
            batch.pop("attention_mask", None)
            batch["labels"] = batch["labels"].masked_fill(batch["position_ids"] == 0, IGNORE_INDEX)
        return batch


@contextlib.contextmanager
def _no_reference_model(trainer):
    """TRL's DPOTrainer loads a second copy of the model as the reference; the Megatron run takes its reference
    from a snapshot of the engine's weights instead. Only that call (made once Trainer holds the policy as
    `trainer.model`) gets None, so a policy given as a path still loads."""
    original = trl_dpo.create_model_from_path

    def policy_only(*args, **kwargs):
        return None if getattr(trainer, "model", None) is not None else original(*args, **kwargs)

    trl_dpo.create_model_from_path = policy_only
    try:
        yield
    finally:
        trl_dpo.create_model_from_path = original


def _dpo_checks(config):
    loss_type = getattr(config, "loss_type", ["sigmoid"])
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if loss_types != ["sigmoid"]:
        raise MegatronPluginConfigError(
            "loss_type", loss_type,
            "the Megatron DPO step computes TRL's 'sigmoid' loss only: use loss_type=['sigmoid']",
        )
    weights = getattr(config, "loss_weights", None)
    if weights not in (None, [1.0], (1.0,)):
        raise MegatronPluginConfigError("loss_weights", weights, "one loss, weighted 1: leave loss_weights None")
    checks = [
        ("f_divergence_type", getattr(config, "f_divergence_type", "reverse_kl"), "reverse_kl",
         "the Megatron DPO step is standard DPO (reverse KL): use 'reverse_kl'"),
        ("ld_alpha", getattr(config, "ld_alpha", None), None,
         "the Megatron DPO step sums every completion token (LD-DPO's down-weighting is not computed): leave it None"),
        ("use_weighting", bool(getattr(config, "use_weighting", False)), False,
         "WPO's weights need the full logits the Megatron step never gathers: leave it False"),
        ("sync_ref_model", bool(getattr(config, "sync_ref_model", False)), False,
         "the reference is a fixed snapshot of the initial weights: leave it False"),
        ("precompute_ref_log_probs", bool(getattr(config, "precompute_ref_log_probs", False)), False,
         "the reference log-probs come from a snapshot of the initial weights at each step (the numbers a "
         "precomputation would give): leave it False"),
        ("activation_offloading", bool(getattr(config, "activation_offloading", False)), False,
         _ACTIVATION_OFFLOADING_FIX),
        ("rpo_alpha", getattr(config, "rpo_alpha", None), None, "RPO's NLL term is not computed: leave it None"),
    ]
    for name, value, expected, fix in checks:
        if value != expected:
            raise MegatronPluginConfigError(name, value, fix)


def _refuse_moe(model):
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if hasattr(text, "output_router_logits"):  # TRL's own test for a Mixture-of-Experts model
        raise MegatronPluginConfigError(
            "model", f"a Mixture-of-Experts model ({type(model).__name__})",
            "TRL's DPO loss adds router_aux_loss_coef x the routers' load-balancing loss, which the Megatron DPO step "
            "does not: DPO here trains dense models (SFTTrainer takes MoE models)",
        )


def _refuse_ref_model(given):
    if given.get("ref_model") is not None:
        raise MegatronPluginConfigError(
            "ref_model", type(given["ref_model"]).__name__,
            "the reference is the initial model, kept as a weight snapshot (with a PeftModel: the base model, "
            "adapters off): pass ref_model=None",
        )


class DPOTrainer(_TRLMetrics, MegatronTrainerMixin, trl.DPOTrainer):
    """TRL's `DPOTrainer` on Megatron-Core parallelism: the same arguments (plus `megatron_lm_plugin=`), TRL's
    preference data (tokenized prompt / chosen / rejected, completion masks), TRL's "sigmoid" loss through
    `train_steps.DPOTrainStep` with `beta`. See the module docstring and `MegatronTrainerMixin`.

    Reference: the initial weights (a host snapshot taken when the engine is built, before any checkpoint is
    resumed, swapped in for each step's reference forward), or with a PeftModel the base model (adapters off).
    Refused by name, before any Megatron process group: Mixture-of-Experts models (TRL's router aux loss term),
    other loss types, loss_weights, f-divergences, ld_alpha,
    use_weighting, sync_ref_model, precompute_ref_log_probs, a ref_model, vision datasets, and what the mixin
    refuses. `label_smoothing` is not read by TRL 1.16's "sigmoid" loss, nor here (a warning says so).
    `disable_dropout` (TRL's default) sets the Megatron model's dropouts to 0."""

    def __init__(self, *args, **kwargs):
        _check_trl_version()
        given = _bound(trl.DPOTrainer, args, kwargs)
        config = given.get("args")
        _refuse_ref_model(given)
        if config is not None:
            _dpo_checks(config)
            if getattr(config, "label_smoothing", 0.0):
                warnings.warn(
                    f"label_smoothing={config.label_smoothing} is not used: TRL's 'sigmoid' DPO loss does not read "
                    "it (only its 'robust', 'exo_pair' and 'aot' losses do)", stacklevel=2,
                )
        _refuse_vision(given.get("train_dataset"))
        self._reference = None  # the snapshot of the initial weights (None with a PeftModel)
        self._reference_logps = None  # this step's (chosen, rejected) reference log-probs, for the metrics
        with _no_reference_model(self):
            super().__init__(*args, **kwargs)

    # -- hooks of MegatronTrainerMixin ------------------------------------------------------------------
    def megatron_train_step(self):
        from train_steps import DPOTrainStep

        return DPOTrainStep, {"beta": self.args.beta, "label_smoothing": 0.0}

    def create_accelerator_and_postprocess(self) -> None:
        _refuse_moe(self.model)
        super().create_accelerator_and_postprocess()
        if getattr(self.args, "disable_dropout", False):
            # TRL zeroes the HF modules' dropout, which the Megatron model (built from the config) does not read;
            # the plugin here is the run's copy, never the user's object
            self._megatron_plugin.attention_dropout = self._megatron_plugin.hidden_dropout = 0.0

    def _megatron_build(self, *args, **kwargs):
        loader = super()._megatron_build(*args, **kwargs)
        if self.megatron_engine.lora is None:
            # the initial weights, before a resumed checkpoint replaces them (the mixin loads it after the build)
            self._reference = self.megatron_engine.snapshot_weights()
        return loader

    def _reference_context(self):
        engine = self.megatron_engine
        if engine.lora is not None:
            return engine.disable_adapter()
        return engine.use_weights(self._reference)

    def megatron_rows(self, inputs) -> int:
        return inputs["input_ids"].shape[0] // 2  # pairs: the chosen rows, then the rejected ones

    def megatron_batch(self, inputs, training: bool):
        """TRL's joined batch (chosen rows, then rejected rows; completion_mask on the answers) -> DPOTrainStep's
        chosen_* / rejected_* keys, with the reference model's summed completion log-probs."""
        engine = self.megatron_engine
        ids, mask, completion = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        labels = ids.masked_fill(completion == 0, IGNORE_INDEX)
        rows = ids.shape[0] // 2
        # computed at every step, as TRL does without precompute_ref_log_probs (which also ignores a dataset's
        # ref_*_logps columns then)
        with self._reference_context():
            ref = engine.compute_log_probs({"input_ids": ids, "attention_mask": mask, "labels": labels}).sum(-1)
        batch = {}
        for side, part in (("chosen", slice(0, rows)), ("rejected", slice(rows, None))):
            batch[f"{side}_input_ids"] = ids[part]
            batch[f"{side}_attention_mask"] = mask[part]
            batch[f"{side}_labels"] = labels[part]
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref[:rows], ref[rows:]
        self._reference_logps = (ref[:rows], ref[rows:])
        self._count_tokens(mask, "train" if training else "eval")
        return batch

    METRICS = (("rewards/chosen", "chosen reward"), ("rewards/rejected", "rejected reward"),
               ("rewards/accuracies", "reward accuracy"), ("rewards/margins", "reward margin"))

    def megatron_record(self, output, training: bool):
        metrics = getattr(output, "metrics", None) or {}
        # a key missing from a step's metrics (no loss token) reads nan: nothing is logged for that step
        nan = torch.full((), float("nan"))
        values = torch.stack([metrics[key].detach().float().cpu() if key in metrics else nan
                              for _, key in self.METRICS])
        if torch.isnan(values).any():  # a step with no loss token: nothing to log, as its loss is nan
            return
        mode = "train" if training else "eval"
        logged = {name: float(v) for (name, _), v in zip(self.METRICS, values)}
        ref_chosen, ref_rejected = self._reference_logps
        # rewards are beta x (policy - reference) summed log-probs: the policy's, averaged as TRL does
        logged["logps/chosen"] = logged["rewards/chosen"] / self.args.beta + self._dp_mean(ref_chosen)
        logged["logps/rejected"] = logged["rewards/rejected"] / self.args.beta + self._dp_mean(ref_rejected)
        for name, value in logged.items():
            self._metrics[mode][name].append(value)
