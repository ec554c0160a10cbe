"""Gradient clipping with the norm left on the device.

mcore's optimizer step reads the global gradient norm back to the host (`total_norm.item()`) to decide
whether to clip: one host-device sync per step, after which the GPU idles while the host launches the
update. torch's fused Adam(W) can take that decision on the device: it divides the gradients by its
`grad_scale` and skips the update where `found_inf` is set (the hooks GradScaler uses). So the clip
factor and the non-finite check ride into the update kernel and nothing waits. A step with a
non-finite norm leaves the weights as they were (mcore would apply the NaN update under bf16).

With MoE expert parallelism mcore chains a dense and an expert optimizer whose norms are reduced over
different groups (model-parallel, expert tensor x expert x pipeline): each part's squares are summed over its
own group and the parts added, as mcore's ChainedOptimizer.get_grad_norm does, still on the device.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from ..layers.foreach_ops import multi_tensor_l2norm


def _subs(megatron_optimizer):
    subs = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    return [o for o in subs if not getattr(o, "is_stub_optimizer", False)]


def supported(megatron_optimizer) -> bool:
    """True when every inner optimizer is torch's fused Adam(W) without a loss scaler (bf16 or fp32),
    and the norm is taken over one group, as mcore's ChainedOptimizer does then."""
    subs = _subs(megatron_optimizer)
    if not subs:
        return False
    for o in subs:
        inner = getattr(o, "optimizer", None)
        if getattr(o, "grad_scaler", None) is not None or o.config.log_num_zeros_in_grad:
            return False
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            return False
        if not all(g.get("fused") for g in inner.param_groups):
            return False
    return True


def _shared_group(megatron_optimizer) -> bool:
    shared = getattr(megatron_optimizer, "grads_states_parallel_group_is_shared", None)  # chained only
    return shared is None or shared()


def _squares(grads, device_of) -> torch.Tensor:
    if grads:
        return multi_tensor_l2norm(None, None, [grads], False)[0] ** 2
    return torch.zeros(1, dtype=torch.float32, device=device_of())


@torch.no_grad()
def step(megatron_optimizer) -> Tuple[torch.Tensor, torch.Tensor]:
    """mcore's optimizer step (copy grads to the main grads, global norm, clip, update, copy the main
    weights back) with no host read. Returns the global gradient norm and whether the update was
    skipped (non-finite norm), both as device tensors."""
    subs = _subs(megatron_optimizer)
    megatron_optimizer.prepare_grads()  # without a loss scaler this only copies, and finds nothing
    device_of = lambda: next(p for o in subs for g in o.optimizer.param_groups for p in g["params"]).device
    if _shared_group(megatron_optimizer):
        # as mcore's get_grad_norm_fp32: the local norm squared, summed over the group
        sq = _squares([g for o in subs for g in o.get_main_grads_for_grad_norm()], device_of)
        dist.all_reduce(sq, group=megatron_optimizer.get_grad_stats_parallel_group())
    else:
        parts = []
        for o in subs:
            part = _squares(o.get_main_grads_for_grad_norm(), device_of)
            dist.all_reduce(part, group=o.get_grad_stats_parallel_group())
            parts.append(part)
        sq = torch.stack(parts).sum(0)
    norm = sq.sqrt().reshape(())
    skipped = ~torch.isfinite(norm)
    found_inf = skipped.float()  # 0-dim, like the step counters it is subtracted from
    clip = subs[0].config.clip_grad
    # mcore multiplies the gradients by clip / (norm + 1e-6) when that is below 1; Adam divides by this
    grad_scale = torch.clamp((norm + 1.0e-6) / clip, min=1.0) if clip > 0 else None
    for o in subs:
        o.optimizer.grad_scale, o.optimizer.found_inf = grad_scale, found_inf
    try:
        megatron_optimizer.step_with_ready_grads()
    finally:
        for o in subs:
            del o.optimizer.grad_scale, o.optimizer.found_inf
    return norm, skipped
