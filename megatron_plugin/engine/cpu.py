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
from ..errors import MegatronPluginConfigError
from ..models.modeling import MegatronModel


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

    # -- the step -------------------------------------------------------------------------------
    def forward(self, **batch):
        micro_batches = self._split(batch)
        cls = self.train_step_handler.model_output_class
        if not self._check_batch(batch):
            # no token of the whole step carries a loss: say so, and leave the weights alone
            self.last_step_skipped = True
            if self.training:
                self.iteration += 1
            nan = torch.full((), float("nan"), device=self.device)
            return cls(loss=nan, logits=None) if cls is not None else nan
        with self.rng.active():
            if self.training:
                logs = self._train_step(micro_batches)
                logits = None
            else:
                with torch.no_grad():
                    logs, logits = self._eval_step(micro_batches)
        loss = sum(logs.values()) if logs else torch.zeros((), device=self.device)
        return cls(loss=loss, logits=logits) if cls is not None else loss

    def _split(self, batch) -> List[Dict[str, torch.Tensor]]:
        if not batch:
            raise MegatronPluginConfigError("batch", {}, "pass the dataloader's batch: model(**batch)")
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        if "input_ids" not in tensors:
            raise MegatronPluginConfigError(
                "batch", sorted(batch), "the batch needs 'input_ids' (a [batch, sequence] tensor of token ids)"
            )
        ids = tensors["input_ids"]
        if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0 or ids.is_floating_point():
            raise MegatronPluginConfigError(
                "input_ids", f"{ids.dtype} tensor of shape {tuple(ids.shape)}",
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
                    f"batch[{k!r}]", tuple(v.shape), f"every tensor of the batch needs the {size} rows of input_ids first"
                )
        batch = {k: v.to(self.device) for k, v in tensors.items()}
        return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]

    def _check_batch(self, batch) -> bool:
        """Refuse token ids or labels the model cannot have, or a sequence longer than its positions, on
        every rank alike (one small all-reduce, so no rank is left waiting in a collective). Returns
        False when no token of the whole step carries a loss."""
        cfg = self.model.hf_config
        vocab = cfg.vocab_size
        ids = batch["input_ids"]
        labels = batch.get("labels")
        limit = self.model.family.position_limit(cfg)
        local = torch.zeros(4, dtype=torch.int64, device=self.device)
        ids_bad = (ids.min() < 0) | (ids.max() >= vocab)
        decoder_ids = batch.get("decoder_input_ids")
        if torch.is_tensor(decoder_ids):
            ids_bad = ids_bad | (decoder_ids.min() < 0) | (decoder_ids.max() >= vocab)
        local[0] = ids_bad.to(self.device)
        if torch.is_tensor(labels):
            labels = labels.to(self.device)
            local[1] = (((labels < 0) & (labels != -100)) | (labels >= vocab)).any()
        local[2] = int(limit is not None and ids.shape[1] > limit)
        tokens = self.train_step_handler.count_loss_tokens(batch)
        local[3] = 1 if tokens is None else tokens.to(self.device)
        status = local.clone()
        dist.all_reduce(status)
        bad_ids, bad_labels, too_long, tokens = status.tolist()
        here = " (this rank's batch)" if local[:3].any() else " (another rank's batch)"
        if bad_ids:
            raise MegatronPluginConfigError(
                "input_ids", f"ids outside [0, {vocab}){here}" + (f": min {int(ids.min())}, max {int(ids.max())}" if local[0] else ""),
                f"the model's vocabulary has {vocab} entries: use its tokenizer (or resize_token_embeddings before prepare)",
            )
        if bad_labels:
            raise MegatronPluginConfigError(
                "labels", f"ids outside [0, {vocab}) other than -100{here}",
                "labels are token ids of the model's vocabulary, or -100 for positions without loss",
            )
        if too_long:
            raise MegatronPluginConfigError(
                "sequence length", f"{ids.shape[1]} > {limit}{here}" if local[2] else f"> {limit}{here}",
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

    def _forward_micro_batch(self, micro_batch):
        step = self.train_step_handler
        with self._autocast():
            output_tensor, loss_func = step.forward_step(iter([micro_batch]), self.model.module)
            return output_tensor, loss_func(output_tensor)

    def _train_step(self, micro_batches):
        n = len(micro_batches)
        collected: List[Dict[str, torch.Tensor]] = []
        for mb in micro_batches:
            _, (loss, logs) = self._forward_micro_batch(mb)
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

    # -- conveniences -----------------------------------------------------------------------------
    def megatron_generate(self, inputs, attention_mask=None, **kwargs):
        """Generate with the tensor-parallel model (see `megatron_plugin.generation.generate`)."""
        from ..generation.generate import megatron_generate

        return megatron_generate(self, inputs, attention_mask, **kwargs)

    def iter_hf_weights(self, grads: bool = False):
        """(HF name, full tensor) of the whole model, one at a time, on every rank (collective: every rank
        of the replica consumes it to the end): for pushing weights into an inference engine after a step."""
        from .export import iter_hf_weights

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
