"""The link between this host's GPUs as the TP/SP and DP collectives see it: all-gather, reduce-scatter and
all-reduce of bf16 tensors at the sizes a 774M layer moves, in algorithm and bus bandwidth (nccl-tests'
definitions), one process a GPU:

    torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py

Not nccl-tests itself: the lent machines have no network to fetch it, nor its build; torch's NCCL is the
library our runs use anyway."""

import os

import torch
import torch.distributed as dist

from bench_steps import cuda_seconds_per_call as timed


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mib in (1, 8, 42, 256):
        n = mib * 2**20 // 2  # bf16 elements of the whole (gathered) tensor
        whole = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        part = torch.ones(n // world, dtype=torch.bfloat16, device="cuda")
        factor = (world - 1) / world  # bus bandwidth = algorithm bandwidth x this (all-reduce: x 2)
        rows = {
            "all_gather": (timed(lambda: dist.all_gather_into_tensor(whole, part)), factor),
            "reduce_scatter": (timed(lambda: dist.reduce_scatter_tensor(part, whole)), factor),
            "all_reduce": (timed(lambda: dist.all_reduce(whole)), 2 * factor),
        }
        if rank == 0:
            for name, (t, f) in rows.items():
                algbw = mib * 2**20 / t / 1e9
                print(f"{name:15s} {mib:4d} MiB  {t * 1e3:8.3f} ms  algbw {algbw:7.1f} GB/s  busbw {algbw * f:7.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
