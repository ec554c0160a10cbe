"""Compiled layers train with dropout on CUDA (0.1, HF GPT-2's and BERT's default, set here through
other_megatron_args): GPT-2, BERT and T5 at TP = 1; GPT-2 and T5 at TP = 2 without sequence parallelism, where
attention dropout and T5's dropout before `wo` draw from megatron-core's RNG tracker through a fork outside
torch.compile (layers/rng_fork.py); LoRA's adapter dropout at TP = 2 with and without SP. Until that fork left
dynamo's reach, a compiled GPT-2 layer with attention dropout did not finish its first step (H200, 2026-11-30).

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
@pytest.mark.parametrize("sp", [False, True])
def test_compiled_lora_adapters_train_with_dropout_tp2(sp):
    # peft's adapter dropout of an input split over TP ranks forks the tracker without SP (layers/lora.py); with
    # SP megatron-core's block holds the fork around the layer
    _check(run_on_ranks(partial(dropout_compiled_run, lora=True, tp=2, sp=sp), 2)[0])
