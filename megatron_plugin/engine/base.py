"""`MegatronEngine`: what `accelerator.prepare` returns for the model, on any device.

In train mode `engine(**batch)` runs one whole optimizer step: the batch is cut into the plugin's
micro-batches, each goes forward and backward through the train step, gradients are averaged over
data-parallel ranks and clipped to the global norm, and optimizer and LR scheduler step. It returns an
HF-style output whose `.loss` is already averaged over data-parallel ranks (its backward has run: a
script's `loss.backward()` on it does nothing but warn once, see `ReturnedLoss`). In eval mode it returns
the loss (and, with `return_logits`, the logits) without touching gradients.

This base holds what every engine shares: the batch's checks and its micro-batches, eval and
forward-only passes run micro-batch by micro-batch, log-probs, post-training state (offload,
snapshots) and the conveniences. With MoE layers it also logs each step's expert load
(engine/expert_load.py: tokens per expert per layer, the dropped fraction) next to the step's losses, and
refuses batches whose shapes differ between the data-parallel ranks that share experts
(engine/expert_group.py). How a training step reduces, clips and applies gradients is the
subclass's: `CPUEngine` (engine/cpu.py, torch.distributed collectives) or `MegatronCoreEngine`
(engine/gpu.py, megatron-core's DDP, optimizer and pipeline schedules).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List

import torch
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.comm import gather_tensor_parallel_last_dim
from ..layers.context_parallel import shard_sequence, unshard
from ..models.modeling import MegatronModel
from .batch_check import BatchCheck, DeferredCheck, NoLossInStep
from .expert_group import check_same_shapes
from .expert_load import ExpertLoad
from .logprobs import LogProbs
from .manual_gc import ManualGC
from .post_training import PostTrainingState
from .rng import ModelRNG


class _StepAlreadyRan(torch.autograd.Function):
    """The autograd node of a training step's returned loss: its backward only calls `notice`."""

    @staticmethod
    def forward(ctx, loss, anchor, notice):
        ctx.notice = notice
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.notice()
        return None, None, None


class ReturnedLoss:
    """The loss a training step returns, made safe for `loss.backward()`: the step has already run the
    backward pass and the optimizer step, so a script written for plain PyTorch (backward on the loss)
    would fail on a tensor without grad_fn. The loss gets a tiny autograd node (over a leaf of its own,
    which takes no gradient) whose backward warns once per engine and does nothing: no weight or
    gradient changes. Its value, `.item()`, `.detach()` and `accelerator.backward(loss)` are as before."""

    MESSAGE = ("loss.backward() does nothing here: model(**batch) has already run the backward pass and the "
               "optimizer step. Call accelerator.backward(loss) (a no-op under Megatron), as accelerate scripts do, "
               "or nothing; optimizer.step() and zero_grad() are no-ops too")

    def __init__(self, device):
        self._anchor = torch.zeros((), device=device, requires_grad=True)
        self.warned = False

    def __call__(self, loss):
        if not torch.is_tensor(loss) or loss.requires_grad or not torch.is_grad_enabled():
            return loss
        return _StepAlreadyRan.apply(loss, self._anchor, self._warn_once)

    def _warn_once(self):
        if not self.warned:
            self.warned = True
            warnings.warn(self.MESSAGE, stacklevel=2)


class UsingWeights:
    """What `use_weights(snapshot)` returns: the swap happens when the `with` block is entered. Called
    without `with`, nothing is swapped while the script believes the snapshot's weights are in: that
    says so (a warning when the unentered object is dropped, in CPython right after the call)."""

    MESSAGE = ("use_weights(snapshot) was called without `with`: the model still holds its own weights. Write "
               "`with accelerator.use_weights(snapshot):` around the log-probs / generation that should use it")

    def __init__(self, engine, snapshot):
        self.engine, self.snapshot, self.entered, self._block = engine, snapshot, False, None

    def __enter__(self):
        self.entered = True
        self._block = self.engine.post_training.use_weights(self.snapshot)
        self._block.__enter__()
        return self.engine

    def __exit__(self, *exc):
        return self._block.__exit__(*exc)

    def __del__(self):
        if not self.entered:
            warnings.warn(self.MESSAGE, stacklevel=2)


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
        self.batch_check = BatchCheck(self.model, device)
        self.post_training = PostTrainingState(chunks, optimizer, device)
        self.log_probs = LogProbs()
        self._pending_check = None  # this step's DeferredCheck, until the first forward has been queued
        self.returned_loss = ReturnedLoss(device)
        self.expert_load = ExpertLoad.of(chunks, device)  # None without MoE layers
        self.lora = None  # engine/lora.LoraRun when prepare was given a PeftModel (set by build)
        self._micro_batch_count = None  # set by `micro_batch_count` for the calls inside it
        self.manual_gc = ManualGC(plugin)

    def train(self, mode: bool = True):
        changed = mode != self.training
        super().train(mode)
        if changed:
            self.manual_gc.mode_changed()
        return self

    # -- the step -------------------------------------------------------------------------------
    def forward(self, **batch):
        self.check_ready("model(**batch) in training mode" if self.training else "model(**batch)",
                         swapped_ok=not self.training)
        step = self.train_step_handler
        micro_batches = self.micro_batches(batch, step)
        cls = step.model_output_class
        checked = self.check_batch(batch, step, micro_batches, defer=self.training and self.can_defer_batch_check())
        if isinstance(checked, DeferredCheck):
            micro_batches = self.micro_batches(checked.safe_batch, step)
        check_same_shapes(self, micro_batches, step, "model(**batch)")
        if checked is False:
            return self._skipped_step(cls)
        load = self.expert_load
        with self.post_training.busy(), self.rng.active(), (load.recorded() if load else contextlib.nullcontext()):
            if self.training:
                self._pending_check = checked if isinstance(checked, DeferredCheck) else None
                self.manual_gc.before_train_step()
                try:
                    logs = self._train_step(micro_batches)
                    self.manual_gc.after_train_step(self.iteration)
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
        key = step.loss_log_key
        if key is not None and key in logs:
            loss = logs[key]
        else:
            loss = sum(logs.values()) if logs else torch.zeros((), device=self.device)
        if load is not None:  # after the loss: the loads are logged, not added up into it
            logs = {**logs, **load.logs()}
        self.metrics = logs
        if self.training and getattr(self, "tensorboard", None) is not None:
            self.tensorboard.log_step(self.iteration, logs, self.optimizer, self)
        return self._output(cls, loss, logits, logs)

    def _skipped_step(self, cls):
        """No token of the whole step carries a loss: the weights stay as they were, the loss is nan."""
        self.last_step_skipped = True
        if self.training:
            self.iteration += 1
            self.manual_gc.after_train_step(self.iteration)
        nan = torch.full((), float("nan"), device=self.device)
        self.metrics = {}
        return self._output(cls, nan, None, {})

    def can_defer_batch_check(self) -> bool:
        """Whether the batch check's result may be read after the first micro-batch's forward is queued
        (the CUDA engine without pipelining); here it is read before the step starts."""
        return False

    def _output(self, cls, loss, logits, logs):
        if self.training:  # the step's backward has run: the script's loss.backward() only warns
            loss = self.returned_loss(loss)
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

    def _train_step(self, micro_batches) -> Dict[str, torch.Tensor]:
        """One optimizer step over the micro-batches; returns the averaged logs. The device engine's."""
        raise NotImplementedError

    # -- the batch ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch_count(self, n: int):
        """Inside the block, batches are cut into `n` micro-batches (their rows split evenly) instead of the
        plugin's num_micro_batches: e.g. the last step of an epoch with the micro-batches that are left, as HF's
        Trainer runs it, or an evaluation batch in one piece. Both engines take the count from the list of
        micro-batches; at most num_micro_batches, the most a step was laid out for."""
        limit = self.plugin.num_micro_batches
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise MegatronPluginConfigError(
                "micro_batch_count", n, f"give a whole number of micro-batches from 1 to num_micro_batches={limit}")
        previous, self._micro_batch_count = self._micro_batch_count, n
        try:
            yield
        finally:
            self._micro_batch_count = previous

    def _micro_count(self) -> int:
        return self._micro_batch_count or self.plugin.num_micro_batches

    def micro_batches(self, batch, step) -> List[Dict[str, torch.Tensor]]:
        """The batch's tensors on the device, checked for shape and cut into the plugin's micro-batches,
        each this context-parallel rank's part of the sequence: the one place where micro-batches are formed."""
        tensors = self._batch_tensors(batch, step)
        n = self._micro_count()
        batch = {k: v.to(self.device) for k, v in tensors.items()}
        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
        micro = [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]
        if cp_size == 1:
            return micro
        # what needs the whole sequence (shifted labels, DPO's joined sides), before the split
        split = getattr(step, "before_sequence_split", None)
        micro = [split(mb) for mb in micro] if split is not None else micro
        # the ids the split follows: `input_ids` once `before_sequence_split` has made them (DPO joins its two
        # sides there), else the step's own input key
        key = "input_ids" if all("input_ids" in mb for mb in micro) else step.input_key
        ids = [mb.get(key) for mb in micro]
        if all(torch.is_tensor(t) and t.dim() == 2 for t in ids) and any(t.shape[1] % (2 * cp_size) for t in ids):
            # left whole: the batch check refuses the length on every rank together (its all-reduce); raising
            # here, on the ranks whose batch has it, would leave the other data-parallel ranks waiting there
            return micro
        return [shard_sequence(mb, cp_size, cp_rank, input_key=key) for mb in micro]

    def _batch_tensors(self, batch, step) -> Dict[str, torch.Tensor]:
        """The batch's tensors, refused unless they are token ids (and what goes with them) whose rows
        split evenly into the plugin's micro-batches."""
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
        n = self._micro_count()
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
        return tensors

    def check_batch(self, batch, step, micro_batches=(), need_loss: bool = True, defer: bool = False):
        """The batch check (engine/batch_check.py) for this step: True, False (no loss token) or, with
        `defer`, a `DeferredCheck`."""
        return self.batch_check.check(batch, step, micro_batches, iteration=self.iteration, need_loss=need_loss,
                                      defer=defer)

    # -- forward passes -------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward_micro_batch(self, micro_batch, forward_step=None):
        """(output, what the loss function returns) of one micro-batch through the train step's forward_step (or
        `forward_step`): (loss, logs), or with calculate_per_token_loss (loss sum, token count, logs)."""
        forward_step = forward_step or self.train_step_handler.forward_step
        with self._autocast():
            output_tensor, loss_func = forward_step(iter([micro_batch]), self.model.module)
            if self.expert_load is not None:
                self.expert_load.add(self.model.module)
            return output_tensor, loss_func(output_tensor)

    def run_forward_only(self, micro_batches, forward_step=None, step=None) -> List[Dict[str, torch.Tensor]]:
        """Each micro-batch's logs, forward only. `step` is the train step `forward_step` belongs to (the
        CUDA engine's schedule takes its shapes from it); here the micro-batches run one by one."""
        collected = []
        for mb in micro_batches:
            _, result = self.forward_micro_batch(mb, forward_step)
            collected.append(result[-1])
        return collected

    def gather_rows(self, collected, key) -> torch.Tensor:
        """The micro-batches' [b, s] outputs under `key`, concatenated into the batch's."""
        return torch.cat([c[key] for c in collected])

    def _eval_step(self, micro_batches):
        collected = self.run_forward_only(micro_batches)
        return average_logs(collected), self._collect_logits(collected)

    def _collect_logits(self, collected):
        """Logits of the whole batch, gathered over TP (and under context parallelism over the CP ranks, in
        sequence order) and cut to the true vocabulary (last stage)."""
        parts = [c["logits"] for c in collected if "logits" in c]
        if not parts:
            return None
        full = gather_tensor_parallel_last_dim(unshard(torch.cat(parts), 1))
        return full[..., : self.model.hf_config.vocab_size]

    # -- post-training --------------------------------------------------------------------------------
    def compute_log_probs(self, batch, temperature: float = 1.0, entropy: bool = False):
        """Forward only, in eval mode (no dropout): token-aligned log-probabilities [b, s] (fp32) of the
        batch's tokens, out[:, t] = log p(token t | what precedes it) under softmax(logits / temperature);
        0 where nothing scores a token (the first position of a causal LM, labels of -100). The batch is
        what the train step takes (input_ids, attention_mask, labels, position_ids / T5's labels / BERT's
        labels). With `entropy`, returns (log_probs, entropy). Computed vocab-parallel over TP, micro-batch by
        micro-batch through the pipeline; every rank gets the result. Collective over the model replica."""
        return self.log_probs.compute(self, batch, temperature, entropy)

    def check_ready(self, what: str, swapped_ok: bool = False, offloaded_ok: bool = False):
        """Refuse `what` while the model is offloaded or (unless `swapped_ok`) holds a snapshot's weights."""
        self.post_training.check_ready(what, swapped_ok=swapped_ok, offloaded_ok=offloaded_ok)

    def check_between_steps(self, what: str):
        self.post_training.check_between_steps(what)

    def snapshot_weights(self):
        """A host copy (pinned, on CUDA) of this rank's parameters as they are now, e.g. the reference policy
        of a KL term: `with engine.use_weights(snapshot): ref = engine.compute_log_probs(batch)`. Costs one
        copy of the (mixed-precision) parameters in host memory, none on the device."""
        return self.post_training.snapshot()

    def use_weights(self, snapshot) -> "UsingWeights":
        """Run the model with a snapshot's weights inside the `with` block (forward only: log-probs,
        generation, evaluation), and its own weights again after it, bit for bit. Swaps bytes with host
        memory: no second model on the device."""
        return UsingWeights(self, snapshot)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True):
        """Move the parameters, gradients and optimizer state to host memory (pinned, on CUDA) and free
        their device memory, e.g. for a rollout engine between training phases. `reload()` brings them
        back bit for bit. Returns bytes moved per kind. Not while a step runs."""
        return self.post_training.offload(params, grads, optimizer)

    def reload(self):
        """Bring back what `offload()` moved to host memory (a no-op when nothing is offloaded)."""
        return self.post_training.reload()

    @property
    def is_offloaded(self) -> bool:
        return self.post_training.is_offloaded

    def disable_adapter(self):
        """peft's idiom on the prepared PeftModel: `with model.disable_adapter():` the model runs its base
        weights (log-probs, generation, evaluation: the KL reference with no snapshot and no second model), and
        its adapters again after the block."""
        from .lora import adapters_disabled

        if self.lora is None:
            raise MegatronPluginConfigError(
                "disable_adapter()", "a model without LoRA adapters",
                "it is for a peft PeftModel passed to prepare (peft.get_peft_model(model, LoraConfig(...))); for "
                "another reference model use accelerator.snapshot_weights() and use_weights()",
            )
        saved = self.lora.spec.modules_to_save
        if saved:
            # peft's disable_adapter() also swaps each modules_to_save copy back to its original, which the
            # Megatron model does not keep
            raise MegatronPluginConfigError(
                "disable_adapter()", f"modules_to_save={list(saved)}",
                "the original weights of modules_to_save are not kept, so the base model cannot be run: for a "
                "reference model take accelerator.snapshot_weights() before training and use_weights(), or train "
                "without modules_to_save",
            )
        return adapters_disabled(self.chunks)

    # -- conveniences -----------------------------------------------------------------------------
    def megatron_generate(self, inputs, attention_mask=None, *args, **kwargs):
        """Generate with the tensor-parallel model (see `megatron_plugin.generation.generate`). Arguments
        after the mask may come by position in accelerate's order (max_length, max_new_tokens, num_beams,
        temperature, top_k, top_p, ...)."""
        from ..generation.generate import megatron_generate

        self.check_ready("megatron_generate", swapped_ok=True)
        return megatron_generate(self, inputs, attention_mask, *args, **kwargs)

    def save_pretrained(self, save_directory, **kwargs):
        """HF's save_pretrained (engine/export.py): an HF checkpoint from_pretrained loads. Collective."""
        from .export import save_pretrained

        self.check_ready("save_pretrained")
        return save_pretrained(self, save_directory, **kwargs)

    def iter_hf_weights(self, grads: bool = False, merge_lora: bool = False):
        """(HF name, full tensor) of the whole model, one at a time, on every rank (collective: every rank
        of the replica consumes it to the end): for pushing weights into an inference engine after a step.
        A LoRA model's base weights, or with `merge_lora` its weights with the adapters merged in."""
        from .export import iter_hf_weights

        self.check_ready("iter_hf_weights", swapped_ok=True)
        return iter_hf_weights(self, grads=grads, merge_lora=merge_lora)

    def hf_state_dict(self):
        """The full HF state dict of this pipeline stage (collective over the TP group)."""
        return self.model.hf_state_dict()


def average_logs(collected: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Every value a loss function logged, over the step's micro-batches: a scalar is averaged; a [sum, count]
    pair (calculate_per_token_loss, Megatron-LM's reporting) is added up and logged as sum / count."""
    if not collected:
        return {}
    out = {}
    for k, v in collected[0].items():
        if not torch.is_tensor(v):
            continue
        if v.dim() == 0:
            out[k] = torch.stack([c[k].detach().float() for c in collected]).mean()
        elif is_sum_and_count(v):
            total, count = torch.stack([c[k].detach().float() for c in collected]).sum(0)
            out[k] = total / count.clamp_min(1.0)
    return out


def is_sum_and_count(value) -> bool:
    """A per-token log value: [sum, count] (train_steps.utils.sum_across_data_parallel_group)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == 2
