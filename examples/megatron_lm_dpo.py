"""DPO on Megatron-Core through accelerate: preference pairs (a prompt, a chosen and a rejected answer), the
reference model's log-probabilities computed once before training, and the DPO loss (`DPOTrainStep`).

By default it needs no network: it writes a small preference set ("Q: 3 8 =": the larger digit is chosen,
the smaller one rejected), builds a character tokenizer and a tiny Llama, and reports the preference
accuracy (how often the model gives the chosen answer the higher probability) on held-out pairs before
and after, and the training metrics (loss, reward accuracy, rewards) as they move. With `--model_name_or_path` (a local HF causal LM) and
`--train_file` (JSON lines with "prompt", "chosen", "rejected") the same script trains a real model. With
`--lora_r`, LoRA through peft: only the adapters train, the reference log-probs are the base model's
(`with model.disable_adapter():`), and `--output_dir` gets the PEFT adapter folder.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_dpo.py
"""

import argparse
import contextlib
import json
import os
import random
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from megatron_lm_llama_sft import causal_lm  # noqa: E402
from peft_lora import add_lora_args, with_lora  # noqa: E402
from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from train_steps import DPOTrainStep  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None, help="a local HF causal LM; default: a new tiny Llama")
    p.add_argument("--train_file", default=None, help="JSON lines {'prompt', 'chosen', 'rejected'}; default: arithmetic")
    p.add_argument("--num_pairs", type=int, default=2048)
    p.add_argument("--eval_pairs", type=int, default=128)
    p.add_argument("--max_length", type=int, default=16)
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--output_dir", default=None, help="save the trained model here (HF format)")
    p.add_argument("--seed", type=int, default=0)
    add_lora_args(p)
    return p.parse_args(argv)


def larger_digit_preferences(n, seed):
    """Prompt "Q: 3 8 =": answering the larger digit is chosen, the smaller one rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.sample(range(10), 2)
        out.append({"prompt": f"Q: {a} {b} =", "chosen": f" {max(a, b)}", "rejected": f" {min(a, b)}"})
    return out


def encode_side(prompt, answer, tokenizer, max_length):
    """input_ids, attention_mask, labels (-100 on the prompt and padding) of prompt + answer + eos."""
    p = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (p + a)[:max_length]
    pad = max_length - len(ids)
    labels = [-100] * min(len(p), max_length) + ids[len(p):] + [-100] * pad
    return torch.tensor(ids + [tokenizer.pad_token_id] * pad), torch.tensor([1] * len(ids) + [0] * pad), torch.tensor(labels)


def encode(pair, tokenizer, max_length):
    row = {}
    for side in ("chosen", "rejected"):
        ids, mask, labels = encode_side(pair["prompt"], pair[side], tokenizer, max_length)
        row.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return row


def sequence_log_probs(model, batch, side):
    """Summed log p of the labelled tokens of one side (a forward pass, no gradients, vocab-parallel)."""
    lp = model.compute_log_probs({k: batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")})
    return lp.sum(-1)


def with_reference(model, loader, lora=False):
    """The batches with the reference model's log-probs: the model as it is now, before training; with LoRA
    the base model (adapters switched off: peft's `disable_adapter()`, as TRL's DPO takes its reference)."""
    out = []
    for batch in loader:
        batch = dict(batch)
        with model.disable_adapter() if lora else contextlib.nullcontext():
            for side in ("chosen", "rejected"):
                batch[f"ref_{side}_logps"] = sequence_log_probs(model, batch, side)
        out.append(batch)
    return out


def preference_accuracy(model, batches):
    """How often the model gives the chosen answer a higher probability than the rejected one. (The
    training metric 'reward accuracy' compares the implicit rewards, log p - log p_ref, instead.)"""
    right = total = 0
    for batch in batches:
        chosen = sequence_log_probs(model, batch, "chosen")
        rejected = sequence_log_probs(model, batch, "rejected")
        right += int((chosen > rejected).sum())
        total += chosen.numel()
    return right / total


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    plugin = accelerator.state.megatron_lm_plugin
    plugin.custom_train_step_class = DPOTrainStep
    plugin.custom_train_step_kwargs = {"beta": args.beta}
    set_seed(args.seed)

    if args.train_file:
        with open(args.train_file) as f:
            pairs = [json.loads(line) for line in f if line.strip()]
    else:
        pairs = larger_digit_preferences(args.num_pairs + args.eval_pairs, args.seed)
    train_pairs, eval_pairs = pairs[: -args.eval_pairs], pairs[-args.eval_pairs:]
    tokenizer, model = causal_lm(args.model_name_or_path, accelerator,
                                 os.path.join(args.output_dir or "outputs", "dpo_tokenizer"), max_positions=args.max_length)

    bs = args.per_device_train_batch_size
    train_loader = DataLoader([encode(p, tokenizer, args.max_length) for p in train_pairs], batch_size=bs,
                              shuffle=True, drop_last=True)
    eval_loader = DataLoader([encode(p, tokenizer, args.max_length) for p in eval_pairs], batch_size=bs, drop_last=True)
    model = with_lora(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    dp = accelerator.num_processes // (plugin.tp_degree * plugin.pp_degree)
    steps = args.num_train_epochs * (len(train_pairs) // (bs * plugin.num_micro_batches * dp))
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=steps, warmup_num_steps=min(10, steps // 10))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    # the reference is the model before training: score every pair once (no second model in memory)
    train_batches = with_reference(model, train_loader, lora=bool(args.lora_r))
    eval_batches = with_reference(model, eval_loader, lora=bool(args.lora_r))
    before = preference_accuracy(model, eval_batches)
    accelerator.print(f"held-out preference accuracy before training: {before:.1%}")
    step = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        order = torch.randperm(len(train_batches), generator=torch.Generator().manual_seed(epoch)).tolist()
        for i in order:
            out = model(**train_batches[i])
            accelerator.backward(out.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if args.log_every and step % args.log_every == 0:
                accelerator.print(f"step {step}: " + "  ".join(f"{k} {v.item():.4f}" for k, v in out.metrics.items()))
        accuracy = preference_accuracy(model, eval_batches)
        accelerator.print(f"epoch {epoch}: held-out preference accuracy {accuracy:.1%}")
    accelerator.print(f"held-out preference accuracy: {before:.1%} before, {accuracy:.1%} after")
    if args.output_dir:
        accelerator.save_model(model, os.path.join(args.output_dir, "model"))
        accelerator.print(f"model written to {os.path.join(args.output_dir, 'model')}")


if __name__ == "__main__":
    main()
