"""Would two micro-batches on two CUDA streams hide TP = 2 + SP's collectives under each other's GEMMs? The step
with the full-iteration graph is GPU-bound and spends 47 of its 138 ms in NCCL between GEMMs (GPT-2 774M, two
H200s, 2026-11-30); torch's symmetric-memory overlap lost at these shapes. Here the SP layer's forward chain at
774M's shapes (all-gather, qkv GEMM, proj GEMM, reduce-scatter, all-gather, fc1 GEMM, GELU, fc2 GEMM,
reduce-scatter; attention left out), `--layers` deep, for two micro-batches of `--batch` sequences, each way
captured in one CUDA graph and replayed (as the full-iteration graph runs a step), one process a GPU:

    torchrun --nproc-per-node 2 benchmarks/two_stream_probe.py

- sequential: micro-batch A's chain, then B's, on one stream (what the step does now);
- two streams, one communicator: A on one stream, B on another; c10d queues every collective of a process group
  on that group's one NCCL stream, in the order the host issued them, so B's gathers wait behind all of A's;
- two streams, two communicators: B's collectives on a second process group of the same ranks (its own NCCL
  stream), so each chain waits only on itself and the GPU interleaves them;
- interleaved issue, one communicator: one stream each, the host issuing A's and B's layers alternately;
- Domino (DeepSpeed's TP overlap): one compute stream, every collective asynchronous on NCCL's stream and waited
  for only where its micro-batch needs it, A's and B's ops issued alternately; no second stream, so no two
  backward passes writing one main_grad at once.

Prints each way's time and its gain over the sequential one, and fails unless every way computes the same
numbers (within 1% of their largest). Hiding all of the step's collectives would be worth ~1.5x (138 ms -> 91); a gain near that says a
two-stream schedule is worth building, none says not."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench_steps import captured, cuda_seconds_per_call


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences a micro-batch (two of them: GPT-2 774M's 16)")
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    second = dist.new_group(list(range(world)))  # the same ranks, its own NCCL communicator and stream
    h, n = args.hidden, args.seq * args.batch  # tokens of one micro-batch
    g = torch.Generator(device="cuda").manual_seed(rank)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.05

    weights = [(rand(h, 3 * h // world), rand(h // world, h), rand(h, 4 * h // world), rand(4 * h // world, h))
               for _ in range(args.layers)]
    inputs = [rand(n // world, h), rand(n // world, h)]

    def gather(x, group):
        whole = torch.empty(n, h, device="cuda", dtype=x.dtype)
        dist.all_gather_into_tensor(whole, x, group=group)
        return whole

    def scatter(x, group):
        part = torch.empty(n // world, h, device="cuda", dtype=x.dtype)
        dist.reduce_scatter_tensor(part, x, group=group)
        return part

    def layer(x, w, group):
        wqkv, wproj, w1, w2 = w
        qkv = gather(x, group) @ wqkv
        x = x + scatter(qkv[:, : h // world] @ wproj, group)  # attention's output stands in as the q part
        return x + scatter(F.gelu(gather(x, group) @ w1) @ w2, group)

    def chain(x, group):
        for w in weights:
            x = layer(x, w, group)
        return x

    def sequential():
        return [chain(inputs[0], None), chain(inputs[1], None)]

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def two_streams(groups):
        def run():
            here = torch.cuda.current_stream()
            outs = []
            for s, x, group in zip(streams, inputs, groups):
                s.wait_stream(here)
                with torch.cuda.stream(s):
                    outs.append(chain(x, group))
            for s in streams:
                here.wait_stream(s)
            return outs
        return run

    def interleaved():
        here = torch.cuda.current_stream()
        xs = list(inputs)
        for s in streams:
            s.wait_stream(here)
        for w in weights:
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    xs[i] = layer(xs[i], w, None)
        for s in streams:
            here.wait_stream(s)
        return xs

    def domino():
        # DeepSpeed Domino's shape: one compute stream, each collective issued asynchronously (NCCL's own stream)
        # and waited for by the stream only where its half needs it, the two halves' ops issued alternately
        xs = list(inputs)

        def start(op, out, x):
            return op(out, x, async_op=True)

        for wqkv, wproj, w1, w2 in weights:
            wholes = [torch.empty(n, h, device="cuda", dtype=x.dtype) for x in xs]
            works = [start(dist.all_gather_into_tensor, o, x) for o, x in zip(wholes, xs)]
            parts = [torch.empty(n // world, h, device="cuda", dtype=x.dtype) for x in xs]
            for i in range(2):
                works[i].wait()
                works[i] = start(dist.reduce_scatter_tensor, parts[i], (wholes[i] @ wqkv)[:, : h // world] @ wproj)
            for i in range(2):
                works[i].wait()
                xs[i] = xs[i] + parts[i]
                works[i] = start(dist.all_gather_into_tensor, wholes[i], xs[i])
            parts = [torch.empty(n // world, h, device="cuda", dtype=x.dtype) for x in xs]
            for i in range(2):
                works[i].wait()
                works[i] = start(dist.reduce_scatter_tensor, parts[i], F.gelu(wholes[i] @ w1) @ w2)
            for i in range(2):
                works[i].wait()
                xs[i] = xs[i] + parts[i]
        return xs

    ways = {"sequential, one stream": sequential, "two streams, one communicator": two_streams([None, None]),
            "two streams, two communicators": two_streams([None, second]),
            "two streams issued layer by layer, one communicator": interleaved,
            "one stream, async collectives, halves alternating (Domino)": domino}
    results = {}
    for name, fn in ways.items():
        graph, out = captured(fn)
        ms = cuda_seconds_per_call(graph.replay, iters=20, warmup=3, before=dist.barrier) * 1e3
        results[name] = (ms, [o.clone() for o in out])
        graph.reset()  # NCCL destroys a communicator only once no graph holds its work: else the exit hangs
    base_ms, base_out = results["sequential, one stream"]
    if rank == 0:
        print(f"{args.layers} SP layers' forward at hidden {h}, two micro-batches of {args.batch} x {args.seq}, "
              f"TP = {world}, each way one CUDA graph replayed")
        scale = max(b.float().abs().max().item() for b in base_out)
        wrong = []
        for name, (ms, out) in results.items():
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, base_out))
            print(f"  {name:55s} {ms:8.3f} ms  {base_ms / ms:5.2f}x  (max diff {diff:.2e})")
            if diff > 1e-2 * scale:  # the same kernels on the same numbers: equal but for a GEMM's algorithm choice
                wrong.append(name)
        assert not wrong, f"{wrong} computed other numbers than the sequential way"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
