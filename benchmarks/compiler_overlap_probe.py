"""Can Inductor hide TP = 2 + SP's collectives itself, forward and backward, if each compiled layer runs its batch as
two halves? The two-stream probe (benchmarks/two_stream_probe.py, two H200s, 2026-11-30) timed DeepSpeed Domino's
way by hand, forward only: 1.33x over one stream (11.66 against 15.53 ms), the best of its ways. Building that by
hand means a layer forward of our own and a backward that issues its collectives asynchronously too. Inductor
schedules compute around collectives it can see (`_c10d_functional` ops): given two independent halves in one
graph it may interleave them as Domino does, in the compiled backward as well. This probe asks whether it does.

Answer (two H200s, torch 2.11, 2026-11-30): it does not. Forward and backward, against the whole batch compiled
(19.4 ms): the halves 0.87-0.88x under every pass tried, the halves interleaved by hand 0.99x, the scheduler on the
whole batch 1.00x, and Domino's own way eagerly 0.91x (BENCHMARKS.md, issue 32's seventh call set).

An SP transformer layer at GPT-2 774M's shapes (layer norm, sequence all-gather, qkv GEMM, causal SDPA, proj
GEMM, reduce-scatter, layer norm, all-gather, fc1, GELU, fc2, reduce-scatter; torch's autograd-aware functional
collectives), `--layers` deep, each layer compiled, forward and backward of one micro-batch captured in one CUDA
graph and replayed (as the full-iteration graph runs a step), one process a GPU:

    torchrun --nproc-per-node 2 benchmarks/compiler_overlap_probe.py

Ways: the whole micro-batch; its two halves (along the batch) one after the other inside each compiled layer, or
interleaved by hand as Domino orders them (each stage's collectives for both halves issued first); DeepSpeed
Domino's own way, eagerly, each collective asynchronous forward and backward (autograd nodes that issue and wait);
the halves under Inductor's overlap scheduler (`aten_distributed_optimizations.enable_overlap_scheduling`) and
with and without its pre-bucketing of collectives, and under its older reordering passes
(`reorder_for_compute_comm_overlap`); the whole batch under the scheduler (what it
finds within one chain). Prints each way's time and gain over the whole batch compiled, and fails unless every
way's output and weight gradients match the first's (5% of their largest: bf16 through 12 layers, compiled
against eager, differed by 2.9% on two H200s). `--device cpu` (gloo, no graph, tiny
shapes) checks the ways' numbers only.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as fc

# torch 2.13's name (2.11's, on the GPU machines, is the older one, deprecated in 2.13)
gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
scatter_autograd = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences in the micro-batch")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--only", nargs="*", default=None,
                   help="run only the ways whose names contain one of these words (the whole batch's two always run)")
    args = p.parse_args()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames c10d's tensor collectives
    cuda = args.device == "cuda"
    if not cuda:  # a numbers-only check: small enough for two CPU cores
        args.hidden, args.heads, args.seq, args.batch, args.layers = 64, 4, 16, 4, 2
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device)
    group = dist.group.WORLD
    h, heads, s, b = args.hidden, args.heads // world, args.seq, args.batch
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(rank)

    def rand(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale).requires_grad_()

    weights = [(rand(h, 3 * h // world), rand(h // world, h), rand(h, 4 * h // world), rand(4 * h // world, h))
               for _ in range(args.layers)]
    x0 = rand(s // world, b, h, scale=1.0)

    def layer(x, wqkv, wproj, w1, w2):
        # x: [s / TP, b, h], megatron-core's SP layout
        sb = x.shape[1]
        full = gather_autograd(F.layer_norm(x, (h,)).contiguous(), 0, group)
        q, k, v = (full @ wqkv).view(s, sb, 3, heads, -1).permute(2, 1, 3, 0, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        att = att.permute(2, 0, 1, 3).reshape(s, sb, h // world)
        x = x + scatter_autograd(att @ wproj, "sum", 0, group)
        full = gather_autograd(F.layer_norm(x, (h,)).contiguous(), 0, group)
        return x + scatter_autograd(F.gelu(full @ w1) @ w2, "sum", 0, group)

    def halves(x, *w):
        a, c = x.chunk(2, dim=1)
        return torch.cat([layer(a.contiguous(), *w), layer(c.contiguous(), *w)], dim=1)

    def domino(x, wqkv, wproj, w1, w2):
        # Domino's order written out: each stage's collective for both halves issued before either half's compute
        # that needs it (functional collectives wait at first use), so one half's collective can run under the
        # other's GEMMs
        xs = [t.contiguous() for t in x.chunk(2, dim=1)]
        sb = xs[0].shape[1]
        fulls = [gather_autograd(F.layer_norm(t, (h,)).contiguous(), 0, group) for t in xs]
        parts = []
        for full in fulls:
            q, k, v = (full @ wqkv).view(s, sb, 3, heads, -1).permute(2, 1, 3, 0, 4).unbind(0)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, sb, h // world)
            parts.append(scatter_autograd(att @ wproj, "sum", 0, group))
        xs = [t + part for t, part in zip(xs, parts)]
        fulls = [gather_autograd(F.layer_norm(t, (h,)).contiguous(), 0, group) for t in xs]
        parts = [scatter_autograd(F.gelu(full @ w1) @ w2, "sum", 0, group) for full in fulls]
        return torch.cat([t + part for t, part in zip(xs, parts)], dim=1)

    # DeepSpeed Domino's way by hand, eagerly: each collective asynchronous in both directions, an issue / wait pair
    # of autograd nodes (domino_patch's, which the real layer's `--domino hand` uses too)
    from domino_patch import _autograd_pair

    issue, wait = _autograd_pair()

    def start(x, kind):
        return issue(x, kind, group)

    def domino_eager(x, wqkv, wproj, w1, w2):
        xs = [t.contiguous() for t in x.chunk(2, dim=1)]
        sb = xs[0].shape[1]
        gathers = [start(F.layer_norm(t, (h,)), "gather") for t in xs]
        scatters = []
        for g_ in gathers:
            q, k, v = (wait(g_) @ wqkv).view(s, sb, 3, heads, -1).permute(2, 1, 3, 0, 4).unbind(0)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, sb, h // world)
            scatters.append(start(att @ wproj, "scatter"))
        gathers = []
        for i in range(2):
            xs[i] = xs[i] + wait(scatters[i])
            gathers.append(start(F.layer_norm(xs[i], (h,)), "gather"))
        scatters = [start(F.gelu(wait(g_) @ w1) @ w2, "scatter") for g_ in gathers]
        return torch.cat([t + wait(sc) for t, sc in zip(xs, scatters)], dim=1)

    import torch._inductor.config as inductor

    pristine = inductor.save_config()  # each way starts from Inductor's defaults: no setting leaks into the next

    def knobs(**settings):
        def apply():
            torch._dynamo.reset()  # each way compiles anew under its own settings
            inductor.load_config(pristine)
            for k, v in settings.items():
                obj, name = inductor, k
                while "." in name:
                    head, name = name.split(".", 1)
                    obj = getattr(obj, head)
                if not hasattr(obj, name):  # a knob of another torch release: that way runs without it
                    if rank == 0:
                        print(f"this torch {torch.__version__} has no inductor setting {k}: left at its default")
                    continue
                setattr(obj, name, v)
        return apply

    def overlap_scheduler_known():
        return hasattr(getattr(inductor, "aten_distributed_optimizations", None), "enable_overlap_scheduling")

    default = dict(reorder_for_compute_comm_overlap=False)
    if overlap_scheduler_known():
        default["aten_distributed_optimizations.enable_overlap_scheduling"] = False
    reorder = dict(default, reorder_for_compute_comm_overlap=True,
                   reorder_for_compute_comm_overlap_passes=["sink_waits", "raise_comms", "reorder_compute_for_overlap"])
    # the likeliest answers first (each way prints as it ends: a capped run still says something)
    ways = {
        "whole batch, eager": (layer, False, default),  # the numbers every way is held to
        "whole batch, compiled": (layer, True, default),  # the times every way is held to
        "two halves by hand, eager, async both ways (Domino)": (domino_eager, False, default),
        "two halves, compiled, reorder passes": (halves, True, reorder),
        "two halves interleaved by hand, compiled, reorder passes": (domino, True, reorder),
    }
    if overlap_scheduler_known():
        sched = dict(default, **{"aten_distributed_optimizations.enable_overlap_scheduling": True})
        # its FSDP-minded pre-bucketing merges collectives of one kind (the two halves' gathers into one)
        ways["two halves, compiled, overlap scheduler, no bucketing"] = (halves, True, dict(
            sched, **{"aten_distributed_optimizations.pre_bucketing_fsdp_collectives": False}))
        ways["two halves, compiled, overlap scheduler"] = (halves, True, sched)
    elif rank == 0:
        print("this torch has no aten_distributed_optimizations.enable_overlap_scheduling: those ways left out")
    ways["two halves, compiled"] = (halves, True, default)
    ways["two halves interleaved by hand (Domino), compiled"] = (domino, True, default)
    if overlap_scheduler_known():
        ways["whole batch, compiled, overlap scheduler"] = (layer, True, sched)

    if args.only:
        ways = {k: v for k, v in ways.items() if k.startswith("whole batch, ") and k.count(",") == 1
                or any(word in k for word in args.only)}
    results = {}
    for name, (fn, compiled, settings) in ways.items():
        knobs(**settings)()
        step_fn = torch.compile(fn, fullgraph=True) if compiled else fn

        def step():
            for ws in weights:
                for w in ws:
                    w.grad = None
            x = x0
            for w in weights:
                x = step_fn(x, *w)
            x.float().square().mean().backward()
            return [x.detach()] + [w.grad for ws in weights for w in ws]

        try:
            if cuda:
                from bench_steps import captured, cuda_seconds_per_call

                graph, out = captured(step)
                ms = cuda_seconds_per_call(graph.replay, iters=20, warmup=3, before=dist.barrier) * 1e3
                out = [o.clone() for o in out]
                torch.cuda.synchronize()
                graph.reset()  # NCCL destroys a communicator only once no graph holds its work: else the exit hangs
            else:
                t0 = time.perf_counter()
                out = step()
                ms = (time.perf_counter() - t0) * 1e3
            results[name] = (ms, [o.clone() for o in out])
            if rank == 0:
                print(f"  ... {name}: {ms:.3f} ms", flush=True)
        except Exception as e:  # a way this torch cannot compile or capture: say so, time the others
            if rank == 0:
                print(f"  {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            dist.barrier()
    first_name = next(iter(results))
    _, ref = results[first_name]
    base = results.get("whole batch, compiled", results[first_name])[0]
    wrong = []
    if rank == 0:
        print(f"{args.layers} SP layers, forward and backward, hidden {h}, {args.heads} heads, {b} x {s} tokens, "
              f"TP = {world}" + (", each way one CUDA graph replayed" if cuda else " (CPU: numbers only)"))
    for name, (ms, out) in results.items():
        diff = max(((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
                   for a, r in zip(out, ref))
        if diff > 5e-2:
            wrong.append(name)
        if rank == 0:
            print(f"  {name:58s} {ms:8.3f} ms  {base / ms:5.2f}x  (largest difference {diff:.1e} of the largest)")
    dist.destroy_process_group()
    if wrong:
        sys.exit(f"rank {rank}: {wrong} computed other numbers than '{first_name}'")


if __name__ == "__main__":
    main()
