"""What the training benchmarks share: the HF + accelerate step a careful user writes, the plugin's step
through `prepare`, and timing a run of steps (GPU or CPU).

The HF step: accelerate's bf16 autocast over fp32 master weights (or bf16 weights, `recipe="bf16_params"`),
`torch.optim.AdamW(fused=True)`, gradient accumulation over the micro-batches with `no_sync`, foreach
clipping, optionally `torch.compile(model)`. The plugin's step: `Accelerator(megatron_lm_plugin=...)`,
`prepare(model, optimizer, scheduler, loader)`, `engine(**batch)`; both see the same global batch cut into
the same micro-batches.
"""

import contextlib
import os
import subprocess
import time


def hf_step(args, model, data, device, world, compiled, recipe="master_fp32"):
    """One HF training step over `data`'s first global batch (each rank its share) as a closure returning
    the step's loss (a tensor: reading it would synchronize)."""
    import torch
    from accelerate import Accelerator

    if recipe == "bf16_params":
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                            **({"fused": True} if device.type == "cuda" else {}))
    acc = Accelerator(mixed_precision="bf16" if recipe == "master_fp32" else "no", cpu=device.type == "cpu")
    model, opt = acc.prepare(model, opt)
    fwd = torch.compile(model, mode=getattr(args, "compile_mode", "") or None) if compiled else model
    local = args.global_batch // world
    batch = {k: torch.stack([d[k] for d in data[:local]]).to(device) for k in data[0]}
    micro_batches = [{k: v.chunk(args.num_micro)[i] for k, v in batch.items()} for i in range(args.num_micro)]

    def step():
        total = 0.0
        for i, mb in enumerate(micro_batches):
            ctx = acc.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext()
            with ctx:
                loss = fwd(**mb).loss / len(micro_batches)
                acc.backward(loss)
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def megatron_step(args, model, data, world, batches, compiled, **plugin_kwargs):
    """The plugin's training step (one global batch per call) as a closure returning the loss the engine
    reports (meaningful on the last pipeline stage); `batches` global batches are loaded. `plugin_kwargs` go
    to MegatronLMPlugin on top of the flags train_throughput.parser defines."""
    import torch
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    dp = world // (args.tp * args.pp)
    micro = args.global_batch // (dp * args.num_micro)
    # the plugin reads the optimizer's hyperparameters and builds its own (fused Adam on GPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    wgrad = False if args.no_wgrad_fusion else (True if args.wgrad_fusion else None)
    plugin = MegatronLMPlugin(tp_degree=args.tp, pp_degree=args.pp, num_micro_batches=args.num_micro,
                              sequence_parallelism=args.sp, use_distributed_optimizer=args.distopt,
                              recompute_activations=args.recompute, fused_kernels=args.fused,
                              gradient_accumulation_fusion=wgrad, torch_compile=compiled,
                              **{"lr_decay_style": "constant", **plugin_kwargs})
    dynamo = {}
    if args.compile_mode and compiled:  # through accelerate's knob, as a user sets it
        from accelerate.utils import TorchDynamoPlugin

        dynamo["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=args.compile_mode)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16", **dynamo)
    loader = DataLoader(data * batches, batch_size=micro, drop_last=True)
    # HF's steps run at a constant learning rate: the same here, so the two runs' losses track each other
    sched = MegatronLMDummyScheduler(opt, total_num_steps=10 * batches, warmup_num_steps=0)
    engine, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    engine.train()
    it = iter(loader)

    def step():
        out = engine(**next(it))
        return getattr(out, "loss", out).detach()

    return step


class StepWatch:
    """What else happened in each timed step, so that a slow one in `step_ms` names its cause: CPython's
    collections of generation 2 (any length) and 1 (over 1 ms), Dynamo frames compiled (a recompile), the host's
    time per step (a host stall shows there), and over the whole window the CUDA caching allocator's new
    cudaMallocs and its retries (an allocator miss: a retry frees the cache and synchronizes). `sync_wait_ms`: the
    host's time per step inside `torch.cuda.Event.synchronize`, where the engine's one sync a step waits for the
    batch check's flags (engine/batch_check.DeferredCheck): near 0 in a step the host bounds (the GPU was already
    there), the host's slack in one the GPU bounds. Cheap enough for timed runs: a GC callback, a counter read and
    a clock read per step, two around each event wait; the allocator is read twice.

        with StepWatch(cuda) as watch:
            for i in range(steps):
                step()
                watch.end(i)
        result.update(watch.report())
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.step = 0
        self.events = []  # (step index, what)
        self.host_ms = []
        self.gc_ms = 0.0  # every collection's time, and how many were full ones
        self.gc_full = 0
        self.sync_wait_ms = []
        self._wait = 0.0

    @staticmethod
    def _frames():
        from torch._dynamo.utils import counters

        return counters["frames"]["total"]

    def _allocator(self):
        import torch

        stats = torch.cuda.memory_stats()
        return {"cudaMalloc": stats.get("num_device_alloc", stats.get("segment.all.allocated", 0)),
                "retries": stats.get("num_alloc_retries", 0)}

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_start) * 1e3
        self.gc_ms += ms
        self.gc_full += info["generation"] == 2
        if info["generation"] == 2 or (info["generation"] == 1 and ms > 1.0):
            self.events.append((self.step, f"gc gen{info['generation']} {ms:.1f} ms"))

    def __enter__(self):
        import gc

        import torch

        self._gc_start = time.perf_counter()
        gc.callbacks.append(self._on_gc)
        # the event waits, timed: torch.cuda.Event.synchronize is a Python method, wrapped for the window
        self._synchronize = wait = torch.cuda.Event.synchronize

        def timed_wait(event):
            t = time.perf_counter()
            try:
                return wait(event)
            finally:
                self._wait += time.perf_counter() - t

        torch.cuda.Event.synchronize = timed_wait
        self._frames0 = self._last_frames = self._frames()
        self._alloc0 = self._allocator() if self.cuda else None
        self._t = time.perf_counter()
        return self

    def end(self, i: int):
        """After step i's call returns (the host's side of it; the GPU may still run it)."""
        now = time.perf_counter()
        self.host_ms.append(round((now - self._t) * 1e3, 1))
        self._t = now
        self.sync_wait_ms.append(round(self._wait * 1e3, 1))
        self._wait = 0.0
        frames = self._frames()
        if frames != self._last_frames:
            self.events.append((i, f"{frames - self._last_frames} Dynamo frame(s) compiled"))
            self._last_frames = frames
        self.step = i + 1

    def __exit__(self, *exc):
        import gc

        import torch

        gc.callbacks.remove(self._on_gc)
        torch.cuda.Event.synchronize = self._synchronize
        if self.cuda:
            now = self._allocator()
            self.allocator = {k: now[k] - self._alloc0[k] for k in now}
        return False

    def report(self) -> dict:
        out = {"host_ms": self.host_ms, "sync_wait_ms": self.sync_wait_ms, "step_events": [list(e) for e in self.events],
               "gc_ms": round(self.gc_ms, 1), "gc_full": self.gc_full}
        if self.cuda:
            out["allocator"] = self.allocator
        return out


def cpu_tp2_sp_losses(compiled_ops: bool, steps: int = 3) -> list:
    """The CPU checks of the SP experiments (domino_patch, ce_collectives_patch), on each of two gloo ranks: the tiny
    GPT-2's first `steps` training losses at TP = 2 + SP. `compiled_ops`: the compiled layers' linears
    (layers/compiled_linear.py, CUDA and main_grad on a GPU) run eagerly here, the path the patches change."""
    import torch
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.layers import linear
    from tests.models import tiny_gpt2
    from tests.training import optimizer_for, token_dataset

    if compiled_ops:
        linear._as_ops = lambda layer: True
        torch.compiler.is_compiling = lambda: True
    model = tiny_gpt2()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, sequence_parallelism=True))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=6, warmup_num_steps=2),
        DataLoader(token_dataset(16, model.config.vocab_size), batch_size=4))
    engine.train()
    return [engine(**batch).loss.item() for batch, _ in zip(loader, range(steps))]


def captured(fn, warmup=2):
    """(graph, what `fn()` returned while captured): `fn` called `warmup` times on a side stream (compiles,
    communicators, the allocator's blocks in place), then captured as one CUDA graph, in thread-local mode as
    engine/full_graph.py (NCCL's watchdog thread queries events meanwhile). Reset the graph before the process
    group is destroyed: NCCL waits for every graph that holds its work."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def cuda_seconds_per_call(fn, iters=20, warmup=3, before=None):
    """Seconds one call of `fn` takes on the GPU, averaged over `iters` calls after `warmup` untimed ones (the
    probes' timer: nccl_bandwidth, async_tp_probe, embedding_backward_probe). `before` runs once between the two,
    after the GPU is idle (a barrier: every rank starts its timed calls together)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if before is not None:
        before()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def timed_steps(step, steps, device, events=None):
    """Run `steps` steps; returns (seconds, per-step ms, peak allocated bytes or None, the steps' losses read
    after the clock stops); `events`, a dict, receives StepWatch's report. On GPU, events between
    steps give each step's span on the GPU's timeline, so a slow step (a recompile, an allocator miss) shows
    instead of hiding in the mean."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        marks[0].record()
    ends, losses = [], []
    t0 = time.perf_counter()
    with StepWatch(cuda) as watch:
        for i in range(steps):
            losses.append(step())
            marks[i + 1].record() if cuda else ends.append(time.perf_counter())
            watch.end(i)
        if cuda:
            torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if events is not None:
        events.update(watch.report())
    losses = [float(x) if x is not None else float("nan") for x in losses]
    if cuda:
        step_ms = [round(a.elapsed_time(b), 1) for a, b in zip(marks, marks[1:])]
        return dt, step_ms, torch.cuda.max_memory_allocated(), losses
    step_ms = [round((b - a) * 1e3, 1) for a, b in zip([t0] + ends, ends)]
    return dt, step_ms, None, losses


def host_report(setup_s: float) -> dict:
    """What can make a whole run slower than the next with no slow step to show for it (issue 32's 124M runs
    minutes apart): the CPU this process ran on and how many it may use, the load, and the GPU's SM clock, power
    and active throttle reasons just after the timed steps (nvidia-smi; None where it cannot be read)."""
    report = {"setup_s": round(setup_s, 1), "cpus": len(os.sched_getaffinity(0)), "load1": os.getloadavg()[0]}
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open("/proc/self/stat") as f:  # field 39: the CPU it last ran on (after the ")" of the name)
            report["cpu"] = int(f.read().rsplit(")", 1)[1].split()[36])
    report.update(sm_mhz=None, power_w=None, throttle=None)
    gpu = str(int(os.environ.get("LOCAL_RANK", "0")))
    # the reasons' field was renamed (clocks_event_reasons in newer drivers): the first that the driver knows
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        try:
            got = subprocess.run(["nvidia-smi", f"--query-gpu=clocks.sm,power.draw,{reasons}",
                                  "--format=csv,noheader,nounits", "-i", gpu], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            break
        out = got.stdout.strip().split(", ")
        if got.returncode == 0 and len(out) == 3:
            report.update(sm_mhz=out[0], power_w=out[1], throttle=out[2])
            break
    return report
