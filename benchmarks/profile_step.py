"""Where one training step's time goes: GPU kernel time by kernel, and how much of the step the GPU idles.

Same set-up as train_throughput.py (one mode, one size, one process per call):

    python benchmarks/profile_step.py --mode megatron --size 124m
    python benchmarks/profile_step.py --mode hf_compile --size 124m

Prints the step's wall time, the summed kernel time (GPU busy), kernel time by kind (matmuls,
attention, fused elementwise, optimizer, communication, the rest), and the kernels that take the most
time. Busy well below wall means the GPU waits on the host (launch overhead, host-device syncs);
`--host_top N` then lists where the host's time goes.
"""

import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_throughput import build_step, parser  # noqa: E402

# kernel-name fragments -> kind; the first match wins
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "fused_sgd")),
    ("communication", ("nccl",)),
    ("compiled (triton)", ("triton",)),
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
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    step, cfg, world = build_step(args)
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps

    kernels = defaultdict(lambda: [0.0, 0])
    syncs = 0
    for e in prof.events():
        # "Optimizer.step#AdamW.step"-style ranges are annotations over kernels already counted
        if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name:
            kernels[e.name][0] += e.device_time / 1e3 / args.steps
            kernels[e.name][1] += 1
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
                        "aten::_local_scalar_dense"):
            syncs += 1
    busy = sum(t for t, _ in kernels.values())
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"mode={args.mode} size={args.size} step wall {wall * 1e3:.1f} ms, kernels {busy:.1f} ms "
          f"({busy / (wall * 1e3):.0%} busy), {sum(n for _, n in kernels.values()) // args.steps} kernels/step, "
          f"{syncs // args.steps} host syncs/step")
    by_kind = defaultdict(float)
    for name, (t, _) in kernels.items():
        by_kind[kind_of(name)] += t
    for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{t:8.2f} ms  {t / busy:6.1%}  {kind}")
    print("top kernels:")
    for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{t:8.2f} ms {n // args.steps:5d}x  {name[:150]}")
    if args.host_top:
        print("host ranges by self CPU time per step:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.host_top]:
            print(f"{e.self_cpu_time_total / 1e3 / args.steps:8.2f} ms {e.count // args.steps:6d}x  {e.key[:120]}")


if __name__ == "__main__":
    main()
