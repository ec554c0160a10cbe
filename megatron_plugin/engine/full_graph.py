"""Megatron's full-iteration CUDA graph (`cuda_graph_impl="local"`, `cuda_graph_scope="full_iteration"`).

A training step's forward and backward, as megatron-core's schedule runs them (every micro-batch, DDP's hooks
and bucketed reductions, TP's collectives, finalize_model_grads), recorded once as one CUDA graph and then
replayed: the host launches the step's thousands of kernels in one call instead of one Python call each. Where
the host bounds the step (tensor parallelism's ~360 collectives a step, small models) the GPU then runs without
gaps. The optimizer step stays outside, as in Megatron-LM.

megatron-core has the same thing as `FullCudaGraphWrapper`; it is not used because it keeps one graph per process
in class attributes (a second engine in the process would replay the first one's graph), also captures evaluation
steps, and copies new batches into the captured buffers without checking their shapes.

What a replay cannot do, this checks: a batch of another shape than the captured one is refused (the graph would
read the captured shapes), and a weight or gradient buffer that moved (offloaded and brought back) has the step
captured again at its new place.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import MegatronPluginConfigError

logger = logging.getLogger(__name__)

SETTING = "other_megatron_args['cuda_graph_scope']"


def batch_layout(micro_batches: List[dict]) -> Tuple:
    """What a captured step depends on in its micro-batches: their number, and each value's key, shape and dtype
    (a tensor) or the value itself (anything else, which the captured step saw once)."""
    return tuple(
        tuple((k, ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", repr(v)))
              for k, v in sorted(mb.items()))
        for mb in micro_batches)


def _static_copy(micro_batches: List[dict], device) -> List[dict]:
    return [{k: v.detach().to(device, copy=True) if torch.is_tensor(v) else v for k, v in mb.items()}
            for mb in micro_batches]


def _clone_result(collected):
    """The step's logged values, out of the graph's memory: the next replay overwrites its outputs."""
    if torch.is_tensor(collected):
        return collected.clone()
    if isinstance(collected, dict):
        return {k: _clone_result(v) for k, v in collected.items()}
    if isinstance(collected, (list, tuple)):
        return type(collected)(_clone_result(v) for v in collected)
    return collected


class FullIterationGraph:
    """The training steps' forward and backward: eager for `warmup_steps` (compiling, lazy initialisations), then
    captured and replayed. `places` gives the tensors whose addresses the graph holds (weights, gradient
    buffers); `generators` the RNG states the step draws from besides the default one (megatron-core's tracker)."""

    def __init__(self, warmup_steps: int, device: torch.device, places: Callable[[], List[torch.Tensor]],
                 generators: Callable[[], List[torch.Generator]]):
        self.warmup_steps = warmup_steps
        self.device = device
        self._places = places
        self._generators = generators
        self.eager_steps = 0
        self.captures = 0
        self.replays = 0
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static: Optional[List[dict]] = None
        self._layout = None
        self._addresses = None
        self._result = None
        self._captured_at = None

    def _current_addresses(self) -> Tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._places())

    def run(self, micro_batches: List[dict], schedule: Callable[[List[dict]], list], step: int):
        """`schedule(micro_batches)` (the forward-backward of one training step), run eagerly, captured or
        replayed; returns what it returns, in memory of its own."""
        if self._graph is None and self.eager_steps < self.warmup_steps:
            self.eager_steps += 1
            return schedule(micro_batches)
        layout = batch_layout(micro_batches)
        if self._graph is not None and layout != self._layout:
            raise MegatronPluginConfigError(
                SETTING, "full_iteration",
                f"training step {step} has micro-batches {_describe(layout)}, and the graph captured at step "
                f"{self._captured_at} replays {_describe(self._layout)} only: give every training batch the same "
                "shape (pad to a fixed length, drop_last=True in the DataLoader, the same number of micro-batches), "
                "or remove cuda_graph_impl / cuda_graph_scope from other_megatron_args")
        if self._graph is not None and self._current_addresses() != self._addresses:
            logger.info("full-iteration CUDA graph: weights or gradient buffers moved since step %s; capturing "
                        "the step again", self._captured_at)
            self._graph.reset()
            self._graph = None
        if self._graph is None:
            self._capture(micro_batches, schedule, layout, step)
        else:
            for static, mb in zip(self._static, micro_batches):
                for k, v in mb.items():
                    if torch.is_tensor(v):
                        static[k].copy_(v, non_blocking=True)
        self._graph.replay()
        self.replays += 1
        return _clone_result(self._result)

    def _capture(self, micro_batches, schedule, layout, step) -> None:
        self._static = _static_copy(micro_batches, self.device)
        graph = torch.cuda.CUDAGraph()
        for gen in self._generators():
            graph.register_generator_state(gen)
        if dist.is_initialized():
            dist.barrier()  # every rank records its collectives in the same step
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                self._result = schedule(self._static)
        except Exception as e:
            raise RuntimeError(
                f"{SETTING}='full_iteration': capturing training step {step} as a CUDA graph failed ({e}). Every "
                "step must run the same GPU work without waiting for it (no .item(), .cpu() or data-dependent "
                "shapes in the train step's forward or loss); remove cuda_graph_impl / cuda_graph_scope from "
                "other_megatron_args to train without the graph") from e
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        self._graph = graph
        self._layout = layout
        self._addresses = self._current_addresses()
        self._captured_at = step
        self.captures += 1
        logger.info("full-iteration CUDA graph captured at training step %s", step)


def _describe(layout) -> str:
    first = ", ".join(f"{k} {tuple(v[1]) if v[0] == 'tensor' else v[1]}" for k, v in layout[0]) if layout else ""
    return f"{len(layout)} x [{first}]"
