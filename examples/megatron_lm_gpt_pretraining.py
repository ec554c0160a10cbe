"""Causal-LM training of GPT-2 on Megatron-Core through accelerate.

This is transformers' `run_clm_no_trainer.py`, cut down and changed as the Megatron-LM guide says:
a `MegatronLMDummyScheduler`, the global batch size from the plugin, losses that are already averaged
over data-parallel ranks, and `accelerator.save_state` for checkpoints. It trains on a local text file
with a byte-level BPE tokenizer built from it, so it needs no network.

    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_gpt_pretraining.py \
        --output_dir outputs/demo

Fine-tuning from a Megatron-LM checkpoint (as accelerate's example does with `--megatron_lm_checkpoint`):
the model is built on the meta device from the HF config, and `accelerator.load_state` fills it after
`prepare`. Make one from an HF model with `python -m checkpoint_utils.convert` (torch_dist by default):

    python -m checkpoint_utils.convert --load_path gpt/hf --save_path gpt/megatron --target_tensor_model_parallel_size 2
    accelerate launch --config_file examples/configs/cpu_tp2.yaml examples/megatron_lm_gpt_pretraining.py \
        --model_name_or_path gpt/hf --megatron_lm_checkpoint gpt/megatron --tokenizer_name gpt/tokenizer
"""

import argparse
import contextlib
import logging
import math
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from accelerate import init_empty_weights  # noqa: E402
from accelerate.logging import get_logger  # noqa: E402
from accelerate.utils import DistributedType, set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    default_data_collator,
    get_scheduler,
)

from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronPluginConfigError  # noqa: E402
from megatron_plugin.fs import check_writable  # noqa: E402

logger = get_logger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train_file", default=os.path.join(HERE, "data", "corpus.txt"))
    p.add_argument("--validation_split_percentage", type=int, default=5)
    p.add_argument("--model_name_or_path", default=None, help="a local HF folder; default: a new tiny GPT-2")
    p.add_argument("--tokenizer_name", default=None, help="a local tokenizer folder; default: build one")
    p.add_argument("--vocab_size", type=int, default=2048, help="for the tokenizer built here")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=4, help="the micro-batch size")
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--max_eval_batches", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=10)
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--output_dir", default=None)
    p.add_argument("--checkpointing_steps", default=None, help="'epoch' or a number of steps")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--megatron_lm_checkpoint", default=None,
                   help="a Megatron-LM checkpoint (torch_dist or legacy torch) to fine-tune from; the model's HF "
                   "config comes from --model_name_or_path")
    p.add_argument("--stop_after_steps", type=int, default=None, help="end the run early (to test resuming)")
    p.add_argument("--log_every", type=int, default=50, help="print the loss every N steps (0: never)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--with_tracking", action="store_true")
    p.add_argument("--report_to", default="all")
    return p.parse_args(argv)


def build_tokenizer(train_file, vocab_size, save_dir):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([train_file], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok.save_pretrained(save_dir)
    return tok


def lm_datasets(args, tokenizer, accelerator=None):
    """(train, eval) datasets of `block_size` token blocks from the text file, split as run_clm splits."""
    import datasets  # here, not at the top: build_tokenizer is used where `datasets` is not installed (GPU machines)

    first = accelerator.main_process_first if accelerator is not None else contextlib.nullcontext
    raw = datasets.load_dataset("text", data_files={"train": args.train_file})
    split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=args.seed)
    block_size = args.block_size

    def tokenize(examples):
        return tokenizer([t + tokenizer.eos_token for t in examples["text"]])

    def group_texts(examples):
        # Concatenate all texts and cut them into blocks of block_size, as run_clm does.
        concatenated = {k: sum(examples[k], []) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with first():
        tokenized = split.map(tokenize, batched=True, remove_columns=["text"])
        lm = tokenized.map(group_texts, batched=True)
    return lm["train"], lm["test"]


def main(argv=None):
    args = parse_args(argv)
    if args.megatron_lm_checkpoint and not args.model_name_or_path:
        raise MegatronPluginConfigError("--megatron_lm_checkpoint", args.megatron_lm_checkpoint,
                                        "pass --model_name_or_path too: the HF folder whose config the checkpoint holds")
    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_log_kwargs)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if not accelerator.is_local_main_process:  # one rank's progress bars are enough
        import datasets

        datasets.utils.logging.disable_progress_bar()
        datasets.utils.logging.set_verbosity_error()
    if args.megatron_lm_checkpoint and accelerator.distributed_type != DistributedType.MEGATRON_LM:
        raise MegatronPluginConfigError("--megatron_lm_checkpoint", args.megatron_lm_checkpoint,
                                        "launch with a Megatron-LM config, e.g. --config_file examples/configs/cpu_tp2.yaml")
    set_seed(args.seed)
    if args.output_dir:
        check_writable(args.output_dir, "--output_dir")  # fail now, not after training
        if accelerator.is_main_process:
            os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    # Tokenizer: a local one, or one built from the training text (once, then read by every rank).
    tok_dir = args.tokenizer_name or os.path.join(args.output_dir or "outputs", "tokenizer")
    with accelerator.main_process_first():
        if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        else:
            tokenizer = build_tokenizer(args.train_file, args.vocab_size, tok_dir)

    train_dataset, eval_dataset = lm_datasets(args, tokenizer, accelerator)
    block_size = args.block_size

    if args.megatron_lm_checkpoint:
        # accelerate's flow: the HF model without weights (meta device); prepare() builds the Megatron model
        # (from the folder's weights, when it has any) and load_state() gives it the checkpoint's
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    elif args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    else:
        config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=block_size, n_embd=args.n_embd, n_layer=args.n_layer,
            n_head=args.n_head, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        model = GPT2LMHeadModel(config)

    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size,
        drop_last=True,
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size, drop_last=True
    )

    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)

    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        plugin = accelerator.state.megatron_lm_plugin
        dp = accelerator.num_processes // (plugin.tp_degree * plugin.pp_degree)
        step_samples = args.per_device_train_batch_size * plugin.num_micro_batches * dp
    else:
        step_samples = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    num_update_steps_per_epoch = len(train_dataset) // step_samples
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch

    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        lr_scheduler = MegatronLMDummyScheduler(
            optimizer=optimizer, total_num_steps=args.max_train_steps, warmup_num_steps=args.num_warmup_steps
        )
    else:
        lr_scheduler = get_scheduler(
            name=args.lr_scheduler_type, optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps * args.gradient_accumulation_steps,
            num_training_steps=args.max_train_steps * args.gradient_accumulation_steps,
        )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if args.megatron_lm_checkpoint:
        accelerator.load_state(args.megatron_lm_checkpoint)
        accelerator.print(f"weights loaded from {args.megatron_lm_checkpoint}")
    num_update_steps_per_epoch = len(train_dataloader) // args.gradient_accumulation_steps
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)

    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})

    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        total_batch_size = accelerator.state.megatron_lm_plugin.global_batch_size
    else:
        total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps

    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    starting_epoch = 0
    resume_step = None

    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        meta = accelerator.load_state(args.resume_from_checkpoint)
        completed_steps = meta["iteration"] if isinstance(meta, dict) else 0
        starting_epoch = completed_steps // num_update_steps_per_epoch
        resume_step = completed_steps % num_update_steps_per_epoch
        progress_bar.update(completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        train_dataloader.set_epoch(epoch)
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        total_loss = 0.0
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            progress_bar.update(1)
            completed_steps += 1
            if args.log_every and completed_steps % args.log_every == 0:
                lr = lr_scheduler.get_last_lr()[0]
                accelerator.print(f"step {completed_steps} loss {loss.item()!r} lr {lr:.3e}")
            if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0 and args.output_dir:
                saved = accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
                accelerator.print(f"checkpoint written to {saved}")
            if completed_steps >= args.max_train_steps or completed_steps == args.stop_after_steps:
                break

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            if args.max_eval_batches is not None and step >= args.max_eval_batches:
                break
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            if accelerator.distributed_type == DistributedType.MEGATRON_LM:
                losses.append(loss)
            else:
                losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.tensor(losses) if accelerator.distributed_type == DistributedType.MEGATRON_LM else torch.cat(losses)
        eval_loss = torch.mean(losses)
        try:
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        accelerator.print(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss.item()}")
        if args.with_tracking:
            accelerator.log({"perplexity": perplexity, "eval_loss": eval_loss, "train_loss": total_loss / max(1, len(train_dataloader)),
                             "epoch": epoch, "step": completed_steps}, step=completed_steps)
        if checkpointing_steps == "epoch" and args.output_dir:
            saved = accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
            accelerator.print(f"checkpoint written to {saved}")
        if completed_steps >= args.max_train_steps or completed_steps == args.stop_after_steps:
            break

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        if accelerator.distributed_type == DistributedType.MEGATRON_LM:
            saved = accelerator.save_state(os.path.join(args.output_dir, "final"))
            accelerator.print(f"checkpoint written to {saved} (resume with --resume_from_checkpoint, or convert "
                              "it to HF with `python -m checkpoint_utils.convert`)")
        else:
            unwrapped = accelerator.unwrap_model(model)
            unwrapped.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
        if accelerator.is_main_process:
            tokenizer.save_pretrained(args.output_dir)
    accelerator.end_training()  # trackers finished and no process group left alive at exit


if __name__ == "__main__":
    main()
