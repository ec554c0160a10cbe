"""Supervised fine-tuning of a mixture-of-experts model (Qwen2-MoE, Qwen3-MoE, Mixtral) with expert
parallelism on Megatron-Core through accelerate: each rank holds its share of the experts and the
tokens travel to them; the loss counts response tokens only, plus HF's load-balancing loss.

By default it needs no network: it writes the small arithmetic instruction set of
`megatron_lm_llama_sft.py`, builds a character tokenizer and a tiny Qwen2-MoE (8 experts, top-2, a
shared expert with its gate, one dense layer) from scratch, and fine-tunes it with
expert_model_parallel_size=2 on two CPU processes in a few minutes. It prints the language-model loss and
the load-balancing loss apart, how many tokens each expert of each layer received, and the exact-match
accuracy of greedy answers before and after. With `--model_name_or_path` (a local HF MoE folder) and
`--train_file` the same script fine-tunes a real checkpoint, on GPU with a GPU config.

    accelerate launch --config_file examples/configs/cpu_ep2.yaml examples/megatron_lm_moe_sft.py --output_dir outputs/moe_sft
"""

import argparse
import json
import math
import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig  # noqa: E402

from megatron_lm_llama_sft import accuracy, arithmetic_pairs, char_tokenizer, encode  # noqa: E402
from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None, help="a local HF MoE folder; default: a new tiny Qwen2-MoE")
    p.add_argument("--train_file", default=None, help="JSON lines {'prompt': ..., 'response': ...}; default: arithmetic")
    p.add_argument("--num_examples", type=int, default=3000, help="size of the generated instruction set")
    p.add_argument("--max_length", type=int, default=32)
    p.add_argument("--per_device_train_batch_size", type=int, default=16, help="the micro-batch size")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=20)
    p.add_argument("--router_aux_loss_coef", type=float, default=0.01,
                   help="weight of HF's load-balancing loss (the new model's output_router_logits is on)")
    p.add_argument("--eval_questions", type=int, default=64)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def moe_lm(args, accelerator, tokenizer_dir):
    """(tokenizer, model): a local HF MoE causal LM, or a new tiny Qwen2-MoE with a character tokenizer
    built here (no network). The new model's last layer is dense (`mlp_only_layers`), as some Qwen2-MoE
    checkpoints have, and its load-balancing loss is on, as HF trains MoE models."""
    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return tokenizer, AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    with accelerator.main_process_first():
        tokenizer = char_tokenizer(tokenizer_dir)
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1,
        output_router_logits=True, router_aux_loss_coef=args.router_aux_loss_coef,
        max_position_embeddings=args.max_length, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    return tokenizer, AutoModelForCausalLM.from_config(config)


def expert_load_table(metrics):
    """Tokens each expert received in the last step (over the global batch), a row per MoE layer."""
    rows = sorted((int(k.rsplit(" ", 1)[1]), v) for k, v in metrics.items() if k.startswith("tokens per expert/layer "))
    if not rows:
        return ""
    lines = [f"  layer {n}: " + " ".join(f"{int(x):4d}" for x in load.tolist()) for n, load in rows]
    return "tokens per expert in the last step:\n" + "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)
    if args.output_dir:
        check_writable(args.output_dir, "--output_dir")
        if accelerator.is_main_process:
            os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    if args.train_file:
        with open(args.train_file) as f:
            pairs = [json.loads(line) for line in f if line.strip()]
    else:
        pairs = arithmetic_pairs(args.num_examples + args.eval_questions, args.seed)
    train_pairs, eval_pairs = pairs[: -args.eval_questions], pairs[-args.eval_questions:]

    tokenizer, model = moe_lm(args, accelerator, os.path.join(args.output_dir or "outputs", "tokenizer"))
    tokenizer.padding_side = "left"  # prompts for generation; training rows are right-padded by `encode`
    train = [encode(p, tokenizer, args.max_length) for p in train_pairs]
    train_dataloader = DataLoader(train, shuffle=True, batch_size=args.per_device_train_batch_size, drop_last=True)
    eval_dataloader = DataLoader([encode(p, tokenizer, args.max_length) for p in eval_pairs],
                                 batch_size=args.per_device_train_batch_size, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    plugin = accelerator.state.megatron_lm_plugin
    # expert parallelism splits the experts, not the batch: the data-parallel size is that of the dense part
    dp = accelerator.num_processes // (plugin.tp_degree * plugin.pp_degree)
    steps_per_epoch = len(train) // (args.per_device_train_batch_size * plugin.num_micro_batches * dp)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=args.max_train_steps,
                                         warmup_num_steps=args.num_warmup_steps)
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)

    model.eval()
    before = accuracy(model, tokenizer, eval_pairs, accelerator)
    accelerator.print(f"exact-match accuracy before fine-tuning: {before:.1%}")
    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    step = 0
    for epoch in range(math.ceil(args.max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)
        for batch in train_dataloader:
            loss = model(**batch).loss  # response-token LM loss + coef * load-balancing loss, averaged over DP
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            progress.update(1)
            if args.log_every and step % args.log_every == 0:
                m = model.metrics
                accelerator.print(f"step {step} lm loss {m['lm loss'].item():.4f} load-balancing loss "
                                  f"{m['load_balancing_loss'].item():.4f}" if "load_balancing_loss" in m
                                  else f"step {step} loss {loss.item():.4f}")
            if step >= args.max_train_steps:
                break
        model.eval()
        with torch.no_grad():
            losses = [model(**batch).loss.item() for batch in eval_dataloader]
        accelerator.print(f"epoch {epoch}: eval loss {sum(losses) / len(losses):.4f}")
        if step >= args.max_train_steps:
            break
    accelerator.print(expert_load_table(model.metrics))
    model.eval()
    after = accuracy(model, tokenizer, eval_pairs, accelerator)
    accelerator.print(f"exact-match accuracy after fine-tuning: {after:.1%} (before: {before:.1%})")
    if args.output_dir:
        saved = accelerator.save_state(os.path.join(args.output_dir, "final"))
        accelerator.print(f"checkpoint written to {saved}")
        accelerator.save_model(model, os.path.join(args.output_dir, "hf"))
        accelerator.print(f"HF weights written to {os.path.join(args.output_dir, 'hf')}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
