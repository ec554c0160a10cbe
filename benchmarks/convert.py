"""Wall time and peak host memory (RSS) of checkpoint conversion on a GPT-2 1.5B-sized random model.

    python benchmarks/convert.py --workdir /tmp/convert_bench

Writes a random GPT-2 XL-shaped HF checkpoint (fp32, 2 GB safetensors shards) tensor by tensor, then
times each conversion in a fresh process and reads that process's peak RSS.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_checkpoint(path, n_layer=48, n_embd=1600, n_head=25, shard_bytes=2 * 10**9):
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT2LMHeadModel(cfg).state_dict().items() if k != "lm_head.weight"}
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    weight_map, total, current, size = {}, 0, {}, 0

    def flush():
        nonlocal current, size
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(current, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(current, file))
        current, size = {}, 0

    for name, shape in shapes.items():  # one shard in memory at a time
        t = torch.randn(shape, generator=g) * 0.02
        if current and size + t.numel() * 4 > shard_bytes:
            flush()
        current[name] = t
        size += t.numel() * 4
        total += t.numel() * 4
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, max(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))


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
