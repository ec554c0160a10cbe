"""GPT pre-training on a Megatron indexed dataset (.bin/.idx), as the Megatron-LM guide's last section does
it: a `MegatronLMDummyDataLoader` passed to `prepare` three times (train, validation and test iterators),
and a loop that runs `max_train_steps` steps and evaluates `eval_iters` batches every `eval_interval`.

By default it needs no network: it builds a tokenizer from examples/data/corpus.txt, writes the corpus
as an indexed dataset (what `megatron-plugin preprocess-data` does) and trains a tiny GPT-2. With
`--data_path <prefix>` and `--model_name_or_path` (plus `--tokenizer_name` for the model's end of
document) it pre-trains a real model on real data, on GPU with a GPU config.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_gpt_indexed_pretraining.py \\
        --output_dir outputs/indexed
"""

import argparse
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402

from megatron_plugin import Accelerator, MegatronLMDummyDataLoader, MegatronLMDummyScheduler  # noqa: E402
from megatron_plugin.data.preprocess import preprocess_data  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_path", default=None, help="an indexed dataset's prefix; default: write one from --train_file")
    p.add_argument("--train_file", default=os.path.join(HERE, "data", "corpus.txt"))
    p.add_argument("--splits_string", default="949,50,1")
    p.add_argument("--model_name_or_path", default=None, help="a local HF folder; default: a new tiny GPT-2")
    p.add_argument("--tokenizer_name", default=None, help="a local tokenizer folder; default: build one")
    p.add_argument("--vocab_size", type=int, default=2048, help="for the tokenizer built here")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="the micro-batch size")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_train_steps", type=int, default=300)
    p.add_argument("--num_warmup_steps", type=int, default=10)
    p.add_argument("--eval_interval", type=int, default=100)
    p.add_argument("--eval_iters", type=int, default=10)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--stop_after_steps", type=int, default=None, help="end the run early (to test resuming)")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator()
    set_seed(args.seed)
    work = args.output_dir or "outputs/indexed"
    check_writable(work, "--output_dir")

    # The tokenizer and the dataset, written once by the main process and then read by every rank.
    tok_dir = args.tokenizer_name or os.path.join(work, "tokenizer")
    data_path = args.data_path
    with accelerator.main_process_first():
        if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        else:
            from examples.megatron_lm_gpt_pretraining import build_tokenizer

            tokenizer = build_tokenizer(args.train_file, args.vocab_size, tok_dir)
        if data_path is None:
            data_path = os.path.join(work, "data", "corpus_text_document")
            if not os.path.exists(data_path + ".idx"):  # the first process in writes it
                os.makedirs(os.path.dirname(data_path), exist_ok=True)
                preprocess_data(args.train_file, tokenizer, os.path.join(work, "data", "corpus"))

    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=len(tokenizer), n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
            n_head=args.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))
    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight", "norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ], lr=args.learning_rate)
    lr_scheduler = MegatronLMDummyScheduler(optimizer=optimizer, total_num_steps=args.max_train_steps,
                                            warmup_num_steps=args.num_warmup_steps)

    # The guide's section on Megatron-LM indexed datasets, with only the import changed.
    megatron_dataloader_config = {
        "data_path": data_path,
        "splits_string": args.splits_string,
        "seq_length": args.block_size,
        "micro_batch_size": args.per_device_train_batch_size,
        "eod_token_id": tokenizer.eos_token_id,
    }
    megatron_dataloader = MegatronLMDummyDataLoader(**megatron_dataloader_config)
    accelerator.state.megatron_lm_plugin.megatron_dataset_flag = True
    accelerator.state.megatron_lm_plugin.eval_interval = args.eval_interval
    accelerator.state.megatron_lm_plugin.eval_iters = args.eval_iters
    model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, _ = accelerator.prepare(
        model, optimizer, lr_scheduler, megatron_dataloader, megatron_dataloader, megatron_dataloader
    )
    plugin = accelerator.state.megatron_lm_plugin
    accelerator.print(f"global batch {plugin.global_batch_size} sequences of {args.block_size} tokens, "
                      f"{args.max_train_steps} steps")

    completed_steps = 0
    if args.resume_from_checkpoint:
        # the train iterator goes on where the checkpoint's run stopped reading
        completed_steps = accelerator.load_state(args.resume_from_checkpoint)["iteration"]
        accelerator.print(f"resumed at step {completed_steps}")

    while completed_steps < args.max_train_steps:
        model.train()
        batch = next(train_dataloader) if train_dataloader is not None else {}
        outputs = model(**batch)
        loss = outputs.loss
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        completed_steps += 1
        if args.log_every and completed_steps % args.log_every == 0:
            accelerator.print(f"step {completed_steps} loss {loss.item()!r} lr {lr_scheduler.get_last_lr()[0]:.3e}")

        if completed_steps % plugin.eval_interval == 0 or completed_steps == args.max_train_steps:
            eval_completed_steps = 0
            losses = []
            while eval_completed_steps < plugin.eval_iters:
                model.eval()
                with torch.no_grad():
                    batch = next(eval_dataloader) if eval_dataloader is not None else {}
                    outputs = model(**batch)
                losses.append(outputs.loss.item())
                eval_completed_steps += 1
            eval_loss = sum(losses) / len(losses)
            accelerator.print(f"step {completed_steps}: eval_loss {eval_loss:.4f} perplexity {math.exp(eval_loss):.2f}")
        if completed_steps == args.stop_after_steps:
            break

    if args.output_dir:
        saved = accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
        accelerator.print(f"checkpoint written to {saved}")
    accelerator.end_training()  # no process group left alive at exit


if __name__ == "__main__":
    main()
