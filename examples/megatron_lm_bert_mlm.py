"""Masked-language-model training of BERT on Megatron-Core through accelerate.

This is transformers' `run_mlm_no_trainer.py`, cut down and changed as for the GPT example: a
`MegatronLMDummyScheduler`, losses already averaged over data-parallel ranks, `accelerator.save_state`.
`prepare` picks `BertTrainStep` from the model type. It trains on the shipped corpus with a WordPiece
tokenizer built from it, so it needs no network; `--model_type megatron-bert` trains the pre-LN variant,
`--next_sentence` adds the next-sentence head (BertForPreTraining).

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_bert_mlm.py --output_dir outputs/bert
"""

import argparse
import math
import os
import random

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
)

from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_file", default=os.path.join(HERE, "data", "corpus.txt"))
    p.add_argument("--model_type", default="bert", choices=("bert", "megatron-bert"))
    p.add_argument("--next_sentence", action="store_true", help="also train the next-sentence head")
    p.add_argument("--max_seq_length", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=16, help="the micro-batch size")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=20)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_tokenizer(train_file, save_dir):
    from tokenizers import BertWordPieceTokenizer

    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train([train_file], vocab_size=3000, min_frequency=2, show_progress=False)
    os.makedirs(save_dir, exist_ok=True)
    wp.save_model(save_dir)
    return BertTokenizerFast(os.path.join(save_dir, "vocab.txt"), do_lower_case=True)


def sentence_pairs(lines, tokenizer, max_len, rng, next_sentence):
    """Two halves of a paragraph, or (when next_sentence) half of the time the second half of another."""
    examples = []
    for i, line in enumerate(lines):
        words = line.split()
        if len(words) < 8:
            continue
        cut = len(words) // 2
        a, b, label = " ".join(words[:cut]), " ".join(words[cut:]), 0
        if next_sentence and rng.random() < 0.5:
            other = lines[rng.randrange(len(lines))].split()
            b, label = " ".join(other[len(other) // 2:]) or b, 1
        enc = tokenizer(a, b, truncation=True, max_length=max_len, padding="max_length")
        if next_sentence:
            enc["next_sentence_label"] = label
        examples.append(dict(enc))
    return examples


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)
    if args.output_dir:
        check_writable(args.output_dir, "--output_dir")
    tok_dir = os.path.join(args.output_dir or "outputs", "bert_tokenizer")
    with accelerator.main_process_first():
        tokenizer = build_tokenizer(args.train_file, tok_dir)
    with open(args.train_file) as f:
        lines = [line.strip() for line in f if line.strip()]
    rng = random.Random(args.seed)
    examples = sentence_pairs(lines, tokenizer, args.max_seq_length, rng, args.next_sentence)
    rng.shuffle(examples)
    split = len(examples) // 20
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, return_tensors="pt")
    train_dataloader = DataLoader(examples[split:], shuffle=True, collate_fn=collator,
                                  batch_size=args.per_device_train_batch_size, drop_last=True)
    eval_dataloader = DataLoader(examples[:split], collate_fn=collator, batch_size=args.per_device_train_batch_size,
                                 drop_last=True)

    config = AutoConfig.for_model(args.model_type, vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=512,
                                  max_position_embeddings=args.max_seq_length, pad_token_id=tokenizer.pad_token_id)
    auto = AutoModelForPreTraining if args.next_sentence else AutoModelForMaskedLM
    model = auto.from_config(config)
    no_decay = ("bias", "LayerNorm.weight", "ln.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    plugin = accelerator.state.megatron_lm_plugin
    dp = accelerator.num_processes // (plugin.tp_degree * plugin.pp_degree)
    steps_per_epoch = len(train_dataloader) // (plugin.num_micro_batches * dp)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=args.max_train_steps,
                                         warmup_num_steps=args.num_warmup_steps)
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)

    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    step = 0
    for epoch in range(math.ceil(args.max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)
        for batch in train_dataloader:
            loss = model(**batch).loss  # MLM (+ next-sentence) loss, averaged over data-parallel ranks
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            progress.update(1)
            if args.log_every and step % args.log_every == 0:
                accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step >= args.max_train_steps:
                break
        model.eval()
        with torch.no_grad():
            losses = [model(**batch).loss.item() for batch in eval_dataloader]
        eval_loss = sum(losses) / len(losses)
        accelerator.print(f"epoch {epoch}: eval loss {eval_loss:.4f} perplexity {math.exp(eval_loss):.1f}")
        if step >= args.max_train_steps:
            break
    if args.output_dir:
        saved = accelerator.save_state(os.path.join(args.output_dir, "final"))
        accelerator.print(f"checkpoint written to {saved}")


if __name__ == "__main__":
    main()
