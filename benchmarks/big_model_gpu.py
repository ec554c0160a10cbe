"""A Llama-2-7B-shaped checkpoint on 2 GPUs: prepare a model without weights under TP=2 (each rank reads its
slices of the bf16 safetensors), train 5 steps, save_model, and prepare the saved checkpoint again.

    python benchmarks/big_model_gpu.py --workdir /tmp/big            # on a machine with 2 GPUs

Prints per rank: seconds to prepare, peak host RSS, GPU memory, the step times, the save time, and
whether the reloaded weights equal the trained ones (a sample of tensors, bit for bit).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_checkpoint import has_checkpoint, write_random_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)


def make_checkpoint(path, shard_bytes=2 * 10**9):
    """Random bf16 weights, drawn on the GPU, written shard by shard."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not has_checkpoint(path):
        write_random_checkpoint(path, LlamaForCausalLM, LlamaConfig(**SHAPE, torch_dtype="bfloat16"), shard_bytes,
                                dtype=torch.bfloat16, device="cuda")


def rss_gib():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def prepare(path):
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    # the same tokens on every rank: TP ranks must see the same batch (prepare's batch check refuses otherwise)
    ids = torch.randint(0, 32000, (24, 1024), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": x} for x in ids], batch_size=2, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, sequence_parallelism=True,
                                                          num_micro_batches=2), mixed_precision="bf16")
    engine, opt, loader, _ = acc.prepare(model, opt, loader, MegatronLMDummyScheduler(opt, total_num_steps=10))
    return acc, engine, loader


SAMPLE = ("model.layers.0.self_attn.q_proj.weight", "model.layers.31.mlp.down_proj.weight", "lm_head.weight")


def child(mode, path, saved):
    import torch

    from megatron_plugin.engine.distributed import init_process_group

    init_process_group()
    rank = int(os.environ["RANK"])
    out = {"mode": mode, "rank": rank, "rss_after_imports_gib": rss_gib()}
    t = time.perf_counter()
    acc, engine, loader = prepare(path if mode == "train" else saved)
    torch.cuda.synchronize()
    out.update(prepare_s=round(time.perf_counter() - t, 1), rss_after_prepare_gib=round(rss_gib(), 2),
               gpu_after_prepare_gib=round(torch.cuda.memory_allocated() / 2**30, 2))
    sample_file = os.path.join(os.path.dirname(saved), f"sample{rank}.pt")
    if mode == "train":
        engine.train()
        steps = []
        for i, batch in enumerate(loader):
            t = time.perf_counter()
            loss = engine(**batch).loss.item()
            steps.append(round(time.perf_counter() - t, 2))
            if i == 4:
                break
        out.update(step_s=steps, loss=loss, gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        torch.save({n: t.cpu().clone() for n, t in engine.iter_hf_weights() if n in SAMPLE}, sample_file)
        t = time.perf_counter()
        acc.save_model(engine, saved, max_shard_size="5GB")
        out.update(save_s=round(time.perf_counter() - t, 1), rss_peak_gib=round(rss_gib(), 2))
    else:
        trained = torch.load(sample_file)
        again = {n: t.cpu() for n, t in engine.iter_hf_weights() if n in SAMPLE}
        out["reloaded_equal_trained"] = all(torch.equal(trained[n], again[n]) for n in SAMPLE)
    print("RESULT " + json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/big")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    path = os.path.join(args.workdir, "llama7b")
    t = time.perf_counter()
    make_checkpoint(path)
    print(f"checkpoint written in {time.perf_counter() - t:.0f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for mode in ("train", "reload"):
        proc = subprocess.run(["torchrun", "--nproc-per-node", "2", os.path.abspath(__file__), "--child", mode, path,
                               os.path.join(args.workdir, "saved")], capture_output=True, text=True, env=env)
        rows = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        for row in rows:
            print(row[7:], flush=True)
        if not rows:
            print(proc.stdout[-3000:], proc.stderr[-6000:], flush=True)


if __name__ == "__main__":
    sys.exit(main())
