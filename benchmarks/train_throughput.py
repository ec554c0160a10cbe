"""Training throughput: megatron_plugin vs the strongest plain HF + accelerate set-up, GPT-2 and Llama shapes.

Modes: `megatron` (the plugin, eager layers), `megatron_compile` (`torch_compile=True`), `hf_compile`
(HF + accelerate as a careful user writes it: `attn_implementation="sdpa"` set explicitly, bf16
autocast over fp32 master weights, `torch.optim.AdamW(fused=True)`, foreach gradient clipping,
`torch.compile(model)`), `hf_eager` (the same without torch.compile). Each measurement runs in its own
process (torchrun for several GPUs) and prints one JSON line; the driver prints a markdown table.
Synthetic tokens, the same global batch and micro-batches for every mode.

    python benchmarks/train_throughput.py --sizes 124m,350m
    python benchmarks/train_throughput.py --sizes 1.5b --num_micro 4        # 4 micro-batches of 4
    python benchmarks/train_throughput.py --sizes 1.5b --num_micro 1 --modes megatron_compile --wgrad_fusion  # 46.5% MFU (H100)
    python benchmarks/train_throughput.py --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 4
    python benchmarks/train_throughput.py --sizes 124m --modes megatron --nproc 2 --global_batch 32
    python benchmarks/train_throughput.py --sizes llama-1b --seq 2048 --global_batch 8 --num_micro 2 --lora_r 16 \
        --modes megatron_compile,hf_compile   # LoRA (peft) on q,k,v,o,gate,up,down against HF peft + compile

With `--lora_r R` both sides train a peft `get_peft_model(model, LoraConfig(r=R, lora_alpha=2R, target_modules=
every attention and MLP projection))`: the plugin takes the PeftModel through prepare; HF peft (its strongest
form: the frozen base held in bf16, peft's fp32 adapters, bf16 autocast, fused AdamW over the adapters, compiled).
With `--fp8 e4m3|hybrid --fp8_recipe delayed|tensorwise|rowwise` the plugin's modes run the transformer layers'
linears with FP8 GEMMs (MegatronLMPlugin(fp8=..., fp8_recipe=...), layers/fp8.py; GPUs of compute capability >= 8.9;
the hf modes ignore it); the MFU column still divides by the bf16 peak: compare tok/s.
    python benchmarks/train_throughput.py --sizes 1.5b --num_micro 1 --modes megatron_compile --fp8 hybrid --fp8_recipe tensorwise
`static_mem_gib` is what is allocated before the first step (weights, optimizer state); the TFLOP/s and MFU
columns still count 6N per token, which a LoRA step does not do (no base weight gradients): compare tok/s.
Beside `step_ms` (each timed step's span on the GPU's timeline) the JSON line says what else happened in each
step (bench_steps.StepWatch): `host_ms` (the host's time per step), `sync_wait_ms` (of it, the time waiting for
the GPU in the engine's one sync a step: ~0 where the host bounds the step), `step_events` ([step, "gc gen2 87.0 ms"],
[step, "1 Dynamo frame(s) compiled"]) and `allocator` (new cudaMallocs and retries in the timed window), so that
a slow step names its cause: a collection, a recompile, an allocator miss, or none of them (host jitter); `host`
says what can slow a whole run with no slow step to show (the CPU it ran on, the load, the GPU's clock and
throttle reasons after the timed steps) and `setup_s`, the seconds before the first timed step.
`--manual_gc N` runs the plugin with Megatron-LM's manual garbage collection (collections only every N steps).
`--cpp_wrapper on|off` overrides which compiled layers get Inductor's C++ wrapper (all or none; default: the
engine's choice, `engine/gpu.wants_cpp_wrapper`), to time that choice.

FLOPs per token = 6 * N + 12 * L * h * s (N: parameters without position embeddings, counting a tied
LM head once; L layers, h hidden size, s sequence length: the attention score and value matmuls,
forward and backward). MFU = achieved FLOP/s / the GPU's dense bf16 peak.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

_STARTED = time.perf_counter()  # the process's start, for the JSON's setup_s (imports, build, compile, warm-up)
SIZES = {  # GPT-2: n_layer, n_embd, n_head
    "124m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "774m": (36, 1280, 20),
    "1.5b": (48, 1600, 25),
}
LLAMA_SIZES = {  # layers, hidden, heads, KV heads, ffn, vocab (Llama 3.2 1B; tied embeddings)
    "llama-1b": (16, 2048, 32, 8, 8192, 128256),
}
# BERT-base (MLM, 15% of tokens labelled) and T5 v1.1-base (targets a quarter of the source length)
OTHER_SIZES = ("bert-base", "t5-base")
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(name: str) -> float:
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return float("nan")


def model_config(size, seq):
    from transformers import GPT2Config, LlamaConfig

    if size == "bert-base":
        from transformers import BertConfig

        return BertConfig(max_position_embeddings=seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          attn_implementation="sdpa")
    if size == "t5-base":
        from transformers import T5Config

        return T5Config(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12, feed_forward_proj="gated-gelu",
                        vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    if size in LLAMA_SIZES:
        layers, hidden, heads, kv, ffn, vocab = LLAMA_SIZES[size]
        return LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=seq,
                           rope_theta=500000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    n_layer, n_embd, n_head = SIZES[size]
    return GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, vocab_size=50257,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")


def flops_per_token(cfg, seq):
    if cfg.model_type == "bert":
        h, L = cfg.hidden_size, cfg.num_hidden_layers
        n = (4 * h * h + 2 * h * cfg.intermediate_size + 9 * h) * L + cfg.vocab_size * h + h * h
        return 6 * n + 12 * L * h * seq, n
    if cfg.model_type == "t5":
        # per source token: encoder on the source, decoder (self + cross attention, MLP, LM head) on a quarter
        h, a, f, L = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff, cfg.num_layers
        mlp = (3 if cfg.is_gated_act else 2) * h * f
        enc, dec = 4 * h * a + mlp, 8 * h * a + mlp
        n = (enc + dec) * L + cfg.vocab_size * h
        t = seq // 4
        per_sample = 6 * (enc * L * seq + (dec * L + cfg.vocab_size * h) * t) + 12 * L * a * (seq * seq + t * t + t * seq)
        return per_sample / seq, n
    if cfg.model_type == "llama":
        h, L = cfg.hidden_size, cfg.num_hidden_layers
        kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
        n = per_layer * L + cfg.vocab_size * h + h
        return 6 * n + 12 * L * h * seq, n
    n = (12 * cfg.n_embd**2 + 13 * cfg.n_embd) * cfg.n_layer + cfg.vocab_size * cfg.n_embd + 2 * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq, n


LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"]}


def peft_wrap(model, cfg, r, base_dtype=None):
    """peft's LoRA on every attention and MLP projection. `base_dtype`: the frozen base's dtype (HF peft's
    strongest set-up keeps it in bf16; peft casts the adapters to fp32 itself)."""
    from peft import LoraConfig, get_peft_model

    if base_dtype is not None:
        model = model.to(base_dtype)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0,
                                            target_modules=LORA_TARGETS[cfg.model_type]))


def choose_cpp_wrapper(choice: str, tp: int = 1, cp: int = 1) -> None:
    """--cpp_wrapper: "on" / "off" overrides the engine's choice of Inductor's wrapper for every compiled layer
    of this process (the benchmark's own switch, to time that choice; "auto" leaves it to the engine). "on" not
    with CP: the C++ wrapper runs each graph once more while compiling it, and CP's key/value gather would then
    run on this rank alone (TP's collectives skip that run: engine/gpu.wants_cpp_wrapper)."""
    if choice == "on" and cp > 1:
        raise SystemExit(f"--cpp_wrapper on with --cp {cp}: the layers' key/value gathers would run an extra "
                         "time on one rank while compiling; use --cpp_wrapper auto (or off) with CP > 1")
    if choice != "auto":
        from megatron_plugin.engine import gpu

        gpu.wants_cpp_wrapper = lambda layer, compile_kwargs: choice == "on"


def build_step(args):
    """Model, optimizer and data for one mode in this process; returns (step, hf_config, world size)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    cfg = model_config(args.size, args.seq)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    choose_cpp_wrapper(args.cpp_wrapper, args.tp, args.cp)
    torch.manual_seed(0)
    auto = {"bert": AutoModelForMaskedLM, "t5": AutoModelForSeq2SeqLM}.get(cfg.model_type, AutoModelForCausalLM)
    with torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))):
        model = auto.from_config(cfg, attn_implementation="sdpa")
    hf = args.mode.startswith("hf")
    if args.lora_r:
        model = peft_wrap(model, cfg, args.lora_r, base_dtype=torch.bfloat16 if hf else None)
    # the strong HF baseline steps a fused AdamW; the plugin builds its own optimizer from this one
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01, **({"fused": True} if hf else {}))
    ids = torch.randint(0, cfg.vocab_size, (args.global_batch, args.seq))
    if cfg.model_type == "bert":
        masked = torch.rand(ids.shape) < 0.15
        data = [{"input_ids": x, "labels": x.masked_fill(~m, -100)} for x, m in zip(ids, masked)]
    elif cfg.model_type == "t5":
        data = [{"input_ids": x, "labels": x[: args.seq // 4]} for x in ids]
    else:
        data = [{"input_ids": x, "labels": x} for x in ids]

    if args.mode in ("megatron", "megatron_compile"):
        from torch.utils.data import DataLoader

        if args.domino:
            import domino_patch

            domino_patch.install(args.domino)
        if args.sp_collectives != "nccl":
            if args.tp_comm_overlap:  # its fused ops share the copy engines' workspace and barriers on another stream
                raise SystemExit("--sp_collectives ce with --tp_comm_overlap: choose one")
            import ce_collectives_patch

            ce_collectives_patch.install(args.sp_collectives)

        from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

        dp = world // (args.tp * args.pp * args.cp)
        micro = args.global_batch // (dp * args.num_micro)
        plugin = MegatronLMPlugin(tp_degree=args.tp, pp_degree=args.pp, context_parallel_size=args.cp,
                                  num_micro_batches=args.num_micro,
                                  sequence_parallelism=args.sp, use_distributed_optimizer=args.distopt,
                                  recompute_activations=args.recompute, fused_kernels=args.fused,
                                  gradient_accumulation_fusion=False if args.no_wgrad_fusion else (True if args.wgrad_fusion else None),
                                  torch_compile=args.mode == "megatron_compile",
                                  fp8=args.fp8 or None, fp8_recipe=args.fp8_recipe,
                                  first_last_layers_bf16=not args.fp8_all_layers,
                                  fp8_output_layer=bool(args.fp8 and args.fp8_output_layer),
                                  manual_gc=args.manual_gc is not None, manual_gc_interval=args.manual_gc or 0,
                                  other_megatron_args=megatron_args(args))
        dynamo = {}
        if args.compile_mode and args.mode == "megatron_compile":  # through accelerate's knob, as a user sets it
            from accelerate.utils import TorchDynamoPlugin

            dynamo["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", mode=args.compile_mode)
        acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16", **dynamo)
        loader = DataLoader(data * (args.steps + args.warmup), batch_size=micro, drop_last=True)
        sched = MegatronLMDummyScheduler(opt, total_num_steps=10 * (args.steps + args.warmup), warmup_num_steps=1)
        engine, opt, sched, loader = acc.prepare(model, opt, sched, loader)
        del model
        torch.cuda.empty_cache()
        engine.train()
        batches = iter(loader)

        def step():
            return engine(**next(batches)).loss
    else:
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision="bf16")
        model, opt = acc.prepare(model, opt)
        fwd = torch.compile(model, mode=args.compile_mode or None) if args.mode == "hf_compile" else model
        local = args.global_batch // world
        batch = {k: torch.stack([d[k] for d in data[:local]]).cuda() for k in data[0]}
        # the same micro-batches as the plugin gets: gradient accumulation over num_micro
        micro_batches = [{k: v.chunk(args.num_micro)[i] for k, v in batch.items()} for i in range(args.num_micro)]

        def step():
            for i, mb in enumerate(micro_batches):
                ctx = acc.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext()
                with ctx:
                    acc.backward(fwd(**mb).loss / len(micro_batches))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step, cfg, world


def megatron_args(args) -> dict:
    """other_megatron_args from the flags. --full_graph: Megatron's full-iteration CUDA graph, captured in the last
    warm-up step so that no timed step pays for the capture."""
    out = {"tp_comm_overlap": True} if args.tp_comm_overlap else {}
    if args.full_graph:
        out.update(cuda_graph_impl="local", cuda_graph_scope="full_iteration",
                   cuda_graph_warmup_steps=max(1, args.warmup - 1))
    return out


def measure(args):
    """One mode, one size, in this process; prints a JSON line on the last rank."""
    import torch
    from bench_steps import StepWatch, host_report

    step, cfg, world = build_step(args)
    # the warm-up steps' losses (same seed, data and weights in every arm): an arm that computes otherwise shows
    warm_losses = [step() for _ in range(args.warmup)]
    warm_losses = [round(float(x), 5) for x in warm_losses if x is not None]
    torch.cuda.synchronize()
    static_mem = torch.cuda.memory_allocated()  # weights, gradient buffers and optimizer state
    torch.cuda.reset_peak_memory_stats()
    # events between steps (they do not synchronize): each step's span on the GPU's timeline, so a slow
    # step (a recompile, an allocator miss) shows instead of hiding in the mean
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    t0 = time.perf_counter()
    marks[0].record()
    with StepWatch(cuda=True) as watch:  # what else happened in each step: GC, recompiles, allocator
        for i in range(args.steps):
            step()
            marks[i + 1].record()
            watch.end(i)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    host = host_report(t0 - _STARTED)
    step_ms = [round(a.elapsed_time(b), 1) for a, b in zip(marks, marks[1:])]
    tokens = args.global_batch * args.seq * args.steps
    per_token, n_params = flops_per_token(cfg, args.seq)
    tok_s = tokens / dt
    flops = tok_s * per_token / world
    name = torch.cuda.get_device_name()
    variant = args.mode
    if args.mode.startswith("megatron"):
        variant += "".join(f"+{f}" for f in ("sp", "distopt", "recompute", "fused", "wgrad_fusion", "no_wgrad_fusion",
                                             "tp_comm_overlap", "full_graph") if getattr(args, f))
        variant += f" domino={args.domino}" if args.domino else ""
        variant += f" sp_collectives={args.sp_collectives}" if args.sp_collectives != "nccl" else ""
    if args.compile_mode and args.mode.endswith("compile"):
        variant += f" mode={args.compile_mode}"
    if args.lora_r:
        variant += f" lora r={args.lora_r}"
    if args.fp8 and args.mode.startswith("megatron"):
        variant += f" fp8={args.fp8}/{args.fp8_recipe}" + (" all layers" if args.fp8_all_layers else "") + (
            " +output layer" if args.fp8_output_layer else "")
    if args.manual_gc is not None and args.mode.startswith("megatron"):
        variant += f" manual_gc={args.manual_gc}"
    if args.cpp_wrapper != "auto" and args.mode == "megatron_compile":
        variant += f" cpp_wrapper={args.cpp_wrapper}"
    if args.num_micro > 1:
        variant += f" ({args.num_micro} micro-batches)"
    result = {
        "size": args.size, "mode": variant, "gpus": world, "tp": args.tp, "pp": args.pp, "cp": args.cp,
        "global_batch": args.global_batch, "tok_s": round(tok_s), "tflops_per_gpu": round(flops / 1e12, 1),
        "mfu": round(flops / peak_flops(name), 3), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "static_mem_gib": round(static_mem / 2**30, 2),
        "params": n_params, "device": name, "step_ms": step_ms, **watch.report(), "host": host,
        "warmup_losses": warm_losses,
    }
    if int(os.environ.get("RANK", "0")) == world - 1:
        print("RESULT " + json.dumps(result), flush=True)


def drive(args):
    rows = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", "--size", size, "--mode", mode]
            for key in ("seq", "global_batch", "steps", "warmup", "tp", "pp", "cp", "num_micro", "compile_mode", "lora_r"):
                cmd += [f"--{key}", str(getattr(args, key))]
            cmd += ["--fp8", args.fp8, "--fp8_recipe", args.fp8_recipe] if args.fp8 else []
            cmd += ["--fp8_all_layers"] if args.fp8 and args.fp8_all_layers else []
            cmd += ["--fp8_output_layer"] if args.fp8 and args.fp8_output_layer else []
            cmd += ["--manual_gc", str(args.manual_gc)] if args.manual_gc is not None else []
            cmd += ["--cpp_wrapper", args.cpp_wrapper]
            cmd += ["--domino", args.domino] if args.domino else []
            cmd += ["--sp_collectives", args.sp_collectives]
            cmd += [f"--{flag}" for flag in ("sp", "distopt", "recompute", "fused", "wgrad_fusion", "no_wgrad_fusion",
                                             "tp_comm_overlap", "full_graph") if getattr(args, flag)]
            if args.nproc > 1:
                cmd = ["torchrun", "--nproc-per-node", str(args.nproc)] + cmd[1:]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{size} {mode}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
                continue
            row = json.loads(lines[-1][len("RESULT "):])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rows:
        print("\n| size | mode | GPUs | TPxCPxPP | global batch | tokens/s | TFLOP/s/GPU | MFU | peak mem GiB | static mem GiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['size']} | {r['mode']} | {r['gpus']} | {r['tp']}x{r.get('cp', 1)}x{r['pp']} | {r['global_batch']} | {r['tok_s']:,} | "
                  f"{r['tflops_per_gpu']} | {r['mfu']:.1%} | {r['peak_mem_gib']} | {r.get('static_mem_gib', '')} |")
        print(f"\ndevice: {rows[0]['device']}")


def parser(description=__doc__.splitlines()[0]):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sizes", default="124m,350m")
    p.add_argument("--modes", default="megatron,megatron_compile,hf_eager,hf_compile",
                   help="megatron (eager layers), megatron_compile (torch_compile=True), hf_eager, hf_compile")
    p.add_argument("--size", default="124m")
    p.add_argument("--mode", default="megatron")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--global_batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="megatron: context_parallel_size (with --nproc)")
    p.add_argument("--num_micro", type=int, default=1)
    p.add_argument("--compile_mode", default="",
                   help="torch.compile mode for both compiled modes, e.g. reduce-overhead (CUDA graphs); the plugin "
                        "gets it through accelerate's TorchDynamoPlugin")
    p.add_argument("--lora_r", type=int, default=0, help="train peft LoRA adapters of this rank (0: full fine-tuning)")
    p.add_argument("--fp8", default="", choices=["", "e4m3", "hybrid"],
                   help="megatron: MegatronLMPlugin(fp8=...): FP8 GEMMs in the transformer layers (SM >= 8.9)")
    p.add_argument("--fp8_recipe", default="delayed", choices=["delayed", "tensorwise", "rowwise"],
                   help="megatron: MegatronLMPlugin(fp8_recipe=...), with --fp8")
    p.add_argument("--fp8_output_layer", action="store_true",
                   help="megatron + --fp8: the output layer (vocabulary projection) in FP8 too (fp8_output_layer)")
    p.add_argument("--fp8_all_layers", action="store_true",
                   help="megatron, with --fp8: every transformer layer in FP8 (first_last_layers_bf16=False, "
                        "Megatron-LM's default)")
    p.add_argument("--manual_gc", type=int, default=None, metavar="N",
                   help="megatron: MegatronLMPlugin(manual_gc=True, manual_gc_interval=N): Python's collector off, "
                        "a collection every N steps (0: none between steps)")
    p.add_argument("--cpp_wrapper", default="auto", choices=["auto", "on", "off"],
                   help="megatron_compile: Inductor's C++ wrapper for every compiled layer (on), for none (off), or as "
                        "the engine chooses (auto: engine/gpu.wants_cpp_wrapper); to time the choice, one GPU only")
    p.add_argument("--sp", action="store_true")
    p.add_argument("--full_graph", action="store_true",
                   help="megatron: Megatron's full-iteration CUDA graph (other_megatron_args cuda_graph_impl='local', "
                        "cuda_graph_scope='full_iteration'), captured in the last warm-up step")
    p.add_argument("--tp_comm_overlap", action="store_true",
                   help="megatron: other_megatron_args={'tp_comm_overlap': True} (SP's collectives overlapped with the GEMMs)")
    p.add_argument("--domino", default="", choices=["", "visible", "halves", "halves_reorder", "halves_sched", "hand"],
                   help="megatron_compile + SP: an experiment (benchmarks/domino_patch.py): each layer runs two "
                        "halves of its batch so that one half's SP collectives run under the other's GEMMs")
    p.add_argument("--sp_collectives", default="nccl", choices=["nccl", "ce"],
                   help="megatron_compile + SP: an experiment (benchmarks/ce_collectives_patch.py): 'ce' moves the "
                        "compiled SP linears' gathers and reduce-scatters with the copy engines instead of NCCL")
    p.add_argument("--distopt", action="store_true")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--fused", action="store_true", help="megatron: MegatronLMPlugin(fused_kernels=True)")
    fusion = p.add_mutually_exclusive_group()
    fusion.add_argument("--wgrad_fusion", action="store_true",
                        help="megatron: MegatronLMPlugin(gradient_accumulation_fusion=True), compiled layers too")
    fusion.add_argument("--no_wgrad_fusion", action="store_true",
                        help="megatron: MegatronLMPlugin(gradient_accumulation_fusion=False)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    return p


def main():
    args = parser().parse_args()
    measure(args) if args.one else drive(args)


if __name__ == "__main__":
    main()
