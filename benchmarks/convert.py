"""Wall time and peak host memory (RSS) of checkpoint conversion on a GPT-2 1.5B-sized random model.

    python benchmarks/convert.py --workdir /tmp/convert_bench

Writes a random GPT-2 XL-shaped HF checkpoint (fp32, 2 GB safetensors shards) tensor by tensor, then
times each conversion in a fresh process and reads that process's peak RSS.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoint import write_random_checkpoint  # noqa: E402


def make_checkpoint(path, n_layer=48, n_embd=1600, n_head=25, shard_bytes=2 * 10**9):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    return write_random_checkpoint(path, GPT2LMHeadModel, cfg, shard_bytes, skip=("lm_head.weight",))


CHILD = """
import resource, sys, time
sys.path.insert(0, {root!r})
from checkpoint_utils.convert import main
t = time.perf_counter()
rc = main({argv!r})
print("RESULT", rc, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def timed(argv):
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, argv=argv)], capture_output=True, text=True)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
    if not line:
        raise RuntimeError(out.stderr[-3000:])
    _, rc, wall, rss = line[-1].split()
    assert rc == "0", out.stderr[-3000:]
    return float(wall), int(rss)


def folder_stats(path):
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".safetensors")]
    return sum(map(os.path.getsize, files)), max(map(os.path.getsize, files))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--tp", type=int, default=5, help="GPT-2 XL has 25 heads")
    p.add_argument("--pp", type=int, default=2)
    a = p.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    hf, mg, back = (os.path.join(a.workdir, n) for n in ("hf", "megatron", "hf_back"))
    t = time.perf_counter()
    make_checkpoint(hf)
    print(f"made the random checkpoint in {time.perf_counter() - t:.0f}s", flush=True)
    rows = []
    for label, argv, src, dst in [
        (f"HF -> Megatron TP={a.tp} PP={a.pp}", ["--no_progress", "--load_path", hf, "--save_path", mg,
         "--target_tensor_model_parallel_size", str(a.tp), "--target_pipeline_model_parallel_size", str(a.pp)], hf, mg),
        ("Megatron -> HF (2GB shards)", ["--no_progress", "--convert_checkpoint_from_megatron_to_transformers",
         "--load_path", mg, "--save_path", back, "--max_shard_size", "2GB"], mg, back),
    ]:
        wall, rss = timed(argv)
        total, largest_in = folder_stats(src)
        _, largest_out = folder_stats(dst)
        rows.append((label, wall, rss, total, largest_in, largest_out))
        print(rows[-1], flush=True)
    print("\n| conversion | wall s | peak RSS GiB | model GiB | largest input shard GiB | largest output shard GiB |")
    print("|---|---|---|---|---|---|")
    for label, wall, rss, total, li, lo in rows:
        print(f"| {label} | {wall:.1f} | {rss / 2**30:.2f} | {total / 2**30:.2f} | {li / 2**30:.2f} | {lo / 2**30:.2f} |")
    shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
