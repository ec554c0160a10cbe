"""Sequence-to-sequence training of T5 on Megatron-Core through accelerate, with generation at the end.

This is transformers' `run_summarization_no_trainer.py`, cut down and changed as for the GPT example.
`prepare` picks `T5TrainStep` from the model type; decoder inputs are the labels shifted right, as HF
makes them. Without `--train_file` (JSON lines {"source": ..., "target": ...}) it needs no network: the
task is small sums written out ("sum: 12 + 7" -> "19") with a character tokenizer built here. After
training it generates answers for held-out sources with `model.megatron_generate` (encoder once,
cached decoder) and reports their exact-match rate before and after.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_t5_seq2seq.py --output_dir outputs/t5
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
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration  # noqa: E402

from megatron_plugin import Accelerator, MegatronLMDummyScheduler  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_file", default=None, help='JSON lines {"source": ..., "target": ...}; default: sums')
    p.add_argument("--num_examples", type=int, default=4000)
    p.add_argument("--max_source_length", type=int, default=16)
    p.add_argument("--per_device_train_batch_size", type=int, default=16, help="the micro-batch size")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=20)
    p.add_argument("--num_eval", type=int, default=64)
    p.add_argument("--tokenizer_name", default=None, help="a local tokenizer folder, with --train_file")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def char_tokenizer(save_dir):
    """Characters of the task, plus pad and eos (T5 decodes from pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("0123456789+sum: ")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(save_dir)
    return fast


def sums(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        out.append((f"sum: {a} + {b}", str(a + b)))
    return out


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)
    if args.output_dir:
        check_writable(args.output_dir, "--output_dir")
    if args.train_file:
        import json

        from transformers import AutoTokenizer

        with open(args.train_file) as f:
            pairs = [(r["source"], r["target"]) for r in map(json.loads, filter(str.strip, f))]
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    else:
        with accelerator.main_process_first():
            tokenizer = char_tokenizer(os.path.join(args.output_dir or "outputs", "t5_tokenizer"))
        pairs = sums(args.num_examples + args.num_eval, args.seed)
    eval_pairs, train_pairs = pairs[: args.num_eval], pairs[args.num_eval:]

    def encode(source, target):
        enc = tokenizer(source, truncation=True, max_length=args.max_source_length)
        enc["labels"] = tokenizer(target)["input_ids"] + [tokenizer.eos_token_id]
        return dict(enc)

    # pad every batch to fixed lengths: one shape for every micro-batch of a step
    collator = DataCollatorForSeq2Seq(tokenizer, padding="max_length", max_length=args.max_source_length)
    train = [encode(s, t) for s, t in train_pairs]
    longest = max(len(x["labels"]) for x in train)
    for x in train:  # targets padded with -100 to one length
        x["labels"] = x["labels"] + [-100] * (longest - len(x["labels"]))
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collator, batch_size=args.per_device_train_batch_size,
                                  drop_last=True)

    config = T5Config(vocab_size=len(tokenizer), d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=16, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    model = T5ForConditionalGeneration(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    plugin = accelerator.state.megatron_lm_plugin
    dp = accelerator.num_processes // (plugin.tp_degree * plugin.pp_degree)
    steps_per_epoch = len(train_dataloader) // (plugin.num_micro_batches * dp)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    scheduler = MegatronLMDummyScheduler(optimizer, total_num_steps=args.max_train_steps,
                                         warmup_num_steps=args.num_warmup_steps)
    model, optimizer, train_dataloader, scheduler = accelerator.prepare(model, optimizer, train_dataloader, scheduler)

    def exact_match():
        sources = tokenizer([s for s, _ in eval_pairs], return_tensors="pt", padding=True, truncation=True,
                            max_length=args.max_source_length)
        generated = model.megatron_generate(sources["input_ids"], sources["attention_mask"], max_new_tokens=8)
        texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
        return sum(t.strip() == target for t, (_, target) in zip(texts, eval_pairs)) / len(eval_pairs), texts

    model.eval()
    before, _ = exact_match()
    progress = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    step = 0
    for epoch in range(math.ceil(args.max_train_steps / steps_per_epoch)):
        model.train()
        train_dataloader.set_epoch(epoch)
        for batch in train_dataloader:
            loss = model(**batch).loss
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
        if step >= args.max_train_steps:
            break

    model.eval()
    after, texts = exact_match()
    for (source, target), text in list(zip(eval_pairs, texts))[:3]:
        accelerator.print(f"   {source!r} -> {text.strip()!r} (target {target!r})")
    accelerator.print(f"exact-match on {len(eval_pairs)} held-out sources: {after:.1%} (before training: {before:.1%})")
    if args.output_dir:
        saved = accelerator.save_state(os.path.join(args.output_dir, "final"))
        accelerator.print(f"checkpoint written to {saved}")


if __name__ == "__main__":
    main()
