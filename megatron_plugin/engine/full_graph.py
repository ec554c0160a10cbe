"""Megatron's full-iteration CUDA graph (`cuda_graph_impl="local"`, `cuda_graph_scope="full_iteration"`).

A training step's forward and backward, as megatron-core's schedule runs them (every micro-batch, DDP's hooks
and bucketed reductions, TP's collectives, finalize_model_grads), recorded once as one CUDA graph and then
replayed: the host launches the step's thousands of kernels in one call instead of one Python call each. Where
the host bounds the step (tensor parallelism's ~360 collectives a step, small models) the GPU then runs without
gaps. The optimizer step stays outside, as in Megatron-LM.

megatron-core has the same thing as `FullCudaGraphWrapper`; it is not used because it keeps one graph per process
in class attributes (a second engine in the process would replay the first one's graph), also captures evaluation
steps, and copies new batches into the captured buffers without checking their shapes.

A graph replays the shapes and the host-side decisions (padding or not) it was captured with, so there is one
graph per batch layout: a layout first runs eagerly (which compiles and tunes what it needs), is captured the
next time it comes, and is replayed from then on; the graphs share one memory pool. A weight or gradient buffer
that moved (offloaded and brought back) has the graphs captured again at the new places.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..plugin import GRAPH_SETTING as SETTING, REMOVE_GRAPH

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4  # batch layouts with a graph of their own; steps of further layouts run eagerly (with a warning)
_LIVE: "weakref.WeakSet[FullIterationGraph]" = weakref.WeakSet()  # every one the process holds (release_all)


def _facts(t: torch.Tensor) -> Tuple:
    """What the host knows of a tensor besides its values (the batch check's padding facts, layers/masks.KNOWN):
    a captured step took its decisions from them."""
    return tuple(sorted((k, repr(v)) for k, v in vars(t).items()))


def batch_layout(micro_batches: List[dict]) -> Tuple:
    """What a captured step depends on in its micro-batches: their number, and each value's key, shape, dtype and
    host-side facts (a tensor) or the value itself (anything else, which the captured step saw once)."""
    return tuple(
        tuple((k, ("tensor", tuple(v.shape), v.dtype, _facts(v)) if torch.is_tensor(v) else ("value", repr(v)))
              for k, v in sorted(mb.items()))
        for mb in micro_batches)


def _static_copy(micro_batches: List[dict], device) -> List[dict]:
    out = []
    for mb in micro_batches:
        static = {}
        for k, v in mb.items():
            if torch.is_tensor(v):
                static[k] = v.detach().to(device, copy=True)
                vars(static[k]).update(vars(v))
            else:
                static[k] = v
        out.append(static)
    return out


def _clone_result(collected):
    """The step's logged values, out of the graph's memory: the next replay overwrites its outputs."""
    if torch.is_tensor(collected):
        return collected.clone()
    if isinstance(collected, dict):
        return {k: _clone_result(v) for k, v in collected.items()}
    if isinstance(collected, (list, tuple)):
        return type(collected)(_clone_result(v) for v in collected)
    return collected


class Captured:
    """One batch layout's graph: the static micro-batches it reads, the outputs it writes, when it was captured."""

    def __init__(self, graph, static: List[dict], result, step: int, held: List[torch.Tensor]):
        self.graph, self.static, self.result, self.step = graph, static, result, step
        self.held = held  # buffers made outside the graph that it writes into (see _buffers_in_use)


class FullIterationGraph:
    """The training steps' forward and backward: eager for `warmup_steps` (compiling, lazy initialisations), then
    captured and replayed, per batch layout (module docstring). `places` gives the tensors whose addresses the
    graphs hold (weights, gradient buffers); `generators` the RNG states the step draws from besides the default
    one (megatron-core's tracker)."""

    def __init__(self, warmup_steps: int, device: torch.device, places: Callable[[], List[torch.Tensor]],
                 generators: Callable[[], List[torch.Generator]], stream: Optional[torch.cuda.Stream] = None):
        self.warmup_steps = warmup_steps
        self.device = device
        # the stream to capture on: the one the weights' gradient accumulators (and DDP's hooks on them) were made
        # on. Captured on another, each accumulator ran on its own stream beside the capturing one, and a gradient
        # freed there went back to the capturing stream's pool while still being read: DP = 2's grad norm came out
        # 1.3% off at the captured step and different run to run after (two H200s, 2026-11-30); on the
        # accumulators' stream the graph trains bit for bit as the eager step
        self.stream = stream
        self._places = places
        self._generators = generators
        self.eager_steps = 0
        self.captures = 0
        self.replays = 0
        self._captured: Dict[Tuple, Captured] = {}
        self._ran_eagerly = set()  # layouts whose step has run once: compiled, ready to be captured
        self._addresses = None
        self._pool = None
        self._warned = False
        _LIVE.add(self)

    def release(self) -> None:
        """Drop every captured graph; a later step of a layout that ran before is captured again."""
        for entry in self._captured.values():
            entry.graph.reset()
        self._captured.clear()
        self._pool = None
        self._addresses = None

    def _current_addresses(self) -> Tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._places())

    def _eager(self, micro_batches, schedule, layout):
        self.eager_steps += 1
        self._ran_eagerly.add(layout)
        return schedule(micro_batches)

    def run(self, micro_batches: List[dict], schedule: Callable[[List[dict]], list], step: int,
            host_state: Tuple = ()):
        """`schedule(micro_batches)` (the forward-backward of one training step), run eagerly, captured or
        replayed; returns what it returns, in memory of its own. `host_state`: what else the step's code paths
        depend on (FP8's settled scaling states): a step with new host state is a new layout, run eagerly once
        (compiling its code paths outside any capture) before it is captured."""
        layout = (batch_layout(micro_batches), tuple(host_state))
        # graphs of an earlier host state are never replayed again (FP8 states settle once): their memory and
        # places go
        for stale in [k for k in self._captured if k[1] != layout[1]]:
            self._captured.pop(stale).graph.reset()
        if not self._captured and self.eager_steps < self.warmup_steps:
            return self._eager(micro_batches, schedule, layout)
        if self._captured and self._current_addresses() != self._addresses:
            logger.info("full-iteration CUDA graph: weights or gradient buffers moved; capturing the step again")
            for entry in self._captured.values():
                entry.graph.reset()
            self._captured.clear()
            self._pool = None  # the graphs that used it are gone: the next capture starts a pool of its own
        entry = self._captured.get(layout)
        if entry is None:
            if layout not in self._ran_eagerly:
                return self._eager(micro_batches, schedule, layout)
            if len(self._captured) >= MAX_GRAPHS:
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "%s='full_iteration': training batches came in more than %d layouts (shapes, micro-batch "
                        "counts, padding); steps of further layouts run without the graph. Pad batches to one "
                        "length (and drop_last=True) for every step to replay", SETTING, MAX_GRAPHS)
                return self._eager(micro_batches, schedule, layout)
            entry = self._capture(micro_batches, schedule, step)
            self._captured[layout] = entry
            self._addresses = self._current_addresses()
            self.captures += 1
            logger.info("full-iteration CUDA graph captured at training step %s (%s)", step, _describe(layout))
        else:
            for static, mb in zip(entry.static, micro_batches):
                for k, v in mb.items():
                    if torch.is_tensor(v):
                        static[k].copy_(v, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return _clone_result(entry.result)

    def _capture(self, micro_batches, schedule, step) -> Captured:
        static = _static_copy(micro_batches, self.device)
        graph = torch.cuda.CUDAGraph()
        for gen in self._generators():
            graph.register_generator_state(gen)
        if dist.is_initialized():
            dist.barrier()  # every rank records its collectives in the same step
        torch.cuda.synchronize()
        stream = self.stream if self.stream is not None else torch.cuda.Stream()
        try:
            # one pool for every layout's graph: they never run at the same time, and results are copied out
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                result = schedule(static)
        except Exception as e:
            raise RuntimeError(
                f"{SETTING}='full_iteration': capturing training step {step} as a CUDA graph failed ({e}). Every "
                "step must run its GPU work without the host waiting for it: no .item(), .cpu(), .tolist() or "
                "data-dependent shapes in the forward and backward (the train step's forward and loss, a custom "
                f"get_batch or loss function, hooks); {REMOVE_GRAPH} to train without the graph") from e
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        self._pool = graph.pool() if self._pool is None else self._pool
        return Captured(graph, static, result, step, held=_buffers_in_use())


def release_all() -> None:
    """Drop the captured graphs of every engine in the process, before its process groups are destroyed. NCCL
    (2.26 and later) destroys a communicator only once every CUDA graph that captured work on it is gone, and an
    engine's graphs go only with the engine (which Python's cycle collector frees when it runs): so
    `destroy_process_group` (accelerate's `end_training`, our test harness between tasks) waited forever with the
    graph alive (two H200s, 2026-11-30: a two-GPU graph test, then the next task never started; NVIDIA's CUDA-graph
    troubleshooting guide lists the same hang)."""
    graphs = list(_LIVE)
    for g in graphs:
        g.release()
    if graphs and torch.cuda.is_available():
        torch.cuda.synchronize()  # a replay still running holds its graph's NCCL references until it ends


def _buffers_in_use() -> List[torch.Tensor]:
    """megatron-core's shared buffer (its SP linears gather into it): the graph writes into the one it saw, and a
    later larger request (an eager step of a longer layout, an evaluation) replaces it; held here, the old one is
    not handed to anything else while the graph still writes into it."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    return list(getattr(buffer, "buffer", {}).values())


def _describe(layout) -> str:
    layout = layout[0]
    first = ", ".join(f"{k} {tuple(v[1]) if v[0] == 'tensor' else v[1]}" for k, v in layout[0]) if layout else ""
    return f"{len(layout)} x [{first}]"
