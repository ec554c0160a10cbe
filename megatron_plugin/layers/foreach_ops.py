"""apex's multi-tensor kernels (`amp_C.multi_tensor_l2norm` / `multi_tensor_scale`) on torch's foreach ops.

Without Transformer Engine or apex, Megatron-Core falls back to per-tensor Python loops for the grad
norm, grad clipping and the copy of fp32 main weights into the bf16/fp16 model. Its norm fallback
also reads every per-tensor norm back to the host (`torch.tensor(list of CUDA scalars)`), one
device sync per parameter tensor, every step. torch's `_foreach_*` kernels do the same work in a few
launches and no sync. mcore picks its implementation at import time into module globals; `patches.py`
swaps ours in there, and only where mcore's own loop fallback is in place (TE / apex stay preferred).
"""

from __future__ import annotations

from typing import List

import torch


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor, *args):
    """The global L2 norm of tensor_lists[0], as a 1-element fp32 tensor on their device."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists: List[List[torch.Tensor]], scale: float):
    """dst = src * scale for each pair (src and dst may be the same tensors, may differ in dtype)."""
    src, dst = tensor_lists
    if not src:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def by_dtype(dst: List[torch.Tensor], src: List[torch.Tensor]) -> List[tuple]:
    """[(dsts, srcs)] with one destination dtype each, for `copy_`: older torch picked `_foreach_copy_`'s fast
    kernel by the first pair's dtype. Callers that copy the same lists every step group them once."""
    groups = {}
    for d, s in zip(dst, src):
        ds, ss = groups.setdefault(d.dtype, ([], []))
        ds.append(d)
        ss.append(s)
    return list(groups.values())


def copy_(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, in one foreach launch per destination dtype."""
    for d, s in by_dtype(dst, src):
        torch._foreach_copy_(d, s)


def multi_tensor_applier(op, noop_flag, tensor_lists, *args):
    return op(2048 * 32, noop_flag, tensor_lists, *args)
