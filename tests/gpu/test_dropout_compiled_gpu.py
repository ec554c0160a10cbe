"""Compiled layers train with dropout on CUDA: GPT-2, BERT and T5 (whose HF configs default to dropout 0.1) at
TP = 1, GPT-2 and T5 at TP = 2 without sequence parallelism and LoRA adapters at TP = 2 + SP, where attention
dropout, T5's dropout before `wo` and peft's dropout of a split input draw from megatron-core's RNG tracker through a fork outside torch.compile (layers/rng_fork.py). Until that fork
left dynamo's reach, a compiled GPT-2 layer with attention dropout did not finish its first step (H200,
2026-11-30).

    python -m pytest -q tests/gpu/test_dropout_compiled_gpu.py
"""

from functools import partial

import pytest
import torch

from tests.gpu.workers import dropout_compiled_run
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _check(result):
    losses, eval_loss = result["losses"], result["eval"]
    # learning rate 0 and one batch: only the dropout masks change, a new one each step
    assert len(set(losses)) == len(losses), losses
    assert all(loss != eval_loss for loss in losses), result
    assert abs(sum(losses) / len(losses) - eval_loss) < 0.1 * eval_loss, result


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
def test_compiled_layers_train_with_dropout(family):
    _check(run_on_ranks(partial(dropout_compiled_run, family=family), 1)[0])


@pytest.mark.two_gpus
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_compiled_layers_train_with_dropout_tp2(family):
    _check(run_on_ranks(partial(dropout_compiled_run, family=family, tp=2), 2)[0])


@pytest.mark.two_gpus
def test_compiled_lora_adapters_train_with_dropout_tp2_sp():
    # peft's adapter dropout of an input split over TP ranks forks the tracker (layers/lora.py)
    _check(run_on_ranks(partial(dropout_compiled_run, lora=True, tp=2, sp=True), 2)[0])
