"""Training through accelerator.prepare matches plain HF + torch step for step (CPU, fp32)."""

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.training import megatron_losses, reference_losses

STEPS = 20


@pytest.mark.parametrize(
    "tp,world,micro,num_micro",
    [(2, 2, 4, 1), (1, 2, 2, 2)],
    ids=["tp2_dp1", "tp1_dp2_2micro"],
)
def test_losses_match_hf_every_step(tp, world, micro, num_micro):
    global_batch = micro * num_micro * (world // tp)
    ref = reference_losses(STEPS, global_batch)
    per_rank = run_on_ranks(megatron_losses, world, tp, STEPS, micro, num_micro)
    assert ref[-1] < ref[0]  # the run learns something, so the comparison means something
    for rank, got in enumerate(per_rank):
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"rank {rank} step {step}: megatron {a} vs HF {b}"


@pytest.mark.parametrize("tp,world", [(2, 2), (1, 2)], ids=["tp2", "dp2"])
def test_bf16_autocast_on_cpu_tracks_hf_autocast(tp, world):
    """mixed_precision='bf16' on CPU (README and questionnaire offer it) trains, and stays as close to
    HF under the same CPU autocast as bf16 allows."""
    import torch

    steps, micro = 8, 4 // (world // tp)
    ref = reference_losses(steps, 4, autocast=torch.bfloat16)
    fp32 = reference_losses(steps, 4)
    for got in run_on_ranks(megatron_losses, world, tp, steps, micro, 1, 1.0, None, None, (), False, "bf16"):
        assert len(got) == steps
        for a, b in zip(got, ref):
            assert abs(a - b) / b < 2e-2, (got, ref)
    assert max(abs(a - b) for a, b in zip(ref, fp32)) > 1e-5  # bf16 really ran (it differs from fp32)


@pytest.mark.parametrize("trainable_only", [False, True], ids=["optimizer_over_all", "optimizer_over_trainable"])
def test_frozen_parameters_stay_frozen(trainable_only):
    """requires_grad=False means frozen whichever HF idiom builds the optimizer; the rest trains as HF."""
    from tests.training import FROZEN

    steps = 6
    ref, ref_state = reference_losses(steps, 4, frozen=FROZEN, return_state=True, trainable_only=trainable_only)
    initial = tiny_state()
    results = run_on_ranks(megatron_losses, 2, 2, steps, 4, 1, 1.0, None, None, FROZEN, trainable_only, None, True)
    for got, state in results:
        for a, b in zip(got, ref):
            assert abs(a - b) / b < 1e-4, (got, ref)
        frozen = [k for k in state if k.startswith(FROZEN)]
        assert "transformer.wte.weight" in frozen and "transformer.h.0.attn.c_attn.weight" in frozen
        for k in frozen:
            assert torch.equal(state[k], initial[k]), k  # bit for bit untouched
        assert not torch.equal(state["transformer.h.1.attn.c_attn.weight"], initial["transformer.h.1.attn.c_attn.weight"])
        for k in state:
            assert torch.allclose(state[k], ref_state[k], rtol=1e-4, atol=1e-5), k


def tiny_state():
    from tests.models import tiny_gpt2

    return {k: v.clone() for k, v in tiny_gpt2("tied").state_dict().items()}


@pytest.mark.parametrize("model", ["llama", "mistral", "qwen2", "qwen3"])
def test_llama_family_sft_matches_hf_every_step(model):
    """Supervised fine-tuning (loss on response tokens only) through accelerator.prepare with TP=2."""
    from functools import partial

    ref = reference_losses(STEPS, 4, model=model, data="sft")
    assert ref[-1] < ref[0]
    for got in run_on_ranks(partial(megatron_losses, model=model, data="sft"), 2, 2, STEPS, 4, 1):
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"{model} step {step}: megatron {a} vs HF {b}"


@pytest.mark.parametrize("model,data", [("bert:pretraining", "mlm_nsp"), ("bert:mlm", "mlm"),
                                        ("megatron_bert:pretraining", "mlm_nsp")])
def test_bert_matches_hf_every_step(model, data):
    """MLM (+ next-sentence) pre-training through accelerator.prepare with TP=2, BertTrainStep chosen by model type."""
    from functools import partial

    ref = reference_losses(STEPS, 4, model=model, data=data)
    assert ref[-1] < ref[0]
    for got in run_on_ranks(partial(megatron_losses, model=model, data=data), 2, 2, STEPS, 4, 1):
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"{model} step {step}: megatron {a} vs HF {b}"


@pytest.mark.parametrize("model", ["t5_v1_0", "t5_v1_1"])
def test_t5_matches_hf_every_step(model):
    """Seq2seq training through accelerator.prepare with TP=2, T5TrainStep chosen by model type; decoder
    inputs made from the labels as HF makes them, the decoder attention mask honoured."""
    from functools import partial

    ref = reference_losses(STEPS, 4, model=model, data="seq2seq")
    assert ref[-1] < ref[0]
    for got in run_on_ranks(partial(megatron_losses, model=model, data="seq2seq"), 2, 2, STEPS, 4, 1):
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"{model} step {step}: megatron {a} vs HF {b}"
