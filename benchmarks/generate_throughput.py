"""Generation throughput: `megatron_generate` (KV cache; CUDA-graph decode step, or eager) vs HF `generate`
with its KV cache, the same model, dtype, GPU, prompts and greedy decoding, in one run.

    python benchmarks/generate_throughput.py                               # GPT-2 124M shape, bf16 and fp32
    python benchmarks/generate_throughput.py --nproc 2 --tp 2 --modes megatron,megatron_eager
    python benchmarks/generate_throughput.py --nproc 2 --pp 2 --modes megatron_eager

Tokens/s = batch x new tokens / wall time of one `generate` call (prefill included), median of --repeat
calls after a warm-up call. Each measurement runs in its own process; the driver prints a table.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def build(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt))
    if args.mode.startswith("hf"):
        model = model.to("cuda", dtype).eval()
        ids = ids.cuda()
        kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
        if args.mode == "hf_static":
            kwargs["cache_implementation"] = "static"

        def run():
            with torch.no_grad():
                return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return run
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    plugin = MegatronLMPlugin(tp_degree=args.tp, pp_degree=args.pp)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16" if args.dtype == "bf16" else "no")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader([{"input_ids": ids[0]}], batch_size=1)
    engine, opt, loader, _ = acc.prepare(model, opt, loader, MegatronLMDummyScheduler(opt, total_num_steps=1))
    engine.eval()
    graphs = args.mode == "megatron"

    def run():
        return engine.megatron_generate(ids, max_new_tokens=args.new, eos_token_id=[], cuda_graphs=graphs)
    return run


def measure(args):
    import torch

    run = build(args)
    out = run()  # warm-up (and CUDA-graph capture)
    assert out.shape == (args.batch, args.prompt + args.new), out.shape
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        print("RESULT " + json.dumps({
            "mode": args.mode, "dtype": args.dtype, "batch": args.batch, "tp": args.tp, "pp": args.pp,
            "seconds": round(dt, 4), "tok_s": round(args.batch * args.new / dt), "device": torch.cuda.get_device_name(),
        }), flush=True)


def drive(args):
    rows = []
    for dtype in args.dtypes.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            for mode in args.modes.split(","):
                if mode.startswith("hf") and args.nproc > 1:
                    continue
                cmd = [os.path.abspath(__file__), "--one", "--mode", mode, "--dtype", dtype, "--batch", str(batch)]
                for key in ("prompt", "new", "repeat", "tp", "pp"):
                    cmd += [f"--{key}", str(getattr(args, key))]
                cmd = (["torchrun", "--nproc-per-node", str(args.nproc)] if args.nproc > 1 else [sys.executable]) + cmd
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode or not lines:
                    print(f"{mode} {dtype} b{batch}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
                    continue
                rows.append(json.loads(lines[-1][len("RESULT "):]))
                print(json.dumps(rows[-1]), flush=True)
    if rows:
        print(f"\nprompt {args.prompt}, {args.new} new tokens, greedy; GPT-2 124M shape")
        print("| mode | dtype | batch | TPxPP | seconds | tokens/s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['dtype']} | {r['batch']} | {r['tp']}x{r['pp']} | {r['seconds']} | {r['tok_s']:,} |")
        print(f"\ndevice: {rows[0]['device']}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="megatron,megatron_eager,hf",
                   help="megatron (CUDA-graph decode), megatron_eager, hf (HF generate, dynamic cache), hf_static")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--mode", default="megatron")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    measure(args) if args.one else drive(args)


if __name__ == "__main__":
    main()
