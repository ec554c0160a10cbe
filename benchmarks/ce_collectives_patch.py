"""An experiment for issue 32's TP = 2 + SP row, not a setting: SP's collectives on the copy engines.

At GPT-2 774M on two H200s the TP = 2 + SP step with the full-iteration graph is GPU-bound at 131 ms, ~47 ms of it
in NCCL's all-gathers and reduce-scatters between the GEMMs; every way of hiding them under the GEMMs has measured
at par or a loss (BENCHMARKS.md: symmetric-memory fused ops, two streams, Domino, Inductor's passes), NCCL's
kernels taking SMs and power from the GEMMs they overlap. torch's symmetric-memory "low-contention" collectives
move the data with the copy engines instead (a pull or push over NVLink, no SMs; a reduce-scatter's sum is one
small kernel): `benchmarks/async_tp_probe.py` times them against NCCL alone. This patch routes the compiled SP
linears' gathers and reduce-scatters (layers/compiled_linear.py: forward, and the backward's asynchronous ones)
through them, so that `train_throughput.py --sp_collectives ce` times the real step: faster if the copy engines
move the bytes faster, or if the backward's asynchronous collectives then overlap their GEMMs without slowing them.

Each op returns a tensor of its own (and waits through the event it registers); the patch copies it into the
buffer the caller made (one local copy of the result, ~15% of the collective's bytes-time: the row understates the
copy engines by that much). The first (eager) steps size the group's symmetric workspace before the graph's capture,
which cannot grow it. The all-reduce (TP without SP) stays NCCL's.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the lent machines require it (KINDS.md)


class _Done:
    """The work a copy-engine collective hands back: wait, then its result into the caller's buffer."""

    def __init__(self, result, out):
        self.result, self.out = result, out

    def wait(self):
        import torch

        torch.ops._c10d_functional.wait_tensor(self.result)
        self.out.copy_(self.result.view_as(self.out))
        return True


class _Dist:
    """torch.distributed as layers/compiled_linear.py sees it, with its two SP collectives on the copy engines."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def _name(group):
        import torch.distributed as dist

        from megatron_plugin.layers import compiled_linear

        name = (group or dist.group.WORLD).group_name
        compiled_linear._symm_mem(name, True)  # enable_symm_mem_for_group, once per group
        return name

    def all_gather_into_tensor(self, out, x, group=None, async_op=False):
        import torch

        done = _Done(torch.ops.symm_mem._low_contention_all_gather(x.contiguous(), self._name(group)), out)
        return done if async_op else done.wait() and None

    def reduce_scatter_tensor(self, out, x, op=None, group=None, async_op=False):
        import torch
        import torch.distributed as dist

        if op not in (None, dist.ReduceOp.SUM):
            return dist.reduce_scatter_tensor(out, x, op=op, group=group, async_op=async_op)
        done = _Done(torch.ops.symm_mem._low_contention_reduce_scatter(x.contiguous(), "sum", self._name(group)), out)
        return done if async_op else done.wait() and None


def install(mode: str) -> None:
    """`mode`: "nccl" (nothing changes) or "ce" (the compiled SP linears' collectives on the copy engines)."""
    if mode == "nccl":
        return
    if mode != "ce":
        raise ValueError(f"--sp_collectives {mode!r}: nccl or ce")
    from megatron_plugin.layers import compiled_linear

    compiled_linear.dist = _Dist()
