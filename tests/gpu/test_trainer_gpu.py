"""`megatron_plugin.integrations.Trainer` on the CUDA engine (megatron-core's DDP, optimizer and schedules):
one GPU against transformers' Trainer (fp32, on the CPU) with the same seed, data and global batch.

- fp32, eager: 20 logged losses within 1e-4, learning rates equal, gradient norms within 1e-3, the eval loss.
- bf16 with compiled layers: the losses within bf16's error.
- resume from checkpoint-N on the GPU continues bit for bit.

    python -m pytest -q tests/gpu/test_trainer_gpu.py
"""

import os
import tempfile

import pytest
import torch

from tests import test_trainer as T
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_run(out_dir, compiled, bf16, steps=T.STEPS, resume=None, save_steps=None):
    from transformers import default_data_collator

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.integrations import Trainer

    saving = dict(save_strategy="steps", save_steps=save_steps, save_total_limit=2) if save_steps else {}
    args = T._arguments(out_dir, 4, 2, steps, eval_strategy="steps", eval_steps=10, use_cpu=False, bf16=bf16,
                        **saving)
    trainer = Trainer(model=T._model(), args=args, train_dataset=T._data(), eval_dataset=T._data(16, seed=7),
                      data_collator=default_data_collator,
                      megatron_lm_plugin=MegatronLMPlugin(torch_compile=compiled))
    trainer.train(resume_from_checkpoint=resume)
    logs = T._logged(trainer)
    trainer.accelerator.end_training()
    return logs


@pytest.mark.parametrize("compiled,bf16", [(False, False), (True, True)], ids=["fp32", "bf16-compiled"])
def test_trainer_on_gpu_matches_hf_trainer(compiled, bf16):
    with tempfile.TemporaryDirectory() as d:
        ref_train, ref_eval = T.hf_run(os.path.join(d, "hf"), 8, eval_steps=10)
        ((train, evals),) = run_on_ranks(_gpu_run, 1, os.path.join(d, "mp"), compiled, bf16)
    tol = 3e-2 if bf16 else 1e-4
    assert len(train) == T.STEPS
    for step, ((loss, lr, norm), (ref_loss, ref_lr, ref_norm)) in enumerate(zip(train, ref_train)):
        assert T._close(loss, ref_loss, tol), f"step {step}: loss {loss} vs HF {ref_loss}"
        assert lr == pytest.approx(ref_lr, rel=1e-12, abs=0), f"step {step}: lr {lr} vs HF {ref_lr}"
        assert T._close(norm, ref_norm, 10 * tol), f"step {step}: grad norm {norm} vs HF {ref_norm}"
    assert len(evals) == len(ref_eval) == 2
    for (loss, _, _), (ref_loss, _, _) in zip(evals, ref_eval):
        assert T._close(loss, ref_loss, tol), (evals, ref_eval)


def test_trainer_resumes_bit_identically_on_gpu():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "mp")
        ((whole, _),) = run_on_ranks(_gpu_run, 1, out, False, True, 12, None, 4)
        ((resumed, _),) = run_on_ranks(_gpu_run, 1, out, False, True, 12, os.path.join(out, "checkpoint-8"), 4)
    assert len(whole) == len(resumed) == 12  # the resumed run's history holds steps 1-8 from trainer_state.json
    assert resumed[8:] == whole[8:], (resumed[8:], whole[8:])  # steps 9-12: loss, learning rate, grad norm
