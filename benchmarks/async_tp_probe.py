"""Would overlapping TP's communication with its GEMMs pay on this machine? The sequence-parallel linears of a
GPT-2 774M layer (hidden 1280, 16 x 1024 tokens, TP = 2) two ways, one process a GPU:

    torchrun --nproc-per-node 2 benchmarks/async_tp_probe.py

- column-parallel (qkv, fc1): all-gather of the sequence shard, then the GEMM (what layers/compiled_linear.py
  runs), against torch's `fused_all_gather_matmul` (symmetric memory: the gather in chunks, each chunk's GEMM
  as soon as it lands);
- row-parallel (proj, fc2): the GEMM, then the reduce-scatter, against `fused_matmul_reduce_scatter`;
- SP's all-gather and reduce-scatter alone: NCCL against symmetric memory's copy-engine ops
  (`_low_contention_all_gather` / `_low_contention_reduce_scatter`);
- column-parallel backward (qkv, fc1): the input's re-gather for the weight gradient waited for before the input
  gradient's GEMM (what the compiled op did until 2026-11-29), against issued asynchronously and waited for after
  that GEMM (what it and megatron-core's linear do now), with no symmetric memory.

Prints each op's time both ways and the largest difference of the results. At 774M on two H200s the
unoverlapped collectives were 88 ms of a 184 ms TP = 2 + SP step (BENCHMARKS.md, issue 32 check 5): this says
how much of that an overlap could hide before the linears are built around it. NVLink multicast stays off
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set here unless set): the lent machines require it, and these ops do not
need it."""

import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_steps import cuda_seconds_per_call  # noqa: E402


def timed(fn):
    """Milliseconds a call, every rank starting its timed calls together."""
    return cuda_seconds_per_call(fn, iters=30, warmup=5, before=dist.barrier) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--tokens", type=int, default=16 * 1024)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD
    symm_mem.enable_symm_mem_for_group(group.group_name)
    h, n = args.hidden, args.tokens
    g = torch.Generator(device="cuda").manual_seed(rank)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.05

    rows = []
    for name, width in (("qkv", 3 * h), ("fc1", 4 * h)):  # column-parallel: [n / world, h] gathered, times [h, width / world]
        a_shard, w = rand(n // world, h), rand(h, width // world)

        def plain():
            whole = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(whole, a_shard)
            return whole @ w

        def fused():
            # return_A: the weight gradient needs the gathered input (and it keeps torch off its multicast path)
            return symm_mem._fused_all_gather_matmul(a_shard, [w], 0, group.group_name, return_A=True)[1][0]

        rows.append((f"{name}: all-gather + GEMM", timed(plain), timed(fused), (plain() - fused()).abs().max().item()))
    for name, width in (("proj", h), ("fc2", 4 * h)):  # row-parallel: [n, width / world] times [width / world, h], summed
        a, w = rand(n, width // world), rand(width // world, h)

        def plain():
            out = torch.empty(n // world, h, device="cuda", dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(out, a @ w)
            return out

        def fused():
            return symm_mem._fused_matmul_reduce_scatter(a, w, "sum", 0, group.group_name)

        rows.append((f"{name}: GEMM + reduce-scatter", timed(plain), timed(fused), (plain() - fused()).abs().max().item()))
    for name, width in (("qkv", 3 * h), ("fc1", 4 * h)):  # column backward: [n, width / world] @ [width / world, h]
        x_shard, w, go = rand(n // world, h), rand(width // world, h), rand(n, width // world)

        def waited():
            whole = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(whole, x_shard)
            return go @ w, whole

        def overlapped():
            whole = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
            work = dist.all_gather_into_tensor(whole, x_shard, async_op=True)
            dx = go @ w
            work.wait()
            return dx, whole

        diff = max((a - b).abs().max().item() for a, b in zip(waited(), overlapped()))
        rows.append((f"{name} backward: gather + dgrad", timed(waited), timed(overlapped), diff))
    # SP's collectives alone: NCCL's kernels against symmetric memory's low-contention ops, which pull the peer's
    # part with the copy engines (no SMs; the input already in symmetric memory, as an op built on them would keep
    # it). With the host out of the TP = 2 + SP step, NCCL's collectives are 47 of its 138 ms (BENCHMARKS.md): if the
    # copy engines move 42 MiB in half NCCL's time, the step gets near 1.6x one GPU without any overlap.
    m = n // world
    shard = symm_mem.empty(m, h, device="cuda", dtype=torch.bfloat16)
    shard.copy_(rand(m, h))
    symm_mem.rendezvous(shard, group.group_name)
    full = symm_mem.empty(n, h, device="cuda", dtype=torch.bfloat16)
    full.copy_(rand(n, h))
    symm_mem.rendezvous(full, group.group_name)

    def nccl_gather():
        whole = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
        dist.all_gather_into_tensor(whole, shard)
        return whole

    def nccl_scatter():
        part = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(part, full)
        return part

    def ce_gather():
        return torch.ops.symm_mem._low_contention_all_gather(shard, group.group_name)

    def ce_scatter():
        return torch.ops.symm_mem._low_contention_reduce_scatter(full, "sum", group.group_name)

    rows.append(("all-gather alone: NCCL | CE", timed(nccl_gather), timed(ce_gather),
                 (nccl_gather() - ce_gather()).abs().max().item()))
    rows.append(("reduce-scatter alone: NCCL | CE", timed(nccl_scatter), timed(ce_scatter),
                 (nccl_scatter().float() - ce_scatter().float()).abs().max().item()))
    if rank == 0:
        print(f"hidden {h}, {n} tokens, TP = {world}, bf16 (apart: one after the other; together: fused or overlapped; "
              "for the collectives alone, apart = NCCL, together = symmetric memory's copy-engine pulls)")
        for label, t_plain, t_fused, diff in rows:
            print(f"{label:32s} apart {t_plain:7.3f} ms  together {t_fused:7.3f} ms  ({t_plain / t_fused:4.2f}x)  "
                  f"max |diff| {diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
