"""`MegatronEngine`: what `accelerator.prepare` returns for the model.

In train mode `engine(**batch)` runs one whole optimizer step: the batch is cut into the plugin's
micro-batches, each goes forward and backward through the train step, gradients are averaged over
data-parallel ranks and clipped to the global norm, and optimizer and LR scheduler step. It returns an
HF-style output whose `.loss` is already averaged over data-parallel ranks. In eval mode it returns the
loss (and, with `return_logits`, the logits) without touching gradients.

This engine uses only torch.distributed collectives, so it runs on CPU (gloo) as well as on GPU.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from types import SimpleNamespace
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..layers.comm import gather_tensor_parallel_last_dim
from ..layers.masks import KNOWN, rows_not_packed, rows_without_padding
from ..errors import MegatronPluginConfigError
from ..models.modeling import MegatronModel
from .batch_check import DeferredCheck, NoLossInStep


def megatron_args(plugin, model: MegatronModel, micro_batch_size: int, dp_size: int) -> SimpleNamespace:
    """The `megatron_args` handed to train steps: the plugin's settings plus what prepare derived."""
    args = SimpleNamespace(**{k: getattr(plugin, k) for k in plugin.__dataclass_fields__})
    args.micro_batch_size = micro_batch_size
    args.global_batch_size = micro_batch_size * plugin.num_micro_batches * dp_size
    args.data_parallel_size = dp_size
    args.padded_vocab_size = model.dims.padded_vocab
    args.model_variant = model.variant
    args.decoder_start_token_id = getattr(model.hf_config, "decoder_start_token_id", None)
    args.pad_token_id = getattr(model.hf_config, "pad_token_id", None)
    args.vocab_size = model.hf_config.vocab_size
    args.eod_token = getattr(model.hf_config, "eos_token_id", None)
    args.seq_length = plugin.seq_length or model.family.max_positions(model.hf_config)
    return args


class MegatronEngine(torch.nn.Module):
    def __init__(self, chunks: List[MegatronModel], optimizer, scheduler, plugin, train_step, device, autocast_dtype=None):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.model = chunks[0]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.plugin = plugin
        self.train_step_handler = train_step
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.last_step_skipped = False
        self.last_grad_norm = None
        self.iteration = 0
        self.rng = ModelRNG(plugin.seed + 100 * parallel_state.get_pipeline_model_parallel_rank(), device)
        self._in_step = False  # inside model(**batch) / compute_log_probs
        self._offload = None  # the Offload holding what offload() moved, once used
        self._swapped = False  # inside use_weights(snapshot)
        self._family_step = None  # the family's own step, for log-probs when the user's step has no logits
        self._pending_check = None  # this step's DeferredCheck, until the first forward has been queued

    # -- the step -------------------------------------------------------------------------------
    def forward(self, **batch):
        self._check_ready("model(**batch) in training mode" if self.training else "model(**batch)",
                          swapped_ok=not self.training)
        step = self.train_step_handler
        micro_batches = self._split(batch, step)
        cls = step.model_output_class
        checked = self._check_batch(batch, step, micro_batches, defer=self.training and self._can_defer_batch_check())
        if isinstance(checked, DeferredCheck):
            micro_batches = self._split(checked.safe_batch, step)
        if checked is False:
            return self._skipped_step(cls)
        with self._busy(), self.rng.active():
            if self.training:
                self._pending_check = checked if isinstance(checked, DeferredCheck) else None
                try:
                    logs = self._train_step(micro_batches)
                except NoLossInStep:
                    return self._skipped_step(cls)
                except BaseException:
                    if self._pending_check is not None:
                        self._pending_check.resolve()  # a bad batch says so, rather than what it broke
                    raise
                finally:
                    self._pending_check = None
                logits = None
            else:
                with torch.no_grad():
                    logs, logits = self._eval_step(micro_batches)
        self.metrics = logs
        key = step.loss_log_key
        if key is not None and key in logs:
            loss = logs[key]
        else:
            loss = sum(logs.values()) if logs else torch.zeros((), device=self.device)
        return self._output(cls, loss, logits, logs)

    def _skipped_step(self, cls):
        """No token of the whole step carries a loss: the weights stay as they were, the loss is nan."""
        self.last_step_skipped = True
        if self.training:
            self.iteration += 1
        nan = torch.full((), float("nan"), device=self.device)
        self.metrics = {}
        return self._output(cls, nan, None, {})

    def _can_defer_batch_check(self) -> bool:
        """Whether the batch check's result may be read after the first micro-batch's forward is queued
        (the CUDA engine without pipelining); here it is read before the step starts."""
        return False

    @staticmethod
    def _output(cls, loss, logits, logs):
        if cls is None:
            return loss
        extra = {"metrics": dict(logs)} if "metrics" in getattr(cls, "__dataclass_fields__", {}) else {}
        return cls(loss=loss, logits=logits, **extra)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step left the weights unchanged (no loss token, or non-finite gradients).
        The CUDA engine keeps this flag on the device; reading it waits for the step to finish."""
        return bool(self._last_step_skipped)

    @last_step_skipped.setter
    def last_step_skipped(self, value):
        self._last_step_skipped = value

    @contextlib.contextmanager
    def _busy(self):
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _check_ready(self, what: str, swapped_ok: bool = False, offloaded_ok: bool = False):
        if self.is_offloaded and not offloaded_ok:
            raise MegatronPluginConfigError(
                what, "called while the model is offloaded",
                "call accelerator.reload() (engine.reload()) first, after accelerator.offload()",
            )
        if self._swapped and not swapped_ok:
            raise MegatronPluginConfigError(
                what, "called inside use_weights(snapshot), where the model holds the snapshot's weights",
                "train, save, offload and snapshot outside the `with` block; inside it, compute log-probs, "
                "generate or evaluate",
            )

    def _check_between_steps(self, what: str):
        if self._in_step:
            raise MegatronPluginConfigError(what, "called while a step runs",
                                            "call it between steps: after model(**batch) has returned")

    def _split(self, batch, step) -> List[Dict[str, torch.Tensor]]:
        key = step.input_key
        if not batch:
            raise MegatronPluginConfigError("batch", {}, "pass the dataloader's batch: model(**batch)")
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        if key not in tensors:
            raise MegatronPluginConfigError(
                "batch", sorted(batch), f"the batch needs {key!r} (a [batch, sequence] tensor of token ids)"
            )
        ids = tensors[key]
        if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0 or ids.is_floating_point():
            raise MegatronPluginConfigError(
                key, f"{ids.dtype} tensor of shape {tuple(ids.shape)}",
                "pass integer token ids shaped [batch, sequence] with at least one row and one token",
            )
        n = self.plugin.num_micro_batches
        size = ids.shape[0]
        if size % n:
            raise MegatronPluginConfigError(
                "num_micro_batches", n,
                f"a batch of {size} samples does not split into {n} micro-batches: use drop_last=True in the "
                "DataLoader, or a batch size that is a multiple of num_micro_batches",
            )
        for k, v in tensors.items():
            if v.dim() == 0 or v.shape[0] != size:
                raise MegatronPluginConfigError(
                    f"batch[{k!r}]", tuple(v.shape), f"every tensor of the batch needs the {size} rows of {key} first"
                )
            ids = tensors.get(k.replace("attention_mask", "input_ids")) if k.endswith("attention_mask") else None
            if ids is not None and v.shape != ids.shape:  # HF padding masks: one 1/0 per token of their ids
                raise MegatronPluginConfigError(
                    f"batch[{k!r}]", tuple(v.shape),
                    f"pass the tokenizer's padding mask, shaped like its ids {tuple(ids.shape)}: 1 for a token, 0 for padding",
                )
        batch = {k: v.to(self.device) for k, v in tensors.items()}
        return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]

    def _check_batch(self, batch, step, micro_batches=(), need_loss: bool = True, defer: bool = False):
        """Refuse token ids or labels the model cannot have, a sequence longer than its positions, or (for
        a loss, `need_loss`) a batch the train step rejects, on every rank alike (one small all-reduce, so
        no rank is left waiting in a collective). Returns False when no token of the whole step carries a
        loss, else True. The flags are computed on the device and read back once. That read waits for the
        GPU to drain its queue, so with `defer` it is not made here: the flags travel to the host behind
        the previous step's work, and a `DeferredCheck` is returned, read once the first micro-batch's
        forward is queued (`safe_batch` keeps that forward in bounds whatever the batch holds).

        The same read tells, per micro-batch, whether its attention masks pad anything and whether its
        position ids pack sequences; those answers are set on `micro_batches`' tensors (layers/masks.py),
        so the train step need not read the device for them once per micro-batch. The forward needs
        them before it is queued, so a batch with such keys is read here, even with `defer`."""
        cfg = self.model.hf_config
        vocab = cfg.vocab_size
        id_keys = sorted({k for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v)} | {step.input_key})
        label_keys = [k for k, v in batch.items() if k.endswith("labels") and torch.is_tensor(v)]
        limit = self.model.family.position_limit(cfg)
        out_of_range = {k: (batch[k] < 0) | (batch[k] >= vocab) for k in id_keys}
        out_of_range.update({k: ((batch[k] < 0) & (batch[k] != -100)) | (batch[k] >= vocab) for k in label_keys})

        def const(value):  # a fill kernel: writing a host number into a device tensor would sync
            return torch.full((), int(value), dtype=torch.int64, device=self.device)

        flags = []
        for keys in (id_keys, label_keys):
            found = [out_of_range[k].any().to(self.device) for k in keys]  # an empty tensor has none
            flags.append(torch.stack(found).any().long() if found else const(0))
        length = max(batch[k].shape[1] for k in id_keys if batch[k].dim() == 2)
        too_long = limit is not None and length > limit
        flags.append(const(too_long))
        tokens = step.count_loss_tokens(batch) if need_loss else None
        flags.append(const(1) if tokens is None else tokens.to(self.device, torch.int64).reshape(()))
        try:
            error = step.check_batch(batch) if need_loss else None
        except Exception as e:  # raised below, once every rank knows
            error = e
        flags.append(const(error is not None))
        local = torch.stack(flags)
        status = local.clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(status)
        # per micro-batch: no padding in each attention mask, no packed sequences in the position ids
        fact_keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() == 2 and micro_batches
                     and (k.endswith("attention_mask") or k == "position_ids")]
        facts = [(rows_without_padding if k.endswith("attention_mask") else rows_not_packed)(batch[k])
                 .reshape(len(micro_batches), -1).all(1).to(self.device, torch.int64) for k in fact_keys]
        both = torch.cat([status, local, *facts])

        def verdict(values) -> bool:
            ok = self._batch_verdict([values[:5], values[5:10]], batch, out_of_range, id_keys, label_keys, vocab,
                                     limit, length, error)
            for j, k in enumerate(fact_keys):
                for i, mb in enumerate(micro_batches):
                    setattr(mb[k], KNOWN, bool(values[10 + j * len(micro_batches) + i]))
            return ok

        # a batch known bad on the host says so now (after the all-reduce, so every rank does)
        if not defer or error is not None or too_long or fact_keys:
            return verdict(both.tolist())
        safe = dict(batch)
        for k in id_keys + label_keys:  # out-of-range ids would fault the embedding before the read
            fill = -100 if k in label_keys else 0
            safe[k] = batch[k].to(self.device).masked_fill(out_of_range[k].to(self.device), fill)
        return DeferredCheck(both, verdict, safe)

    def _batch_verdict(self, values, batch, out_of_range, id_keys, label_keys, vocab, limit, length, error) -> bool:
        """What the check's flags (all ranks', this rank's) mean: raise for a bad batch, False for no loss."""
        (bad_id, bad_label, too_long, tokens, bad_step), mine = values
        here = " (this rank's batch)" if any(mine[:3]) or mine[4] else " (another rank's batch)"
        bad_ids = [k for k in id_keys if out_of_range[k].any()] if mine[0] else []
        bad_labels = [k for k in label_keys if out_of_range[k].any()] if mine[1] else []
        if bad_step:
            if error is not None:
                raise error
            raise MegatronPluginConfigError("batch", "rejected by the train step" + here, "see the error on that rank")
        if bad_id:
            k = bad_ids[0] if bad_ids else "input_ids"
            raise MegatronPluginConfigError(
                k, f"ids outside [0, {vocab}){here}" + (f": min {int(batch[k].min())}, max {int(batch[k].max())}" if bad_ids else ""),
                f"the model's vocabulary has {vocab} entries: use its tokenizer (or resize_token_embeddings before prepare)",
            )
        if bad_label:
            raise MegatronPluginConfigError(
                bad_labels[0] if bad_labels else "labels", f"ids outside [0, {vocab}) other than -100{here}",
                "labels are token ids of the model's vocabulary, or -100 for positions without loss",
            )
        if too_long:
            raise MegatronPluginConfigError(
                "sequence length", f"{length} > {limit}{here}" if mine[2] else f"> {limit}{here}",
                f"the model has {limit} positions: cut the sequences (block_size / max_length) to at most {limit}",
            )
        if tokens == 0:
            warnings.warn(
                f"step {self.iteration}: every label of the batch is -100 (ignored), so there is no loss: the "
                "step is skipped and reports loss nan. Check the collator (e.g. prompts longer than max_length)."
            )
            return False
        return True

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward_micro_batch(self, micro_batch, forward_step=None):
        forward_step = forward_step or self.train_step_handler.forward_step
        with self._autocast():
            output_tensor, loss_func = forward_step(iter([micro_batch]), self.model.module)
            return output_tensor, loss_func(output_tensor)

    def _train_step(self, micro_batches):
        n = len(micro_batches)
        collected: List[Dict[str, torch.Tensor]] = []
        for i, mb in enumerate(micro_batches):
            _, (loss, logs) = self._forward_micro_batch(mb)
            if i == 0 and self._pending_check is not None:
                self._pending_check.raise_if_no_loss()
            (loss / n).backward()
            collected.append(logs)
        self._reduce_gradients()
        self.last_grad_norm = self._clip_gradients()
        self.last_step_skipped = not math.isfinite(self.last_grad_norm)
        if not self.last_step_skipped:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step(1)
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return _average_logs(collected)

    def _eval_step(self, micro_batches):
        collected = []
        for mb in micro_batches:
            _, (_, logs) = self._forward_micro_batch(mb)
            collected.append(logs)
        return _average_logs(collected), self._collect_logits(collected)

    def _collect_logits(self, collected):
        """Logits of the whole batch, gathered over TP and cut to the true vocabulary (last stage)."""
        parts = [c["logits"] for c in collected if "logits" in c]
        if not parts:
            return None
        full = gather_tensor_parallel_last_dim(torch.cat(parts))
        return full[..., : self.model.hf_config.vocab_size]

    # -- gradients ------------------------------------------------------------------------------
    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def _reduce_gradients(self):
        grads = [p.grad for p in self._params() if p.grad is not None]
        dp = parallel_state.get_data_parallel_group()
        if dist.get_world_size(dp) > 1 and grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=dp)
            flat /= dist.get_world_size(dp)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        # per-head q/k norms (Qwen3) are replicated, but each TP rank saw only its own heads: sum them, as
        # mcore's finalize_model_grads does
        tp = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(tp) > 1:
            for name, p in self.model.module.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=tp)

    @torch.no_grad()
    def _clip_gradients(self) -> float:
        """Global L2 norm over the whole model (TP shards counted once, replicated tensors once), and
        clipping to the plugin's `gradient_clipping` the way torch.nn.utils.clip_grad_norm_ does."""
        params = [p for p in self._params() if p.grad is not None]
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        counted = [p.grad for p in params if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in counted:
            sq += g.float().pow(2).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = sq.sqrt().item()
        clip = self.plugin.gradient_clipping
        if clip and math.isfinite(norm):
            coef = min(clip / (norm + 1e-6), 1.0)
            for p in params:
                p.grad.mul_(coef)
        return norm

    # -- post-training --------------------------------------------------------------------------------
    def compute_log_probs(self, batch, temperature: float = 1.0, entropy: bool = False):
        """Forward only, in eval mode (no dropout): token-aligned log-probabilities [b, s] (fp32) of the
        batch's tokens, out[:, t] = log p(token t | what precedes it) under softmax(logits / temperature);
        0 where nothing scores a token (the first position of a causal LM, labels of -100). The batch is
        what the train step takes (input_ids, attention_mask, labels, position_ids / T5's labels / BERT's
        labels). With `entropy`, returns (log_probs, entropy). Computed vocab-parallel over TP, micro-batch by
        micro-batch through the pipeline; every rank gets the result. Collective over the model replica."""
        from .logprobs import check_temperature, log_prob_forward_step

        self._check_ready("compute_log_probs", swapped_ok=True)
        temperature = check_temperature(temperature)
        if not isinstance(entropy, bool):
            raise MegatronPluginConfigError("entropy", entropy, "pass True or False")
        step = self._logits_step()
        micro_batches = self._split(batch, step)
        self._check_batch(batch, step, micro_batches, need_loss=False)
        forward_step = log_prob_forward_step(step, self.model.hf_config.vocab_size, temperature, entropy)
        was_training = self.training
        self.train(False)
        try:
            with self._busy(), self.rng.active(), torch.no_grad():
                collected = self._forward_only(micro_batches, forward_step)
        finally:
            self.train(was_training)
        log_probs = self._rows(collected, "log_probs")
        return (log_probs, self._rows(collected, "entropy")) if entropy else log_probs

    def _logits_step(self):
        """The train step to ask for logits: the user's, if it (or its base class) defines
        `forward_logits` for plain batches (input_ids first), else the family's own step."""
        from train_steps.base import AbstractTrainStep

        family = self.model.family
        if self.model.variant not in family.trainable_variants:
            raise MegatronPluginConfigError(
                "model", family.classes.get(self.model.variant, self.model.variant),
                "log-probabilities need the model's LM head: prepare a model with one (e.g. ...ForCausalLM)",
            )
        handler = self.train_step_handler
        if type(handler).forward_logits is not AbstractTrainStep.forward_logits and handler.input_key == "input_ids":
            return handler
        if self._family_step is None:
            import train_steps

            self._family_step = getattr(train_steps, family.train_step)(self.megatron_args)
        return self._family_step

    def _forward_only(self, micro_batches, forward_step):
        collected = []
        for mb in micro_batches:
            _, (_, logs) = self._forward_micro_batch(mb, forward_step)
            collected.append(logs)
        return collected

    def _rows(self, collected, key):
        return torch.cat([c[key] for c in collected])

    def snapshot_weights(self):
        """A host copy (pinned, on CUDA) of this rank's parameters as they are now, e.g. the reference policy
        of a KL term: `with engine.use_weights(snapshot): ref = engine.compute_log_probs(batch)`. Costs one
        copy of the (mixed-precision) parameters in host memory, none on the device."""
        from .offload import WeightSnapshot

        self._check_ready("snapshot_weights")
        self._check_between_steps("snapshot_weights")
        return WeightSnapshot(self._weight_tensors(), self.device)

    @contextlib.contextmanager
    def use_weights(self, snapshot):
        """Run the model with a snapshot's weights inside the `with` block (forward only: log-probs,
        generation, evaluation), and its own weights again after it, bit for bit. Swaps bytes with host
        memory: no second model on the device."""
        from .offload import WeightSnapshot, unique_storages

        if not isinstance(snapshot, WeightSnapshot):
            raise MegatronPluginConfigError("use_weights(snapshot)", type(snapshot).__name__,
                                            "pass what snapshot_weights() returned")
        self._check_ready("use_weights")
        self._check_between_steps("use_weights")
        live = {s.data_ptr() for s in unique_storages(self._weight_tensors(), self.device)}
        if {s.data_ptr() for s in snapshot.storages} != live:
            raise MegatronPluginConfigError("use_weights(snapshot)", "a snapshot of another model",
                                            "take the snapshot with this model's snapshot_weights()")
        snapshot.swap()
        self._swapped = True
        try:
            yield self
        finally:
            snapshot.swap()
            self._swapped = False

    def _weight_tensors(self):
        return [p for c in self.chunks for p in c.module.parameters()]

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True):
        """Move the parameters, gradients and optimizer state to host memory (pinned, on CUDA) and free
        their device memory, e.g. for a rollout engine between training phases. `reload()` brings them
        back bit for bit. Returns bytes moved per kind. Not while a step runs."""
        from .offload import Offload

        self._check_between_steps("offload")
        self._check_ready("offload", offloaded_ok=True)  # offloading twice is a no-op
        if self._offload is None:
            self._offload = Offload(self.device)
        return self._offload.offload(self._offload_groups(params, grads, optimizer))

    def reload(self):
        """Bring back what `offload()` moved to host memory (a no-op when nothing is offloaded)."""
        self._check_between_steps("reload")
        if self._offload is None:
            return {}
        return self._offload.reload()

    @property
    def is_offloaded(self) -> bool:
        return self._offload is not None and self._offload.active

    def _offload_groups(self, params: bool, grads: bool, optimizer: bool):
        from .optimizer import inner_torch_optimizers

        groups = {}
        if params:
            groups["params"] = [t for c in self.chunks for t in [*c.module.parameters(), *c.module.buffers()]]
        if grads:
            groups["grads"] = [g for c in self.chunks for p in c.module.parameters()
                               for g in (p.grad, getattr(p, "main_grad", None)) if torch.is_tensor(g)]
        if optimizer:
            opts = [self.optimizer] if isinstance(self.optimizer, torch.optim.Optimizer) else inner_torch_optimizers(self.optimizer)
            groups["optimizer"] = [t for o in opts for t in
                                   [*(p for g in o.param_groups for p in g["params"]),
                                    *(v for st in o.state.values() for v in st.values() if torch.is_tensor(v))]]
        return groups

    # -- conveniences -----------------------------------------------------------------------------
    def megatron_generate(self, inputs, attention_mask=None, **kwargs):
        """Generate with the tensor-parallel model (see `megatron_plugin.generation.generate`)."""
        from ..generation.generate import megatron_generate

        self._check_ready("megatron_generate", swapped_ok=True)
        return megatron_generate(self, inputs, attention_mask, **kwargs)

    def iter_hf_weights(self, grads: bool = False):
        """(HF name, full tensor) of the whole model, one at a time, on every rank (collective: every rank
        of the replica consumes it to the end): for pushing weights into an inference engine after a step."""
        from .export import iter_hf_weights

        self._check_ready("iter_hf_weights", swapped_ok=True)
        return iter_hf_weights(self, grads=grads)

    def hf_state_dict(self):
        """The full HF state dict of this pipeline stage (collective over the TP group)."""
        return self.model.hf_state_dict()


class ModelRNG:
    """The model's own random stream (dropout), separate from the script's.

    Each step runs with this stream swapped in for torch's default generator(s) and swapped out after,
    so whatever else the script draws (shuffling, a new dataloader iterator on resume) cannot shift the
    dropout masks, and a checkpoint of this state resumes the exact same masks. Every TP rank of a
    stage starts from the same seed: dropout on replicated activations must agree across TP ranks.
    """

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.devices = [device] if self.cuda else []
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self):
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if self.cuda else None}

    @contextlib.contextmanager
    def active(self):
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.state["cpu"])
            if self.cuda:
                torch.cuda.set_rng_state(self.state["cuda"])
            try:
                yield
            finally:
                self.state = self._get()

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)


def _average_logs(collected: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Mean over micro-batches of every scalar a loss function logged."""
    if not collected:
        return {}
    keys = [k for k, v in collected[0].items() if torch.is_tensor(v) and v.dim() == 0]
    return {k: torch.stack([c[k].detach().float() for c in collected]).mean() for k in keys}
