"""Dropout inside compiled layers that draws from megatron-core's model-parallel RNG stream (its CUDA RNG tracker).

Where a tensor is split over TP ranks (attention heads, a row linear's input features), each rank must draw its
own mask, which megatron-core does by forking its tracker around the dropout. Traced by torch.compile, that fork's
RNG-state swaps broke the layer's graph and dynamo then kept compiling torch.cuda's lazy-call frames: a compiled
GPT-2 layer with attention dropout had not finished its first step after 7 minutes (H200, 2026-11-30). So the fork
runs outside dynamo, as one graph break, and only where a split tensor needs it (TP > 1 without SP; at TP = 1 the
tracker's stream is the default one's twin)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def tracker_fork_needed(dropout_p: float, on_cuda: bool, sequence_parallel: bool) -> bool:
    """Whether a dropout of a TP-split tensor inside a transformer layer forks the tracker: dropout on, CUDA,
    TP > 1, the tracker set, and no sequence parallelism (megatron-core's block then runs every layer inside the
    fork already)."""
    if not (dropout_p > 0 and on_cuda and not sequence_parallel and parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() > 1):
        return False
    return tensor_parallel.get_cuda_rng_tracker().is_initialized()


@torch._dynamo.disable
def in_tracker_fork(fn, *args):
    """`fn(*args)` inside the tracker's fork, run eagerly between the compiled graphs around it."""
    with tensor_parallel.get_cuda_rng_tracker().fork():
        return fn(*args)


def dropout_call(fn, *args, dropout_p: float, on_cuda: bool, sequence_parallel: bool):
    """`fn(*args)` (a dropout of a TP-split tensor, or what contains one) inside the tracker's fork where
    `tracker_fork_needed` says so, else as it is."""
    if tracker_fork_needed(dropout_p, on_cuda, sequence_parallel):
        return in_tracker_fork(fn, *args)
    return fn(*args)
