"""The gradients every tensor-parallel rank holds whole, summed over the TP group once a step.

Under sequence parallelism each TP rank sees its part of the sequence, so the norms' weights and biases and the
row-parallel linears' biases (mcore marks them `sequence_parallel`) get part of their gradient on each rank;
Qwen3's per-head q/k norms likewise. megatron-core's finalize_model_grads sums them in one all-reduce, but each step
it first walks every named parameter to find them and afterwards copies each result back with its own copy_:
at GPT-2 774M, TP = 2 + SP, 219 launches a step, which left the GPU 6 ms idle a step under the profiler in a step the
host bounds. The parameters are the same every step, so they are found once per model chunk, and the results go back
in one foreach copy. Same all-reduce, same sums: the gradients are bit for bit mcore's.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .comm import all_reduce_in_place

# model chunk -> ((sequence_parallel, qk_layernorm), params summed, params averaged)
_SELECTED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _select(chunk: torch.nn.Module, config) -> tuple:
    """mcore's choice (megatron-core 0.16.1, finalize_model_grads._allreduce_non_tensor_model_parallel_grads)."""
    from megatron.core.utils import get_attr_wrapped_model

    key = (bool(config.sequence_parallel), bool(config.qk_layernorm))
    cached = _SELECTED.get(chunk)
    if cached is not None and cached[0] == key:
        return cached
    summed, averaged = [], []
    for name, param in get_attr_wrapped_model(chunk, "named_parameters")():
        if not param.requires_grad:
            continue
        if getattr(param, "average_gradients_across_tp_domain", False):
            averaged.append(param)
        elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            summed.append(param)
    _SELECTED[chunk] = cached = (key, summed, averaged)
    return cached


def _grads(params) -> List[torch.Tensor]:
    """Their gradients now (trainability is fixed at prepare, before DDP builds its buckets: a weight frozen later
    keeps a zeroed main_grad, which adds nothing to the sums)."""
    out = []
    for p in params:
        g = p.main_grad if hasattr(p, "main_grad") else p.grad
        if g is not None:
            out.append(g.data)
    return out


def allreduce_non_tensor_model_parallel_grads(model: List[torch.nn.Module], config, tp_group=None,
                                              *, fallback: Optional[Callable] = None) -> None:
    """mcore's `_allreduce_non_tensor_model_parallel_grads(model, config, tp_group)`, its parameters found once and
    its results copied back in one launch. Megatron-FSDP's DTensor gradients take mcore's own (`fallback`)."""
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    if tp_group is None:
        tp_group = get_tensor_model_parallel_group()
    if tp_group.size() <= 1:
        return
    if any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in model):
        return fallback(model, config, tp_group)
    summed, averaged = [], []
    for chunk in model:
        _, s, a = _select(chunk, config)
        summed += s
        averaged += a
    for params, op in ((summed, dist.ReduceOp.SUM), (averaged, dist.ReduceOp.AVG)):
        grads = _grads(params)
        if not grads:
            continue
        all_reduce_in_place(grads, tp_group, op)
