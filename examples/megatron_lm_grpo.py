"""GRPO on Megatron-Core through accelerate: sample a group of answers per prompt, score them, normalize the
rewards within each group, and update with the clipped policy-gradient loss (`PolicyGradientTrainStep`).

The loop is the one verl runs, written out: rollout -> reward -> advantages -> log-probs of the sampling
policy -> a few updates. Two rollout engines:
- `--rollout megatron` (default): the trained model samples itself with `model.megatron_generate`.
- `--rollout hf`: a separate HF model samples, as vLLM/SGLang do in verl: after each update the weights are
  streamed into it (`model.iter_hf_weights()`, one tensor at a time, HF names) and the Megatron model is
  offloaded to host memory while it generates (`accelerator.offload()` / `accelerator.reload()`).
With `--kl_coef`, a KL penalty to the initial policy, whose weights stay in host memory and are swapped in
for its log-probs (`accelerator.snapshot_weights()`, `accelerator.use_weights(...)`).
With `--lora_r`, LoRA through peft (`get_peft_model` before `prepare`): only the adapters train, the KL
reference is the base model itself (`with model.disable_adapter():`, no snapshot), `--rollout hf` gets the
weights with the adapters merged in (`model.iter_hf_weights(merge_lora=True)`), and `--output_dir` gets the
PEFT adapter folder.

By default it needs no network: a tiny Llama and a character tokenizer are built here, prompts are
"Q: 07 + 05 =", and the reward gives 0.5 for an answer of digits that ends (eos) and 1 more for the right
sum. The mean reward rises within a couple of minutes on 2 CPU cores. `--model_name_or_path` starts from a
local HF causal LM (e.g. the output of megatron_lm_llama_sft.py saved with save_model).

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_grpo.py
"""

import argparse
import os
import random
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megatron_lm_llama_sft import causal_lm  # noqa: E402
from peft_lora import add_lora_args, with_lora  # noqa: E402
from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from train_steps import PolicyGradientTrainStep  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None, help="a local HF causal LM; default: a new tiny Llama")
    p.add_argument("--rollout", choices=["megatron", "hf"], default="megatron")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--prompts_per_step", type=int, default=8, help="prompts per data-parallel rank and iteration")
    p.add_argument("--group_size", type=int, default=8, help="answers sampled per prompt")
    p.add_argument("--updates_per_rollout", type=int, default=2, help="mini-batch updates on each rollout")
    p.add_argument("--max_new_tokens", type=int, default=5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--clip_range", type=float, default=0.2)
    p.add_argument("--kl_coef", type=float, default=0.0,
                   help="k3 KL to the initial policy, whose weights are kept in host memory and swapped in")
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--output_dir", default=None, help="save the trained model here (HF format)")
    p.add_argument("--seed", type=int, default=0)
    add_lora_args(p)
    return p.parse_args(argv)


def prompts(n, seed):
    rng = random.Random(seed)
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]


def reward(text, a, b):
    """0.5 for an answer of digits that ended with eos, 1 more if it is the sum."""
    if text is None:  # no eos within max_new_tokens
        return 0.0
    answer = text.strip()
    if not answer.isdigit():
        return 0.0
    return 0.5 + (int(answer) == a + b)


def rollout_batch(samples, prompt_ids, tokenizer, pairs, args):
    """The training batch from sampled rows [P*G, prompt + new]: labels on the response (through eos),
    -100 on prompt and after eos; rewards and group-normalized advantages."""
    width = prompt_ids.shape[1]
    rows, rewards = [], []
    for row, (a, b) in zip(samples.tolist(), [p for p in pairs for _ in range(args.group_size)]):
        response = row[width:]
        end = response.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in response else None
        kept = response[:end] if end else response
        text = tokenizer.decode(kept[:-1]) if end else None
        rewards.append(reward(text, a, b))
        rows.append(row[:width] + kept)
    length = width + args.max_new_tokens
    ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width] = -100
    r = torch.tensor(rewards).view(-1, args.group_size)
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "advantages": advantages}, r.mean().item()


def push_weights(model, rollout_model, lora=False):
    """Stream the trained weights into the rollout engine, one full HF-named tensor at a time (with LoRA the
    adapters merged in: the rollout model is a plain HF model)."""
    target = rollout_model.state_dict()
    with torch.no_grad():
        for name, tensor in model.iter_hf_weights(merge_lora=lora):
            target[name].copy_(tensor)


def main(argv=None):
    args = parse_args(argv)
    plugin_kwargs = dict(clip_range=args.clip_range, temperature=args.temperature, kl_coef=args.kl_coef)
    accelerator = Accelerator()
    plugin = accelerator.state.megatron_lm_plugin
    plugin.custom_train_step_class = PolicyGradientTrainStep
    plugin.custom_train_step_kwargs = plugin_kwargs
    set_seed(args.seed)

    tokenizer, model = causal_lm(args.model_name_or_path, accelerator,
                                 os.path.join(args.output_dir or "outputs", "grpo_tokenizer"), max_positions=32)
    rollout_model = None
    if args.rollout == "hf":
        rollout_model = AutoModelForCausalLM.from_config(model.config).eval()
        rollout_model.load_state_dict(model.state_dict())
        rollout_model.to(accelerator.device)

    # every prompt has the same length ("Q: 07 + 05 ="), so no padding in the prompts
    pairs = prompts(args.iterations * args.prompts_per_step * 64, args.seed)
    loader = DataLoader(pairs, batch_size=args.prompts_per_step, shuffle=True, collate_fn=lambda rows: rows, drop_last=True)
    model = with_lora(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)
    steps = args.iterations * args.updates_per_rollout
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=steps, warmup_num_steps=0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    # the reference policy of the KL term: the initial weights, in host memory (no second model on the device)
    # (with LoRA the base model is the reference: adapters switched off, nothing copied)
    reference = accelerator.snapshot_weights() if args.kl_coef and not args.lora_r else None
    history = []
    for it, batch_pairs in enumerate(loader):
        if it == args.iterations:
            break
        text = [f"{tokenizer.bos_token}Q: {a:02d} + {b:02d} =" for a, b in batch_pairs]
        prompt_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        prompt_ids = prompt_ids.repeat_interleave(args.group_size, dim=0)
        # 1. rollout
        model.eval()
        if rollout_model is None:
            # top_p=1.0: sample from the whole distribution (the one compute_log_probs scores)
            samples = model.megatron_generate(prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                              top_p=1.0, stop_token=tokenizer.eos_token_id, random_seed=args.seed + it)
        else:
            accelerator.offload()  # parameters, gradients, optimizer state: host memory while the rollout runs
            with torch.no_grad():
                samples = rollout_model.generate(prompt_ids.to(accelerator.device), do_sample=True, temperature=args.temperature, top_k=0,
                                                 max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                                 eos_token_id=tokenizer.eos_token_id)
            accelerator.reload()
        # 2. rewards and advantages; 3. log-probs of the sampling policy
        batch, mean_reward = rollout_batch(samples.cpu(), prompt_ids, tokenizer, batch_pairs, args)
        batch["old_log_probs"] = model.compute_log_probs(batch, temperature=args.temperature)
        if args.kl_coef:
            with model.disable_adapter() if args.lora_r else accelerator.use_weights(reference):
                batch["ref_log_probs"] = model.compute_log_probs(batch, temperature=args.temperature)
        history.append(mean_reward)
        # 4. updates on mini-batches of the rollout: after the first, the ratio to the sampling policy moves
        model.train()
        rows = batch["input_ids"].shape[0]
        size = rows // args.updates_per_rollout
        metrics = {}
        for start in range(0, size * args.updates_per_rollout, size):
            out = model(**{k: v[start:start + size] for k, v in batch.items()})
            accelerator.backward(out.loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            metrics = out.metrics
        if rollout_model is not None:
            push_weights(model, rollout_model, lora=bool(args.lora_r))
        if args.log_every and (it + 1) % args.log_every == 0:
            recent = history[-args.log_every:]
            accelerator.print(f"iteration {it + 1}: mean reward {sum(recent) / len(recent):.3f}  "
                              + "  ".join(f"{k} {v.item():.4f}" for k, v in metrics.items()))
    n = max(1, len(history) // 5)
    first, last = sum(history[:n]) / n, sum(history[-n:]) / n
    accelerator.print(f"mean reward: first {n} iterations {first:.3f}, last {n} iterations {last:.3f}")
    if args.output_dir:
        accelerator.save_model(model, os.path.join(args.output_dir, "model"))
        accelerator.print(f"model written to {os.path.join(args.output_dir, 'model')}")


if __name__ == "__main__":
    main()
