"""Text generation with `model.megatron_generate`, as in the Megatron-LM guide: top-p and top-k sampling,
a BOS token in front, greedy decoding and beam search, on the tensor/pipeline-parallel model.

Without `--model_name_or_path` it needs no network: it builds a tokenizer and a small GPT-2 from the
shipped corpus and trains it for a few hundred steps first, so the continuations are the corpus's kind
of English rather than noise.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_gpt2_generation.py
"""

import argparse
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel  # noqa: E402

from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", default=None, help="a local HF GPT-2/Llama folder; default: train one here")
    p.add_argument("--train_file", default=os.path.join(HERE, "data", "corpus.txt"))
    p.add_argument("--train_steps", type=int, default=400)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tiny_trained_model(args, accelerator):
    """A tokenizer and a small GPT-2 trained on the corpus for a few hundred steps (the returned engine)."""
    from megatron_lm_gpt_pretraining import build_tokenizer

    tok_dir = os.path.join("outputs", "generation_tokenizer")
    with accelerator.main_process_first():
        tokenizer = build_tokenizer(args.train_file, 2048, tok_dir)
    with open(args.train_file) as f:
        ids = tokenizer(f.read())["input_ids"]
    n = len(ids) // args.block_size
    blocks = torch.tensor(ids[: n * args.block_size]).view(n, args.block_size)
    data = [{"input_ids": b, "labels": b} for b in blocks]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=args.block_size + args.max_new_tokens + 8,
                                       n_embd=128, n_layer=2, n_head=4, bos_token_id=tokenizer.eos_token_id,
                                       eos_token_id=tokenizer.eos_token_id))
    return tokenizer, model, DataLoader(data, batch_size=8, shuffle=True, drop_last=True)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)
    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
        ids = tokenizer("Hello", return_tensors="pt")["input_ids"]
        loader = DataLoader([{"input_ids": ids[0], "labels": ids[0]}], batch_size=1)
        steps = 0
    else:
        tokenizer, model, loader = tiny_trained_model(args, accelerator)
        steps = args.train_steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=max(steps, 1), warmup_num_steps=min(20, steps // 2))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    done = 0
    while done < steps:
        for batch in loader:
            loss = model(**batch).loss
            done += 1
            if done % 100 == 0:
                accelerator.print(f"step {done} loss {loss.item():.3f}")
            if done == steps:
                break

    # the guide's calls, unchanged but for the import lines
    model.eval()
    tokenizer.pad_token = tokenizer.eos_token
    max_new_tokens = args.max_new_tokens
    batch_texts = ["This module provides", "Return a", "If the file is", "The default value of"]
    batch_encodings = tokenizer(batch_texts, return_tensors="pt", padding=True)
    runs = {
        "top-p sampling": dict(top_p=0.8, top_p_decay=0.5, temperature=0.9),
        "top-k sampling": dict(top_k=50, temperature=0.9),
        "greedy, with a BOS token in front": dict(add_BOS=True),
    }
    for title, kwargs in runs.items():
        generated_tokens = model.megatron_generate(
            batch_encodings["input_ids"], batch_encodings["attention_mask"], max_new_tokens=max_new_tokens, **kwargs)
        decoded_preds = tokenizer.batch_decode(generated_tokens.cpu().numpy(), skip_special_tokens=True)
        accelerator.print(f"== {title}")
        for text in decoded_preds:
            accelerator.print(f"   {text!r}")
    # beam search takes a single prompt
    batch_encodings = tokenizer(["This module provides"], return_tensors="pt", padding=True)
    generated_tokens = model.megatron_generate(
        batch_encodings["input_ids"], batch_encodings["attention_mask"], max_new_tokens=max_new_tokens, num_beams=4,
        length_penalty=1.5)
    accelerator.print("== beam search (4 beams)")
    accelerator.print(f"   {tokenizer.batch_decode(generated_tokens.cpu().numpy(), skip_special_tokens=True)[0]!r}")


if __name__ == "__main__":
    main()
