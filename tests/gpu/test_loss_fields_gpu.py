"""The plugin's loss and attention settings on the CUDA engine: calculate_per_token_loss through megatron-core's
own per-token path (its DDP sums gradients, its schedules hand the token count to finalize_model_grads), against
HF's loss over the global batch (fp32), and attention_backend's SDPA kernels in bf16.

    python -m pytest -q tests/gpu/test_loss_fields_gpu.py
"""

import os

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.test_loss_fields import LR, MICRO, NUM_MICRO, _hf_step, _rel
from tests.training import build, dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _per_token_step(model_name, data_name):
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMPlugin

    dp = int(os.environ["WORLD_SIZE"])
    model = build(model_name)
    rows = dataset(data_name, MICRO * NUM_MICRO * dp, model.config.vocab_size)
    plugin = MegatronLMPlugin(num_micro_batches=NUM_MICRO, gradient_clipping=0.0, calculate_per_token_loss=True)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, _, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                            DataLoader(rows, batch_size=MICRO))
    batch = next(iter(loader))
    engine.eval()
    eval_loss = engine(**batch).loss.item()
    engine.train()
    train_loss = engine(**batch).loss.item()
    return eval_loss, train_loss, {k: v.float().cpu() for k, v in engine.hf_state_dict().items()}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.two_gpus)], ids=["dp1", "dp2"])
@pytest.mark.parametrize("model_name,data_name", [("bert:mlm", "mlm"), ("tied", "sft")], ids=["bert_mlm", "gpt2_sft"])
def test_per_token_loss_is_hf_loss_over_the_global_batch_gpu(world, model_name, data_name):
    rows = dataset(data_name, MICRO * NUM_MICRO * world, build(model_name).config.vocab_size)
    ref_eval, ref_train, _, ref_weights = _hf_step(model_name, rows)
    for eval_loss, train_loss, weights in run_on_ranks(_per_token_step, world, model_name, data_name):
        assert abs(eval_loss - ref_eval) <= 1e-5 * abs(ref_eval), (eval_loss, ref_eval)
        assert abs(train_loss - ref_train) <= 1e-5 * abs(ref_train), (train_loss, ref_train)
        for k, w in weights.items():
            assert _rel(w, ref_weights[k]) < 1e-5, k


def _backend_run(backend):
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMPlugin, MegatronPluginConfigError
    from tests.models import tiny_gpt2

    ids = torch.randint(5, 300, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    hf = tiny_gpt2("tied", n_head=2, n_embd=128)  # head dim 64: every kernel takes it
    accelerator = Accelerator(megatron_lm_plugin=MegatronLMPlugin(attention_backend=backend), mixed_precision="bf16")
    engine, _, _ = accelerator.prepare(hf, torch.optim.AdamW(hf.parameters()),
                                       DataLoader([{"input_ids": ids[0].cpu()}] * 2, batch_size=2))
    engine.eval()
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).loss.float().item()
        mask = torch.ones_like(ids)
        mask[:, -1] = 0
        try:  # a padding mask: flash kernels take none
            engine(input_ids=ids, attention_mask=mask)
            refused = None
        except MegatronPluginConfigError as err:
            refused = err.setting
    return loss, refused


def test_attention_backends_run_their_kernels_in_bf16():
    got = {b: run_on_ranks(_backend_run, 1, b)[0] for b in ("auto", "flash", "fused", "unfused")}
    auto = got["auto"][0]
    for backend, (loss, _) in got.items():
        assert abs(loss - auto) < 2e-2 * abs(auto), (backend, got)
    assert got["flash"][1] == "attention_backend", got  # named, not a bare "No available kernel"
    assert got["unfused"][1] is None and got["auto"][1] is None and got["fused"][1] is None, got
