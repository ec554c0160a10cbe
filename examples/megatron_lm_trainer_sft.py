"""Causal-LM training (SFT-style: labels are the text's next tokens) with transformers' Trainer on Megatron-Core.

An ordinary Trainer script: TrainingArguments, a dataset, `trainer.train()`, `trainer.evaluate()`,
`trainer.save_model()`. The one Megatron line is the import, `from megatron_plugin.integrations import Trainer`;
the parallelism comes from the accelerate config. It trains a tiny Llama from scratch on the local text file with
a byte-level BPE tokenizer built from it, so it needs no network (for prompt/completion data with a
completion-only loss, `megatron_plugin.integrations.SFTTrainer` takes TRL's arguments):

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_trainer_sft.py \
        --output_dir outputs/trainer_sft

`--gradient_accumulation_steps` becomes Megatron's micro-batches; `checkpoint-N` folders hold the Megatron
state (`--resume_from_checkpoint outputs/trainer_sft/checkpoint-20` continues from one); `final/` holds HF
weights that `AutoModelForCausalLM.from_pretrained` loads.
"""

import argparse
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainingArguments,
    default_data_collator,
)

from megatron_plugin.integrations import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--train_file", default=os.path.join(HERE, "data", "corpus.txt"))
    p.add_argument("--vocab_size", type=int, default=1024, help="of the tokenizer built here")
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="the micro-batch size")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2, help="Megatron's micro-batches per step")
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--warmup_steps", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--eval_steps", type=int, default=20)
    p.add_argument("--save_steps", type=int, default=20)
    p.add_argument("--save_total_limit", type=int, default=2)
    p.add_argument("--max_eval_samples", type=int, default=64)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_tokenizer(train_file, vocab_size, save_dir):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([train_file], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
              show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                  eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(save_dir)
    return tok


def lm_datasets(train_file, tokenizer, block_size, seed, max_eval_samples):
    """(train, eval): the text's lines tokenized, joined and cut into blocks of `block_size` tokens (labels = ids,
    the model shifts them), 5% held out for evaluation."""
    raw = datasets.load_dataset("text", data_files={"train": train_file})["train"]
    split = raw.train_test_split(test_size=0.05, seed=seed)

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    def blocks(batch):
        ids = sum(batch["input_ids"], [])
        total = len(ids) // block_size * block_size
        chunks = [ids[i: i + block_size] for i in range(0, total, block_size)]
        return {"input_ids": chunks, "attention_mask": [[1] * block_size for _ in chunks],
                "labels": [list(c) for c in chunks]}

    lm = split.map(tokenize, batched=True, remove_columns=["text"])
    lm = lm.map(blocks, batched=True, remove_columns=lm["train"].column_names)
    evaluation = lm["test"].select(range(min(max_eval_samples, len(lm["test"]))))
    return lm["train"], evaluation


def main(argv=None):
    args = parse_args(argv)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        bf16=args.bf16,
        seed=args.seed,
        dataloader_drop_last=True,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
    )
    tokenizer_dir = os.path.join(args.output_dir, "tokenizer")
    with training_args.main_process_first(desc="tokenizer and dataset"):
        if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.json")):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        else:
            tokenizer = build_tokenizer(args.train_file, args.vocab_size, tokenizer_dir)
        train_dataset, eval_dataset = lm_datasets(args.train_file, tokenizer, args.block_size, args.seed,
                                                  args.max_eval_samples)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.block_size, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)

    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        data_collator=default_data_collator, processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"final eval_loss: {metrics['eval_loss']:.6f}")
    trainer.save_model(os.path.join(args.output_dir, "final"))
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
