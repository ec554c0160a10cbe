"""An experiment for issue 32's TP = 2 + SP row, not a setting: SP's collectives on the copy engines.

Its answer (two H200s, 2026-11-30, BENCHMARKS.md's eighth call set): the copy engines gather as fast as NCCL
(1.05x) and reduce-scatter slower (0.84x); the step with them runs 0.98x NCCL's (122,432 tok/s against 124,382),
and 1.01x under Domino's hand-written layer (125,997; peak memory read 57 GiB, not investigated). No setting.

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
which cannot grow it; a later, larger layout would replace the workspace under the graph (the benchmark's batches
are one shape). Not with `tp_comm_overlap`, whose fused ops share the workspace and its barriers on another stream
(refused). Inputs outside symmetric memory take the ops' workspace path (a local copy in, for the gather). The
all-reduce (TP without SP) stays NCCL's.

    PYTHONPATH=. python benchmarks/ce_collectives_patch.py

checks the routing on CPU (two gloo ranks, TP = 2 + SP, the compiled path's ops run eagerly, the copy-engine ops
stood in for by gloo's collectives): the plain engine's three losses, every SP collective through the patch, alone
and under benchmarks/domino_patch.py's hand-written layer (`--domino hand --sp_collectives ce`).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # the lent machines require it (KINDS.md)


def _gather_op(x, group_name):
    import torch

    return torch.ops.symm_mem._low_contention_all_gather(x, group_name)


def _scatter_op(x, group_name):
    import torch

    return torch.ops.symm_mem._low_contention_reduce_scatter(x, "sum", group_name)


class _Done:
    """The work a copy-engine collective hands back: wait, then its result into the caller's buffer. It holds the
    input until then: the op reads it on torch's backend stream, and a caller that drops it at once (Domino's layer
    does) would otherwise hand its block to the next kernel on its own stream while the copy engines still read it
    (NCCL's process group keeps its inputs the same way)."""

    def __init__(self, result, out, input):
        self.result, self.out, self.input = result, out, input

    def wait(self):
        import torch

        torch.ops._c10d_functional.wait_tensor(self.result)
        self.out.copy_(self.result.view_as(self.out))
        self.input = None
        return True


class _Dist:
    """torch.distributed as layers/compiled_linear.py sees it, with its two SP collectives on the copy engines."""

    def __getattr__(self, name):
        import torch.distributed as dist

        return getattr(dist, name)

    @staticmethod
    def _name(group, x):
        import torch.distributed as dist

        from megatron_plugin.layers import compiled_linear

        name = (group or dist.group.WORLD).group_name
        compiled_linear._symm_mem(name, x.is_cuda)  # enable_symm_mem_for_group, once per group
        return name

    def all_gather_into_tensor(self, out, x, group=None, async_op=False):
        x = x.contiguous()
        done = _Done(_gather_op(x, self._name(group, x)), out, x)
        return done if async_op else done.wait() and None

    def reduce_scatter_tensor(self, out, x, op=None, group=None, async_op=False):
        import torch.distributed as dist

        if op not in (None, dist.ReduceOp.SUM):
            return dist.reduce_scatter_tensor(out, x, op=op, group=group, async_op=async_op)
        x = x.contiguous()
        done = _Done(_scatter_op(x, self._name(group, x)), out, x)
        return done if async_op else done.wait() and None


def install(mode: str) -> None:
    """`mode`: "nccl" (nothing changes) or "ce" (the compiled SP linears' collectives on the copy engines)."""
    if mode == "nccl":
        return
    if mode != "ce":
        raise ValueError(f"--sp_collectives {mode!r}: nccl or ce")
    from megatron_plugin.layers import compiled_linear

    compiled_linear.dist = _Dist()


def _cpu_run(patched, domino=""):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    from bench_steps import cpu_tp2_sp_losses

    calls = {"gathers": 0, "scatters": 0}
    if patched:
        global _gather_op, _scatter_op

        def gather(x, name):  # what the copy-engine op returns, by gloo
            calls["gathers"] += 1
            pg = _resolve_process_group(name)
            out = x.new_empty(x.shape[0] * pg.size(), *x.shape[1:])
            dist.all_gather_into_tensor(out, x, group=pg)
            return out

        def scatter(x, name):
            calls["scatters"] += 1
            pg = _resolve_process_group(name)
            total = x.clone()
            dist.all_reduce(total, group=pg)
            return total.chunk(pg.size())[pg.rank()].clone()

        _gather_op, _scatter_op = gather, scatter
        install("ce")
    if domino:  # DeepSpeed Domino's layer by hand (benchmarks/domino_patch.py), its collectives through this patch
        import domino_patch

        domino_patch.install(domino)
    return cpu_tp2_sp_losses(compiled_ops=True), calls


if __name__ == "__main__":
    os.environ["MP_TEST_FRESH"] = "1"  # the patches stay in their processes
    from tests.spawn import run_on_ranks

    plain, _ = run_on_ranks(_cpu_run, 2, False)[0]
    for domino in ("", "hand"):
        losses, calls = run_on_ranks(_cpu_run, 2, True, domino)[0]
        print(f"copy-engine routing{' under Domino' if domino else ''}: losses {losses} (plain {plain}); {calls}")
        assert max(abs(a - b) for a, b in zip(losses, plain)) < 1e-5, (losses, plain)
        assert calls["gathers"] and calls["scatters"], calls
