"""Peak host memory (RSS) per rank of `accelerator.prepare` under TP=2 on CPU: a model built whole on
every process (from_pretrained) vs a model without weights (meta device) whose ranks read their slices.

    python benchmarks/prepare_memory.py --workdir /tmp/prepare_bench          # ~1.1B-parameter Llama shape

Writes a random Llama-shaped HF checkpoint (fp32, 1 GB safetensors shards) once, tensor by tensor, then
launches 2 processes per mode (torchrun, gloo) and prints, per rank: RSS after imports (the baseline),
peak RSS after prepare, the size of the rank's Megatron shard, and peak / (shard + baseline).
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoint import has_checkpoint, write_random_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)


def make_checkpoint(path, shard_bytes=10**9):
    from transformers import LlamaConfig, LlamaForCausalLM

    if not has_checkpoint(path):
        write_random_checkpoint(path, LlamaForCausalLM, LlamaConfig(**SHAPE), shard_bytes)


def rss():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path, mode):
    import torch

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.engine.distributed import init_process_group

    init_process_group()
    import transformers  # noqa: F401  (imports counted in the baseline)

    torch.set_num_threads(1)
    baseline = rss()
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if mode == "meta":
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ids = torch.randint(0, 100, (4, 16))
    loader = torch.utils.data.DataLoader([{"input_ids": x} for x in ids], batch_size=2)
    # SGD: no optimizer state (the point is the weights); Megatron's copy is built by prepare
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    engine, opt, loader, _ = acc.prepare(model, opt, loader, MegatronLMDummyScheduler(opt, total_num_steps=1))
    shard = sum(p.numel() * p.element_size() for p in engine.model.module.parameters())
    print("RESULT " + json.dumps({"mode": mode, "rank": int(os.environ["RANK"]), "baseline_gib": baseline / 2**30,
                                  "peak_gib": rss() / 2**30, "shard_gib": shard / 2**30,
                                  "ratio": rss() / (shard + baseline)}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/prepare_bench")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    path = os.path.join(args.workdir, "llama")
    make_checkpoint(path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("| mode | rank | baseline GiB | shard GiB | peak RSS GiB | peak / (shard + baseline) |")
    print("|---|---|---|---|---|---|")
    for mode in ("materialized", "meta"):
        proc = subprocess.run(["torchrun", "--nproc-per-node", "2", os.path.abspath(__file__), "--child", path, mode],
                              capture_output=True, text=True, env=env)
        rows = [json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not rows:
            print(f"{mode}: failed\n{proc.stderr[-3000:]}")
        for r in sorted(rows, key=lambda r: r["rank"]):
            print(f"| {r['mode']} | {r['rank']} | {r['baseline_gib']:.2f} | {r['shard_gib']:.2f} | {r['peak_gib']:.2f} | "
                  f"{r['ratio']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
