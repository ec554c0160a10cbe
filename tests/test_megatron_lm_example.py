"""The issue's check of the Megatron-LM checkpoint flow: the example fine-tunes from a torch_dist checkpoint
that checkpoint_utils made from an HF model (`--megatron_lm_checkpoint`, as accelerate's example), and at
learning rate 0 its eval loss is the HF model's own."""
import os
import re

import torch

from tests.launch import CONFIGS, EXAMPLE, ROOT, accelerate_launch
from tests.models import tiny_gpt2


def _hf_eval_loss(model, args, tokenizer, batches):
    """Mean per-batch loss of the HF model over the example's eval split and batching (plain PyTorch, one
    process: what accelerate without Megatron computes)."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from examples.megatron_lm_gpt_pretraining import lm_datasets

    _, eval_dataset = lm_datasets(args, tokenizer)
    loader = DataLoader(eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size,
                        drop_last=True)
    losses = []
    with torch.no_grad():
        for step, batch in enumerate(loader):
            if step >= batches:
                break
            losses.append(model(**batch).loss)
    return torch.stack(losses).mean().item()


def check_finetune_matches_hf(tmp_path, config, tp, tol):
    """Under `config` (an accelerate config file of a Megatron-LM launch at `tp`): tiny GPT-2 saved as HF,
    converted to torch_dist, the example run from it at learning rate 0 prints the HF model's eval loss
    (within `tol`)."""
    from transformers import PreTrainedTokenizerFast

    from checkpoint_utils import convert_hf_to_megatron
    from examples.megatron_lm_gpt_pretraining import build_tokenizer, parse_args

    tok = tmp_path / "tok"
    build_tokenizer(os.path.join(ROOT, "examples", "data", "corpus.txt"), 1000, str(tok))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok)
    # an odd vocabulary (padded rows at TP=2), and the example's block size as the position limit
    shape = dict(vocab_size=len(tokenizer), n_positions=64, n_layer=2)
    assert len(tokenizer) % 256
    tiny_gpt2("tied", **shape).save_pretrained(tmp_path / "hf")
    # the folder the example takes its config from holds other weights: only load_state can make the loss HF's
    tiny_gpt2("tied", seed=123, **shape).save_pretrained(tmp_path / "other")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), tp=tp, progress=False)

    batches = 4
    out = accelerate_launch(
        config, EXAMPLE, "--model_name_or_path", tmp_path / "other", "--megatron_lm_checkpoint", tmp_path / "mg",
        "--tokenizer_name", tok, "--learning_rate", 0.0, "--num_warmup_steps", 0, "--max_train_steps", 1,
        "--max_eval_batches", batches, "--log_every", 1,
    )
    assert "weights loaded from" in out
    got = float(re.findall(r"eval_loss: (\S+)", out)[-1])
    args = parse_args(["--tokenizer_name", str(tok)])
    ref = _hf_eval_loss(tiny_gpt2("tied", **shape), args, tokenizer, batches)
    other = _hf_eval_loss(tiny_gpt2("tied", seed=123, **shape), args, tokenizer, batches)
    assert abs(got - ref) < tol, (got, ref)
    assert abs(other - ref) > 100 * tol, (other, ref)  # the two models differ: the equality above is not trivial


def test_finetune_from_converted_torch_dist_matches_hf_eval_loss(tmp_path):
    check_finetune_matches_hf(tmp_path, os.path.join(CONFIGS, "cpu_tp2.yaml"), tp=2, tol=1e-5)
