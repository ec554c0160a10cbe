"""GPU memory of a GPT-2-medium-shaped model (~355M parameters) trained with the policy-gradient step in
bf16 (AdamW, fp32 master weights and states), before and after `accelerator.offload()`, and the time of
offload and reload; then training goes on and its losses are compared with a run without offload.

    python benchmarks/offload_gpu.py                 # one GPU
    python benchmarks/offload_gpu.py --gpus 2        # TP=2 (as --layout says) on two GPUs

Prints one RESULT line per rank (JSON): allocated GiB after a step, after offload, after reload, bytes
moved per kind, seconds, whether the losses after reload equal those of the run without offload, and
the extra device memory while `model.iter_hf_weights()` streams every weight out (vs the largest tensor).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257)
SEQ, MICRO, STEPS = 512, 4, 4


def batches(vocab, steps, rows):
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
        labels = ids.clone()
        labels[:, : SEQ // 4] = -100  # the prompt
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                    "advantages": torch.randn(rows, generator=g)})
    return out


def run(offload, tp):
    import torch
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from train_steps import PolicyGradientTrainStep

    torch.manual_seed(0)
    res = {"allocated_before_prepare_gib": torch.cuda.memory_allocated() / 2**30}
    hf = GPT2LMHeadModel(GPT2Config(**SHAPE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    plugin = MegatronLMPlugin(tp_degree=tp, custom_train_step_class=PolicyGradientTrainStep,
                              custom_train_step_kwargs={"clip_range": 0.2}, use_distributed_optimizer=True)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)
    loader = DataLoader([{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * MICRO, batch_size=MICRO)
    model, opt, _ = acc.prepare(hf, opt, loader)
    del hf
    res.update(params=sum(p.numel() for p in model.parameters()) * tp, losses=[])
    gib = 2**30
    for step, batch in enumerate(batches(SHAPE["vocab_size"], STEPS, MICRO)):  # dp = 1
        batch["old_log_probs"] = model.compute_log_probs(batch)
        out = model(**batch)
        opt.step()
        opt.zero_grad()
        res["losses"].append(out.loss.item())
        if offload and step in (1, 2):  # the first offload pins host memory, later ones reuse it
            torch.cuda.synchronize()
            res["allocated_after_step_gib"] = torch.cuda.memory_allocated() / gib
            t = time.perf_counter()
            moved = acc.offload()
            res[f"offload_{step}_s"] = time.perf_counter() - t
            res["allocated_after_offload_gib"] = torch.cuda.memory_allocated() / gib
            res["reserved_after_offload_gib"] = torch.cuda.memory_reserved() / gib
            res["moved_gib"] = {k: v / gib for k, v in moved.items()}
            t = time.perf_counter()
            acc.reload()
            res[f"reload_{step}_s"] = time.perf_counter() - t
            res["allocated_after_reload_gib"] = torch.cuda.memory_allocated() / gib
    if offload:
        # weights streamed out one HF tensor at a time (as pushed into a rollout engine): the extra device
        # memory while streaming, against the largest tensor
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        largest = count = 0
        t = time.perf_counter()
        for name, tensor in model.iter_hf_weights():
            largest = max(largest, tensor.numel() * tensor.element_size())
            tensor.to("cpu")
            count += 1
        res["stream_s"] = time.perf_counter() - t
        res["stream_tensors"] = count
        res["stream_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        res["largest_tensor_mib"] = largest / 2**20
    return res


def child(tp):
    import torch

    from tests.spawn import _reset_process_state

    import gc

    parked = run(True, tp)
    _reset_process_state()
    gc.collect()
    torch.cuda.empty_cache()
    plain = run(False, tp)
    parked["losses_equal_without_offload"] = parked["losses"] == plain["losses"]
    print("RESULT " + json.dumps(dict(rank=int(os.environ.get("RANK", 0)), **parked)), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        return child(args.child)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["torchrun", "--nproc-per-node", str(args.gpus), os.path.abspath(__file__),
                           "--child", str(args.gpus)], capture_output=True, text=True, env=env)
    rows = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not rows:
        print(proc.stdout[-4000:], proc.stderr[-8000:])
        return 1
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
