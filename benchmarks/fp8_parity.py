"""FP8 loss parity (issue 32, check 2): the same model, data and seed trained in bf16 and in FP8, loss by loss.

Each arm (bf16, or FP8 with one recipe) trains in its own process through `prepare` (`megatron_compile` by default,
as train_throughput runs it; bench_steps.megatron_step), from the same initial weights (one seed, built on the
same device) on the same samples in the same order, and writes `--out DIR/<size>_<arm>.json` (the loss of every
step, tok/s, the settings). The driver runs the arms one after another and prints a markdown table: the mean of
the last 50 losses, its difference from bf16's, pass at 1%. `--plot DIR` (on a machine with matplotlib: it is
imported only there) draws the curves from the JSONs into DIR/fp8_parity.png.

    python benchmarks/fp8_parity.py --sizes 350m,llama-1b --out fp8_parity          # every arm, one H100
    python benchmarks/fp8_parity.py --one --size 350m --precision fp8 --fp8 hybrid --fp8_recipe delayed --out fp8_parity
    python benchmarks/fp8_parity.py --table fp8_parity                               # the table again, from the JSONs
    python benchmarks/fp8_parity.py --plot fp8_parity                                # PNG (pip install matplotlib)
    python benchmarks/fp8_parity.py --sizes tiny --arms bf16 --device cpu --steps 4 --seq 64 --out /tmp/smoke

Data: real text, no network: examples/data/corpus.txt (English prose from Python's docstrings, ~500 kB) or
`--train_file`, tokenized by a byte-level BPE tokenizer built from it as the GPT demo builds its own
(examples/megatron_lm_gpt_pretraining.build_tokenizer), `--vocab` entries; the model's vocabulary is the
tokenizer's (the shapes are otherwise train_throughput's: GPT-2 350M, the Llama-3.2-1B layers). The text is cut
into `--seq`-token blocks, cached under DIR/data. The demo corpus is small: at the default vocabulary (8,039
entries: the BPE runs out of pairs below 8,192) it is 218 blocks of 512 tokens, which 300 steps of 8 blocks read
eleven times over. Epochs are cycled deterministically (epoch e is a permutation of the blocks drawn from
seed + e), every arm reads the same stream, and each JSON records how many epochs it read: the losses late in
the run are partly memorization, the same for every arm, which is what the comparison needs.

Learning rate: bench_steps' AdamW at 1e-4, constant, gradient clipping at 1.0 (the plugin's default).
"""

import json
import os
import subprocess
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

from bench_steps import megatron_step, timed_steps  # noqa: E402
from train_throughput import model_config, parser as dense_parser  # noqa: E402

CORPUS = os.path.join(ROOT, "examples", "data", "corpus.txt")
ARMS = ("bf16", "tensorwise", "delayed", "rowwise")  # bf16, then the FP8 recipes
LAST = 50  # losses averaged at the end of a run
TOLERANCE = 0.01


def arm_name(args) -> str:
    if args.precision == "bf16":
        return "bf16"
    return f"fp8-{args.fp8}-{args.fp8_recipe}" + ("-output" if getattr(args, "fp8_output_layer", False) else "")


def tiny_config(seq, vocab):
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=seq, vocab_size=vocab, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def hf_config(size, seq, tokenizer):
    cfg = tiny_config(seq, len(tokenizer)) if size == "tiny" else model_config(size, seq)
    cfg.vocab_size = len(tokenizer)
    # the tokenizer's end-of-text id: GPT-2's and Llama's defaults lie outside a smaller vocabulary
    cfg.bos_token_id = cfg.eos_token_id = tokenizer.eos_token_id
    return cfg


def _write_atomic(path, save):
    tmp = f"{path}.tmp{os.getpid()}"
    save(tmp)
    os.replace(tmp, path)


def tokenized_blocks(train_file, vocab, seq, cache):
    """(tokenizer, [blocks, seq] int64 tensor of the text's tokens, end-of-text after each line), built once
    and kept under `cache`."""
    import torch
    from transformers import PreTrainedTokenizerFast

    os.makedirs(cache, exist_ok=True)
    tok_dir = os.path.join(cache, f"tokenizer_v{vocab}")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        # imported only here: the example imports `datasets`, which a GPU machine given the cache may lack
        sys.path.insert(0, ROOT)
        from examples.megatron_lm_gpt_pretraining import build_tokenizer

        tokenizer = build_tokenizer(train_file, vocab, tok_dir)
    path = os.path.join(cache, f"blocks_v{vocab}_s{seq}.pt")
    if os.path.exists(path):
        return tokenizer, torch.load(path)
    with open(train_file, encoding="utf-8") as f:
        lines = [line.rstrip("\n") + tokenizer.eos_token for line in f if line.strip()]
    ids = [i for row in tokenizer(lines)["input_ids"] for i in row]
    n = len(ids) // seq
    blocks = torch.tensor(ids[: n * seq], dtype=torch.long).reshape(n, seq)
    _write_atomic(path, lambda p: torch.save(blocks, p))
    return tokenizer, blocks


def sample_order(n_blocks, samples, seed):
    """The block index of each of `samples` samples: epoch e a permutation drawn from seed + e, as many epochs
    as the run needs."""
    import torch

    order, epoch = [], 0
    while len(order) < samples:
        order += torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        epoch += 1
    return order[:samples]


def run_arm(args):
    """One arm in this process: train `args.steps` steps, write and return its result."""
    import torch

    if args.precision == "fp8" and args.device == "cpu":
        raise SystemExit("--precision fp8 needs a GPU of compute capability >= 8.9 (the plugin refuses it on CPU)")
    tokenizer, blocks = tokenized_blocks(args.train_file, args.vocab, args.seq, os.path.join(args.out, "data"))
    samples = args.steps * args.global_batch
    epochs = samples / len(blocks)
    if len(blocks) < args.global_batch:
        raise SystemExit(f"{args.train_file} gives {len(blocks)} blocks of {args.seq} tokens, fewer than one global "
                         f"batch ({args.global_batch}): pass a larger --train_file or a smaller --seq")
    data = [{"input_ids": blocks[i], "labels": blocks[i]} for i in sample_order(len(blocks), samples, args.seed)]
    cfg = hf_config(args.size, args.seq, tokenizer)

    from transformers import AutoModelForCausalLM

    cpu = args.device == "cpu" or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(args.seed)
    with device:  # every arm starts from the same weights: one RNG stream on one device
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.to("cpu")  # the plugin copies the weights into its modules: the HF copy stays off the GPU
    if not cpu:
        torch.cuda.empty_cache()
    fp8 = dict(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_output_layer=bool(args.fp8_output_layer)) \
        if args.precision == "fp8" else {}
    step = megatron_step(args, model, data, int(os.environ.get("WORLD_SIZE", "1")), 1,
                         compiled=args.mode == "megatron_compile", **fp8)
    del model
    dt, step_ms, peak, losses = timed_steps(step, args.steps, device)
    # tok/s past the first steps (compilation, allocator warm-up), from the per-step times
    steady = step_ms[min(10, len(step_ms) // 2):] or step_ms
    tok_s = args.global_batch * args.seq * len(steady) / (sum(steady) / 1e3) if sum(steady) > 0 else float("nan")
    result = {
        "size": args.size, "arm": arm_name(args), "precision": args.precision, "mode": args.mode,
        "fp8": args.fp8 if args.precision == "fp8" else None,
        "fp8_recipe": args.fp8_recipe if args.precision == "fp8" else None,
        "steps": args.steps, "seq": args.seq, "global_batch": args.global_batch, "num_micro": args.num_micro,
        "seed": args.seed, "vocab": cfg.vocab_size, "train_file": os.path.relpath(args.train_file, ROOT),
        "blocks": len(blocks), "epochs": round(epochs, 2), "losses": losses, "step_ms": step_ms,
        "tok_s": round(tok_s), "seconds": round(dt, 1),
        "peak_mem_gib": round(peak / 2**30, 2) if peak is not None else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{args.size}_{result['arm']}.json")
        _write_atomic(path, lambda p: open(p, "w").write(json.dumps(result)))
        print(f"RESULT {path}", flush=True)
    return result


def load_results(folder):
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                rows.append(json.load(f))
    return rows


def tail_mean(losses, last=LAST):
    tail = losses[-last:]
    return sum(tail) / len(tail)


def _arm_order(row):
    known = ("bf16", "fp8-hybrid-tensorwise", "fp8-hybrid-delayed", "fp8-hybrid-rowwise")
    return row["size"], known.index(row["arm"]) if row["arm"] in known else len(known), row["arm"]


def table(rows, last=LAST, tolerance=TOLERANCE):
    """Markdown: per size, each arm's mean of its last `last` losses and its relative difference from the bf16
    arm's (pass: within `tolerance`); an arm without a bf16 run of its size has no verdict."""
    rows = sorted(rows, key=_arm_order)
    ref = {r["size"]: tail_mean(r["losses"], last) for r in rows if r["arm"] == "bf16"}
    lines = [f"| size | arm | steps | epochs of the text | mean loss, last {last} | vs bf16 | within {tolerance:.0%} | "
             "tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mean = tail_mean(r["losses"], last)
        if r["size"] in ref and r["arm"] != "bf16":
            rel = (mean - ref[r["size"]]) / ref[r["size"]]
            diff, verdict = f"{rel:+.2%}", ("pass" if abs(rel) <= tolerance else "FAIL")
        else:
            diff, verdict = "", ""
        lines.append(f"| {r['size']} | {r['arm']} | {r['steps']} | {r['epochs']} | {mean:.4f} | {diff} | {verdict} | "
                     f"{r['tok_s']:,} |")
    devices = sorted({r["device"] for r in rows})
    lines.append(f"\ndevice: {', '.join(devices)}; global batch {rows[0]['global_batch']} x {rows[0]['seq']} tokens"
                 if rows else "\n(no results)")
    return "\n".join(lines)


def plot(folder, smooth=10):
    """DIR/fp8_parity.png: each size's loss curves (a running mean over `smooth` steps), and each FP8 arm's
    difference from bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(load_results(folder), key=_arm_order)
    # one colour per arm in every panel
    arms = sorted({r["arm"] for r in rows}, key=lambda arm: _arm_order({"size": "", "arm": arm}))
    colours = {arm: f"C{i}" for i, arm in enumerate(arms)}
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(6 * len(sizes), 8), squeeze=False)

    def running(xs):
        return [sum(xs[max(0, i - smooth + 1): i + 1]) / (i - max(0, i - smooth + 1) + 1) for i in range(len(xs))]

    for col, size in enumerate(sizes):
        arms = [r for r in rows if r["size"] == size]
        ref = next((r for r in arms if r["arm"] == "bf16"), None)
        for r in arms:
            axes[0][col].plot(running(r["losses"]), label=r["arm"], color=colours[r["arm"]])
            if ref is not None and r is not ref:
                n = min(len(r["losses"]), len(ref["losses"]))
                rel = [(a - b) / b for a, b in zip(running(r["losses"][:n]), running(ref["losses"][:n]))]
                axes[1][col].plot([100 * x for x in rel], label=r["arm"], color=colours[r["arm"]])
        axes[0][col].set(title=f"{size}: training loss (mean of {smooth} steps)", xlabel="step", ylabel="loss")
        axes[1][col].set(title=f"{size}: FP8 vs bf16", xlabel="step", ylabel="loss difference, %")
        axes[1][col].axhline(0, color="gray", lw=0.5)
        for bound in (-100 * TOLERANCE, 100 * TOLERANCE):
            axes[1][col].axhline(bound, color="gray", lw=0.5, ls="--")
        for ax in (axes[0][col], axes[1][col]):
            ax.legend()
    fig.tight_layout()
    path = os.path.join(folder, "fp8_parity.png")
    fig.savefig(path, dpi=100)
    return path


def drive(args):
    """Every (size, arm) in its own process, one after another; then the table over the folder's results."""
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}))
    for size in args.sizes.split(","):
        for arm in args.arms.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", "--size", size, "--out", args.out]
            # an FP8 arm is a recipe, "+output" for the output layer in FP8 too (fp8_output_layer)
            recipe, _, extra = arm.partition("+")
            cmd += ["--precision", "bf16"] if arm == "bf16" else ["--precision", "fp8", "--fp8_recipe", recipe]
            cmd += ["--fp8_output_layer"] if extra == "output" else []
            for key in ("fp8", "mode", "device", "train_file", "vocab", "seq", "global_batch", "num_micro", "steps",
                        "seed", "compile_mode"):
                cmd += [f"--{key}", str(getattr(args, key))]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if proc.returncode or "RESULT " not in proc.stdout:
                print(f"{size} {arm}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
            else:
                print(proc.stdout.strip().splitlines()[-1], flush=True)
    print("\n" + table(load_results(args.out)), flush=True)


def parser():
    p = dense_parser(__doc__.splitlines()[0])
    p.set_defaults(mode="megatron_compile", seq=512, global_batch=8, num_micro=1, steps=300, warmup=0,
                   fp8="hybrid", sizes="350m,llama-1b")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="driver: bf16 and FP8 recipes (tensorwise, delayed, rowwise; RECIPE+output: the output layer too)")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="one arm (--one)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the script's logic (bf16 only; use --size tiny)")
    p.add_argument("--train_file", default=CORPUS)
    p.add_argument("--vocab", type=int, default=8192, help="the BPE tokenizer's size, and so the model's vocabulary")
    p.add_argument("--seed", type=int, default=1234, help="initial weights and the data order")
    p.add_argument("--out", default="fp8_parity", help="folder of the arms' JSONs and the tokenized data's cache")
    p.add_argument("--table", default="", help="print the table of this folder's JSONs and run nothing")
    p.add_argument("--plot", default="", help="write this folder's fp8_parity.png from its JSONs and run nothing")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per arm")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.plot:
        print(plot(args.plot))
    elif args.table:
        print(table(load_results(args.table)))
    elif args.one:
        if args.precision == "fp8" and not args.fp8:
            raise SystemExit("--precision fp8 needs --fp8 e4m3|hybrid")
        run_arm(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
