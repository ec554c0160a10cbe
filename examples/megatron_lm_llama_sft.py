"""Supervised fine-tuning of a Llama-family model on prompt/response pairs, on Megatron-Core through
accelerate: the loss counts response tokens only (labels are -100 on the prompt and the padding).

By default it needs no network: it writes a small arithmetic instruction set, builds a tokenizer and a
tiny Llama from scratch, fine-tunes it, and reports the exact-match accuracy of greedy answers on
held-out questions before and after. With `--model_name_or_path` (a local HF folder: Llama, Mistral,
Qwen2, Qwen3) and `--train_file` (JSON lines with "prompt" and "response") the same script fine-tunes
a real checkpoint, on GPU with a GPU config.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_llama_sft.py --output_dir outputs/sft
"""

import argparse
import json
import math
import os
import random

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate.utils import DistributedType, set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None, help="a local HF folder; default: a new tiny Llama")
    p.add_argument("--train_file", default=None, help="JSON lines {'prompt': ..., 'response': ...}; default: arithmetic")
    p.add_argument("--num_examples", type=int, default=4000, help="size of the generated instruction set")
    p.add_argument("--max_length", type=int, default=32)
    p.add_argument("--per_device_train_batch_size", type=int, default=16, help="the micro-batch size")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=20)
    p.add_argument("--eval_questions", type=int, default=64)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def arithmetic_pairs(n, seed):
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        pairs.append({"prompt": f"Q: {a} + {b} =", "response": f" {a + b}\n"})
    return pairs


def char_tokenizer(save_dir):
    """A character-level tokenizer built here (no download): digits, the few symbols the task uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = list("0123456789+=QA: \n")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # characters back into text without spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(save_dir)
    return fast


def causal_lm(model_name_or_path, accelerator, tokenizer_dir, max_positions, hidden_size=64):
    """(tokenizer, model): a local HF causal LM, or a new tiny Llama (2 layers, GQA 4/2 heads, tied
    embeddings) with a character tokenizer built here, so the examples run without network."""
    if model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return tokenizer, AutoModelForCausalLM.from_pretrained(model_name_or_path)
    with accelerator.main_process_first():
        tokenizer = char_tokenizer(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    return tokenizer, AutoModelForCausalLM.from_config(config)


def encode(pair, tokenizer, max_length):
    """input_ids, attention_mask and labels (-100 on prompt and padding), right-padded to max_length."""
    prompt = tokenizer(pair["prompt"], add_special_tokens=False)["input_ids"]
    response = tokenizer(pair["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = ([tokenizer.bos_token_id] + prompt + response)[:max_length]
    n_prompt = min(1 + len(prompt), max_length)
    pad = max_length - len(ids)
    labels = [-100] * n_prompt + ids[n_prompt:] + [-100] * pad
    return {
        "input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
        "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
        "labels": torch.tensor(labels),
    }


def accuracy(model, tokenizer, pairs, accelerator):
    """Exact match of greedy answers (megatron_generate, TP/PP-parallel)."""
    prompts = [tokenizer.bos_token + p["prompt"] for p in pairs]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        out = model.megatron_generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=6,
                                      stop_token=tokenizer.eos_token_id)
    else:
        out = accelerator.unwrap_model(model).generate(**enc.to(accelerator.device), max_new_tokens=6, do_sample=False)
    right = 0
    for row, pair in zip(out.tolist(), pairs):
        text = tokenizer.decode(row, skip_special_tokens=True)
        right += text.split("=", 1)[-1].strip() == pair["response"].strip()
    return right / len(pairs)


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

    tokenizer, model = causal_lm(args.model_name_or_path, accelerator, os.path.join(args.output_dir or "outputs", "tokenizer"),
                                 max_positions=args.max_length, hidden_size=128)
    tokenizer.padding_side = "left"  # prompts for generation; training rows are right-padded by `encode`

    train = [encode(p, tokenizer, args.max_length) for p in train_pairs]
    train_dataloader = DataLoader(train, shuffle=True, batch_size=args.per_device_train_batch_size, drop_last=True)
    eval_dataloader = DataLoader([encode(p, tokenizer, args.max_length) for p in eval_pairs],
                                 batch_size=args.per_device_train_batch_size, drop_last=True)
    no_decay = ("bias", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    plugin = accelerator.state.megatron_lm_plugin
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
            loss = model(**batch).loss  # mean over response tokens, averaged over data-parallel ranks
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            progress.update(1)
            if args.log_every and step % args.log_every == 0:
                accelerator.print(f"step {step} response loss {loss.item():.4f}")
            if step >= args.max_train_steps:
                break
        model.eval()
        with torch.no_grad():
            losses = [model(**batch).loss.item() for batch in eval_dataloader]
        accelerator.print(f"epoch {epoch}: eval response loss {sum(losses) / len(losses):.4f}")
        if step >= args.max_train_steps:
            break
    model.eval()
    after = accuracy(model, tokenizer, eval_pairs, accelerator)
    accelerator.print(f"exact-match accuracy after fine-tuning: {after:.1%} (before: {before:.1%})")
    if args.output_dir:
        saved = accelerator.save_state(os.path.join(args.output_dir, "final"))
        accelerator.print(f"checkpoint written to {saved}")


if __name__ == "__main__":
    main()
