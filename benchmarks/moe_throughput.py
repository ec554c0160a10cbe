"""MoE training throughput: megatron_plugin vs HF + accelerate on Qwen3-MoE (issue 26), one GPU.

Modes: `megatron` (the plugin: mcore MoE layers, grouped GEMMs over the local experts), `megatron_compile`
(`torch_compile=True`), `hf_compile` (transformers' Qwen3MoeForCausalLM as a careful user runs it:
`attn_implementation="sdpa"`, `experts_implementation="grouped_mm"`, bf16 autocast over fp32 master weights,
`torch.optim.AdamW(fused=True)`, foreach clipping, `torch.compile(model)`), `hf_eager` (the same without
torch.compile), and, only when asked for, `hf_compile_bf16` (HF + compile with bf16 weights and no fp32
master copy: a different numeric recipe, listed because transformers runs its grouped_mm path in bf16 only;
under autocast with fp32 weights it casts the activations up and multiplies in fp32, and under
torch.compile it falls back to a loop over experts). Random init from a config (no downloads), synthetic
tokens, the same weights, tokens, global batch and micro-batches for every mode; each mode runs in its own
process (torchrun for several GPUs) and prints one JSON line; the driver prints a markdown table and the
ratio of each plugin mode to hf_compile.

    python benchmarks/moe_throughput.py --size qwen3-moe-small --modes hf_eager,hf_compile
    python benchmarks/moe_throughput.py --size qwen3-moe-small --modes megatron,megatron_compile
    python benchmarks/moe_throughput.py --size qwen3-moe-small --modes megatron_compile --profile /tmp/moe_prof
    python benchmarks/moe_throughput.py --size qwen3-moe-tiny --device cpu --modes hf_eager,megatron --steps 2

qwen3-moe-small (the issue's shape): hidden 1024, 24 layers, 16 heads, 4 KV heads, head_dim 64, 32 experts,
top-4 (renormalized, as Qwen3-MoE checkpoints set norm_topk_prob), moe_intermediate 768, vocab 151936
(untied LM head), seq 2048; global batch 8 = 2 micro-batches of 4. `--aux_loss` sets HF's
`output_router_logits` (HF adds its load-balancing loss; the plugin then sets moe_aux_loss_coeff from it).

FLOPs per token = 6 * N_active + 12 * L * a * s: N_active is every parameter but the experts a token is not
routed to (embedding and LM head included, as MoE models quote active parameters; router and norms too),
L layers, a = heads * head_dim, s sequence length (attention scores and values, forward and backward, not
halved for the causal mask). MFU = achieved FLOP/s / the GPU's dense bf16 peak (train_throughput.PEAK_BF16).
`--profile DIR` then profiles `--profile_steps` more steps of each mode run: top CUDA kernels and time by
kind printed (benchmarks/profile_step.summarize) and saved with the Chrome trace under DIR.
"""

import contextlib
import io
import json
import os
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# this checkout's megatron_plugin, also when the installed one is another copy (or none is installed)
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

from bench_steps import hf_step, megatron_step, timed_steps  # noqa: E402
from train_throughput import parser as dense_parser  # noqa: E402
from train_throughput import peak_flops  # noqa: E402

# layers, hidden, heads, KV heads, experts, top-k, moe_intermediate, vocab, default seq
SIZES = {
    "qwen3-moe-small": (24, 1024, 16, 4, 32, 4, 768, 151936, 2048),
    "qwen3-moe-tiny": (2, 64, 4, 2, 8, 2, 32, 1003, 128),
}
MEGATRON_MODES = ("megatron", "megatron_compile")
HF_MODES = ("hf_eager", "hf_compile", "hf_compile_bf16")
FAMILY = "qwen3_moe"


def model_config(size, seq, aux_loss=False):
    from transformers import Qwen3MoeConfig

    layers, hidden, heads, kv, experts, topk, moe_ffn, vocab, _ = SIZES[size]
    return Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          num_key_value_heads=kv, num_experts=experts, num_experts_per_tok=topk,
                          moe_intermediate_size=moe_ffn, intermediate_size=4 * moe_ffn, vocab_size=vocab,
                          max_position_embeddings=seq, norm_topk_prob=True, tie_word_embeddings=False,
                          output_router_logits=aux_loss, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def moe_layers(cfg):
    """Which decoder layers are sparse (transformers' Qwen3MoeDecoderLayer rule)."""
    return [i for i in range(cfg.num_hidden_layers) if i not in (cfg.mlp_only_layers or [])
            and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0]


def param_counts(cfg):
    """(all parameters, active parameters per token) of Qwen3MoeForCausalLM built from `cfg`."""
    h, L, heads, kv = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    attn = 2 * h * heads * hd + 2 * h * kv * hd + 2 * hd  # q, o, k, v, q_norm, k_norm
    if cfg.attention_bias:
        attn += heads * hd + 2 * kv * hd + h
    sparse = len(moe_layers(cfg))
    expert = 3 * h * cfg.moe_intermediate_size
    total = (L * (attn + 2 * h) + sparse * (cfg.num_experts * h + cfg.num_experts * expert)
             + (L - sparse) * 3 * h * cfg.intermediate_size
             + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h)
    return total, total - sparse * (cfg.num_experts - cfg.num_experts_per_tok) * expert


def flops_per_token(cfg, seq):
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    _, active = param_counts(cfg)
    return 6 * active + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * seq


def require_family():
    """The plugin modes need megatron_plugin to know Qwen3-MoE (issue 26); say so instead of failing deep
    inside prepare."""
    from megatron_plugin.models import FAMILIES

    if FAMILY not in FAMILIES:
        raise SystemExit(f"megatron_plugin has no '{FAMILY}' model family (known: {', '.join(FAMILIES)}): the "
                         "plugin modes need the MoE families of issue 26; run the hf_* modes only")


def build_step(args):
    """Model and data for one mode in this process; returns (step, hf_config, world size, device)."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.mode not in MEGATRON_MODES + HF_MODES:
        raise SystemExit(f"unknown mode {args.mode!r}: choose from {', '.join(MEGATRON_MODES + HF_MODES)}")
    if args.mode in MEGATRON_MODES:
        require_family()
    cfg = model_config(args.size, args.seq, args.aux_loss)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)
    with device:  # the same initial weights for every mode (one RNG stream on one device)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", experts_implementation="grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (args.global_batch, args.seq), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    if args.mode in HF_MODES:
        recipe = "bf16_params" if args.mode == "hf_compile_bf16" else "master_fp32"
        step = hf_step(args, model, data, device, world, compiled=args.mode != "hf_eager", recipe=recipe)
        return step, cfg, world, device
    # the plugin copies the weights into its own modules: keep the HF copy off the GPU, out of the peak memory
    model.to("cpu")
    if not cpu:
        torch.cuda.empty_cache()
    extra = {"expert_model_parallel_size": args.ep} if args.ep > 1 else {}
    batches = args.steps + args.warmup + (args.profile_steps if args.profile else 0)
    step = megatron_step(args, model, data, world, batches, compiled=args.mode == "megatron_compile", **extra)
    return step, cfg, world, device


def variant(args):
    name = args.mode
    if args.mode in MEGATRON_MODES:
        name += "".join(f"+{f}" for f in ("sp", "distopt", "recompute", "fused", "wgrad_fusion", "no_wgrad_fusion")
                        if getattr(args, f))
        name += f"+ep{args.ep}" if args.ep > 1 else ""
    if args.compile_mode and "compile" in args.mode:
        name += f" mode={args.compile_mode}"
    if args.aux_loss:
        name += " +aux loss"
    return name


def measure(args):
    """One mode in this process: prints (last rank) and returns the result row."""
    import torch

    step, cfg, world, device = build_step(args)
    for _ in range(args.warmup):
        step()
    watch = {}
    dt, step_ms, peak, losses = timed_steps(step, args.steps, device, events=watch)
    tok_s = args.global_batch * args.seq * args.steps / dt
    total, active = param_counts(cfg)
    flops = tok_s * flops_per_token(cfg, args.seq) / world
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {
        "size": args.size, "mode": variant(args), "gpus": world, "tp": args.tp, "pp": args.pp, "ep": args.ep,
        "global_batch": args.global_batch, "seq": args.seq, "tok_s": round(tok_s),
        "step_ms": round(dt / args.steps * 1e3, 1), "tflops_per_gpu": round(flops / 1e12, 2),
        "mfu": round(flops / peak_flops(name), 4), "peak_mem_gib": None if peak is None else round(peak / 2**30, 2),
        "params": total, "active_params": active, "device": name, "steps_ms": step_ms,
        # the same model, tokens and optimizer: the modes' losses track each other (HF's includes its aux loss)
        "losses": [round(x, 4) for x in losses],
        # Python's garbage collector stops the host that launches the kernels: its pauses per timed step
        "gc_ms_per_step": round(watch["gc_ms"] / args.steps, 1), "gc_full_per_step": round(watch["gc_full"] / args.steps, 2),
        # what else happened in which step (bench_steps.StepWatch): GC, recompiles; the allocator's misses
        "step_events": watch["step_events"], **({"allocator": watch["allocator"]} if "allocator" in watch else {}),
    }
    last = int(os.environ.get("RANK", "0")) == world - 1
    if last:
        print("RESULT " + json.dumps(result), flush=True)
    if args.profile:
        profile(step, args, device, last)
    return result


def profile(step, args, device, report):
    """`--profile_steps` more steps under torch.profiler: the kernel summary printed and written to
    DIR/<size>_<mode>_summary.txt, the Chrome trace to DIR/<size>_<mode>_trace.json.gz (last rank)."""
    from profile_step import profile_steps, summarize

    prof, wall = profile_steps(step, args.profile_steps)
    if not report:
        return
    os.makedirs(args.profile, exist_ok=True)
    stem = os.path.join(args.profile, f"{args.size}_{args.mode}")
    text = io.StringIO()
    # exported before the summary: a profile is exported once, and --gaps reads the trace too
    prof.export_chrome_trace(stem + "_trace.json.gz")  # gzip: a 24-layer step's trace is ~100 MB of JSON
    with contextlib.redirect_stdout(text):
        summarize(prof, args.profile_steps, wall, f"mode={variant(args)} size={args.size} device={device.type}",
                  top=args.top, gaps=args.gaps, trace=stem + "_trace.json.gz")
    print(text.getvalue(), flush=True)
    with open(stem + "_summary.txt", "w") as f:
        f.write(text.getvalue())


def table(rows):
    lines = ["| size | mode | GPUs | TPxPPxEP | global batch x seq | tokens/s | step ms | TFLOP/s/GPU | MFU (active) | "
             "peak mem GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = "-" if r["peak_mem_gib"] is None else r["peak_mem_gib"]
        lines.append(f"| {r['size']} | {r['mode']} | {r['gpus']} | {r['tp']}x{r['pp']}x{r['ep']} | "
                     f"{r['global_batch']}x{r['seq']} | {r['tok_s']:,} | {r['step_ms']} | {r['tflops_per_gpu']} | "
                     f"{r['mfu']:.1%} | {mem} |")
    r = rows[0]
    lines.append(f"\ndevice: {r['device']}; parameters {r['params'] / 1e6:,.1f}M, active per token "
                 f"{r['active_params'] / 1e6:,.1f}M")
    base = [x for x in rows if x["mode"].split(" ")[0] == "hf_compile"]
    for x in rows:
        if base and x["mode"].startswith("megatron"):
            lines.append(f"{x['mode']} / {base[-1]['mode']}: {x['tok_s'] / base[-1]['tok_s']:.2f}x tokens/s")
    return "\n".join(lines)


def drive(args):
    if args.table_only:
        with open(args.rows) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MEGATRON_MODES + HF_MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: choose from {', '.join(MEGATRON_MODES + HF_MODES)}")
    if any(m in MEGATRON_MODES for m in modes):
        require_family()
    rows = []
    if args.rows and os.path.exists(args.rows):  # earlier invocations' rows, e.g. the HF modes run apart
        with open(args.rows) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}))
    for mode in modes:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--size", args.size, "--mode", mode,
               "--device", args.device, "--profile_steps", str(args.profile_steps), "--top", str(args.top),
               "--gaps", str(args.gaps)]
        for key in ("seq", "global_batch", "steps", "warmup", "tp", "pp", "ep", "num_micro", "compile_mode", "profile"):
            if getattr(args, key) not in (None, ""):
                cmd += [f"--{key}", str(getattr(args, key))]
        cmd += [f"--{flag}" for flag in ("sp", "distopt", "recompute", "fused", "wgrad_fusion", "no_wgrad_fusion",
                                         "aux_loss") if getattr(args, flag)]
        if args.nproc > 1:
            cmd = ["torchrun", "--nproc-per-node", str(args.nproc)] + cmd[1:]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            print(f"{args.size} {mode}: over --timeout {args.timeout}s\n{(e.stdout or b'')[-2000:]}", flush=True)
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{args.size} {mode}: failed (exit {proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}",
                  flush=True)
            continue
        if args.profile:
            print(proc.stdout.split(lines[-1], 1)[-1].strip(), flush=True)
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")
    if rows:
        print("\n" + table(rows), flush=True)
    return rows


def parser():
    p = dense_parser(__doc__.splitlines()[0])
    p.set_defaults(size="qwen3-moe-small", modes="megatron,megatron_compile,hf_eager,hf_compile", seq=None,
                   global_batch=8, num_micro=2)
    p.add_argument("--ep", type=int, default=1, help="megatron: expert_model_parallel_size (with --nproc)")
    p.add_argument("--aux_loss", action="store_true",
                   help="HF config output_router_logits=True: HF's load-balancing loss in both runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run without a GPU (timings say nothing there)")
    p.add_argument("--profile", default="", help="folder: profile --profile_steps more steps of each mode run")
    p.add_argument("--profile_steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="kernels listed by --profile")
    p.add_argument("--gaps", type=int, default=0,
                   help="--profile also lists the host ranges whose kernel launches the GPU waited for most")
    p.add_argument("--rows", default="", help="JSON-lines file: rows appended, and the table printed over all of them")
    p.add_argument("--table_only", action="store_true", help="print the table of the --rows file and run nothing")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed per mode")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.size not in SIZES:
        raise SystemExit(f"unknown --size {args.size!r}: choose from {', '.join(SIZES)}")
    args.seq = args.seq or SIZES[args.size][-1]
    measure(args) if args.one else drive(args)


if __name__ == "__main__":
    main()
