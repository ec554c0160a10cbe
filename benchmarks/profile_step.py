"""Where one training step's time goes: GPU kernel time by kernel, and how much of the step the GPU idles.

Same set-up as train_throughput.py (one mode, one size, one process per call):

    python benchmarks/profile_step.py --mode megatron --size 124m
    python benchmarks/profile_step.py --mode hf_compile --size 124m

Prints the step's wall time, the summed kernel time (GPU busy), kernel time by kind (matmuls,
attention, fused elementwise, optimizer, communication, the rest), and the kernels that take the most
time. Busy well below wall means the GPU waits on the host (launch overhead, host-device syncs);
`--host_top N` then lists where the host's time goes, and `--gaps N` where the GPU waits: each idle
stretch is charged to the Python code that launched the kernel ending it (the host was late there).
"""

import gzip
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_throughput import build_step, parser  # noqa: E402

# kernel-name fragments -> kind; the first match wins
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    # torch._grouped_mm's CUTLASS kernels (MoE experts) before the other matmuls
    ("grouped matmul (MoE experts)", ("groupproblemshape", "sm90group", "sm100group", "grouped", "group_gemm")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "fused_sgd")),
    ("communication", ("nccl",)),
    ("compiled (triton)", ("triton",)),
    # eager MoE routing and token permutation; also the embedding's backward (a sort) and other indexing
    ("sort, top-k, gather/scatter, indexing", ("sort", "topk", "gather", "scatter", "index", "histc", "bincount")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "other (eager elementwise, copies, reductions)"


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--host_top", type=int, default=0, help="also list the host-side ranges with the most self time")
    p.add_argument("--gaps", type=int, default=0,
                   help="also list the host ranges whose kernel launches the GPU waited for most (idle time per step)")
    p.add_argument("--with_stack", action="store_true",
                   help="--gaps names Python lines (the Python tracer slows the host several times: the gaps grow)")
    args = p.parse_args()

    import torch

    step, cfg, world = build_step(args)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    prof, wall = profile_steps(step, args.steps, with_stack=args.with_stack)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    summarize(prof, args.steps, wall, f"mode={args.mode} size={args.size}", top=args.top, host_top=args.host_top,
              gaps=args.gaps)


def profile_steps(step, steps, with_stack=False):
    """Run `steps` steps under torch.profiler; returns (profile, wall seconds per step). On a machine without
    CUDA only host activity is recorded (a smoke run of the benchmarks)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=with_stack) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return prof, wall


def summarize(prof, steps, wall, title, top=30, host_top=0, gaps=0, trace=None):
    """Print the step's wall time, GPU busy time, kernel time by kind and the top kernels (host ops by self
    time when the profile holds no CUDA kernels)."""
    import torch

    kernels = defaultdict(lambda: [0.0, 0])
    syncs = 0
    for e in prof.events():
        # annotations over kernels already counted: "Optimizer.step#AdamW.step"-style ranges, and the
        # "nccl:all_gather"-style ranges c10d records on the GPU around its NCCL kernels
        if (e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name
                and not getattr(e, "is_user_annotation", False) and not e.name.startswith("nccl:")):
            kernels[e.name][0] += e.device_time / 1e3 / steps
            kernels[e.name][1] += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
                        "aten::_local_scalar_dense"):
            syncs += 1
    busy = sum(t for t, _ in kernels.values())
    if not kernels:
        print(f"{title} step wall {wall * 1e3:.1f} ms, no CUDA kernels recorded")
        host_top = host_top or top
    else:
        print(f"{title} step wall {wall * 1e3:.1f} ms, kernels {busy:.1f} ms "
              f"({busy / (wall * 1e3):.0%} busy), {sum(n for _, n in kernels.values()) // steps} kernels/step, "
              f"{syncs // steps} host syncs/step")
        by_kind = defaultdict(float)
        for name, (t, _) in kernels.items():
            by_kind[kind_of(name)] += t
        for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"{t:8.2f} ms  {t / busy:6.1%}  {kind}")
        print("top kernels:")
        for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{t:8.2f} ms {n // steps:5d}x  {name[:150]}")
    if host_top:
        print("host ranges by self CPU time per step:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:host_top]:
            print(f"{e.self_cpu_time_total / 1e3 / steps:8.2f} ms {e.count // steps:6d}x  {e.key[:120]}")
    if gaps and kernels:
        print_gaps(prof, steps, gaps, trace=trace)


# frames that say nothing about which of our lines launched the work
_DULL = ("torch/nn/modules/module.py", "_contextlib.py", "<built-in", "torch/autograd/", "torch/_dynamo/",
         "torch/_functorch/", "torch/_ops.py", "torch/utils/_", "torch/_library/", "contextlib.py", "profile_step.py")


def print_gaps(prof, steps, top, min_us=5.0, trace=None):
    """GPU idle stretches (no kernel, copy or memset running), each charged to the Python frames (with
    --with_stack) or host ranges around the launch of the kernel that ends it. `trace`: the file the profile
    was already exported to (a profile exports once)."""
    if trace is not None:
        opener = gzip.open if trace.endswith(".gz") else open
        with opener(trace, "rt") as f:
            events = json.load(f)["traceEvents"]
    else:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    # Python frames when traced, else the host ranges (torch ops, autograd nodes, record_function)
    cat = "python_function" if any(e.get("cat") == "python_function" for e in events) else "cpu_op"
    frames = {}  # tid -> frames sorted by start, outer before inner
    for e in events:
        if e.get("cat") == cat:
            frames.setdefault(e["tid"], []).append(e)
    for fs in frames.values():
        fs.sort(key=lambda e: (e["ts"], -e["dur"]))

    gaps = []  # (idle us, the launch of the kernel that ends it, or that kernel when unrecorded)
    bins = {2: [0.0, 0], 5: [0.0, 0], 20: [0.0, 0], 100: [0.0, 0], float("inf"): [0.0, 0]}  # every gap, by size
    end = None
    for k in gpu:
        if end is not None and k["ts"] > end:
            idle = k["ts"] - end
            b = bins[next(edge for edge in bins if idle <= edge)]
            b[0], b[1] = b[0] + idle, b[1] + 1
            if idle > min_us:
                gaps.append((idle, launches.get(k.get("args", {}).get("correlation")), k))
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    lows = [0, *list(bins)[:-1]]
    print("GPU idle per step by gap size: " + ", ".join(
        f"{lo}-{hi} us: {t / 1e3 / steps:.2f} ms ({n // steps}x)" for lo, (hi, (t, n)) in zip(lows, bins.items())))

    # the frames enclosing each launch, in one sweep per thread: a stack of the frames started so far
    enclosing = {}
    for tid, fs in frames.items():
        stack, i = [], 0
        for launch in sorted((g[1] for g in gaps if g[1] and g[1]["tid"] == tid), key=lambda e: e["ts"]):
            t = launch["ts"]
            while i < len(fs) and fs[i]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < fs[i]["ts"]:
                    stack.pop()
                stack.append(fs[i])
                i += 1
            enclosing[id(launch)] = [e["name"] for e in stack if e["ts"] + e["dur"] >= t]

    def where(launch, kernel):
        if launch is None:
            return "(no launch record) " + kernel["name"][:60]
        names = [n for n in enclosing.get(id(launch), []) if not any(d in n for d in _DULL)]
        if cat == "cpu_op":  # the outermost range says which phase, the innermost which op
            names = names[:1] + names[-2:] if len(names) > 3 else names
        return " > ".join(n.split("site-packages/")[-1] for n in names[-3:]) or launch["name"]

    by_site, total = {}, 0.0
    for gap, launch, kernel in gaps:
        site = where(launch, kernel)
        t, n = by_site.get(site, (0.0, 0))
        by_site[site] = (t + gap, n + 1)
        total += gap
    print(f"GPU idle {total / 1e3 / steps:.2f} ms per step in gaps over {min_us:.0f} us; by the code that launched "
          "the kernel after the gap:")
    for site, (t, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1e3 / steps:8.2f} ms {n // steps:5d}x  {site[:230]}")


if __name__ == "__main__":
    main()
