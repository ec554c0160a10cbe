"""TensorBoard scalars of every training step, for the plugin's `tensorboard_dir`, under the tags
Megatron-LM's `training_log` gives them (what accelerate's integration wrote through it).

Every rank calls `log_step` after a step: the parameter norm of `set_all_logging_options` is a collective
over the model-parallel ranks. Global rank 0 writes: the step's logged losses are already averaged over
data-parallel ranks and shared from the last pipeline stage, so rank 0 holds the values every rank holds.
The learning rate is the one the scheduler left for the next step, as Megatron-LM and accelerate read it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import resource
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..fs import check_writable


def check_tensorboard(plugin) -> None:
    """At prepare, before any process group: the package is there and the folder can be written."""
    if plugin.tensorboard_dir is None:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise MegatronPluginConfigError(
            "tensorboard_dir", plugin.tensorboard_dir,
            "writing TensorBoard logs needs the tensorboard package: pip install tensorboard (or "
            "pip install megatron_plugin[tensorboard]), or leave tensorboard_dir unset",
        )
    check_writable(os.fspath(plugin.tensorboard_dir), "tensorboard_dir")


def _scalar(value) -> Optional[float]:
    if value is None:
        return None
    value = float(value.detach().float().item() if torch.is_tensor(value) else value)
    return value if math.isfinite(value) else None


class TensorBoardLogger:
    """`log_step(step, outputs, optimizer, engine)` after each training step (engine/base.py)."""

    def __init__(self, plugin):
        self.log_dir = os.fspath(plugin.tensorboard_dir)
        self.all = plugin.set_all_logging_options
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_step(self, step: int, outputs: dict, optimizer, engine) -> None:
        """Write the step's scalars: its logged losses (e.g. 'lm loss'; with MoE 'load_balancing_loss', per
        layer 'tokens per expert/layer n/expert e', 'dropped fraction'), 'learning-rate', 'grad-norm',
        'loss-scale' (fp16), 'skipped-train-steps', 'batch-size', 'world-size'; with set_all_logging_options
        also 'params-norm' and memory. Collective only with set_all_logging_options (the parameter norm)."""
        params_norm = self.params_norm(engine) if self.all else None
        if dist.get_rank() != 0:
            return
        w = self.writer
        for key, value in outputs.items():
            if torch.is_tensor(value) and value.dim() == 0 or isinstance(value, (int, float)):
                w.add_scalar(key, float(value), step)
            elif torch.is_tensor(value) and value.dim() == 1:  # an MoE layer's tokens per expert
                for e, v in enumerate(value.tolist()):
                    w.add_scalar(f"{key}/expert {e}", v, step)
        w.add_scalar("learning-rate", optimizer.param_groups[0]["lr"], step)
        grad_norm = _scalar(engine.last_grad_norm)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, step)
        if getattr(engine, "dtype", None) is torch.float16 and hasattr(optimizer, "get_loss_scale"):
            w.add_scalar("loss-scale", _scalar(optimizer.get_loss_scale()), step)
        w.add_scalar("skipped-train-steps", float(engine.last_step_skipped), step)
        plugin = engine.plugin
        global_batch = getattr(plugin, "global_batch_size", None)
        if global_batch is not None:
            w.add_scalar("batch-size", global_batch, step)
        w.add_scalar("world-size", dist.get_world_size(), step)
        if self.all:
            w.add_scalar("params-norm", params_norm, step)
            for tag, value in self.memory(engine.device).items():
                w.add_scalar(tag, value, step)
        w.flush()

    @staticmethod
    @torch.no_grad()
    def params_norm(engine) -> float:
        """L2 norm of the whole model's parameters: tensor-parallel shards counted once each, replicated
        tensors once (TP rank 0), pipeline stages summed. Collective over the model-parallel group."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sq = torch.zeros((), dtype=torch.float32, device=engine.device)
        expert_sq = torch.zeros((), dtype=torch.float32, device=engine.device)
        experts = False
        for chunk in engine.chunks:
            for p in chunk.module.parameters():
                if not getattr(p, "allreduce", True):  # an expert-parallel MoE expert: its own group below
                    experts = True
                    expert_sq += p.detach().float().pow(2).sum()
                    continue
                if not (getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
                    continue
                if getattr(p, "shared", False):  # the last stage's copy of tied embeddings (Megatron-LM skips it too)
                    continue
                sq += p.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        if experts:  # each expert tensor lives on one rank of the expert tensor x expert x pipeline group
            dist.all_reduce(expert_sq, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
            sq = sq + expert_sq
        return sq.sqrt().item()

    @staticmethod
    def memory(device) -> dict:
        if device.type == "cuda":
            return {"mem-allocated-bytes": torch.cuda.memory_allocated(device),
                    "mem-max-allocated-bytes": torch.cuda.max_memory_allocated(device),
                    "mem-reserved-bytes": torch.cuda.memory_reserved(device)}
        # ru_maxrss is in KiB on Linux
        return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
