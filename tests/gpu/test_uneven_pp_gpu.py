"""decoder_last_pipeline_num_layers on the CUDA engine: a 3-layer GPT-2 over 2 pipeline stages (2 layers, then
1), each stage holding its HF layers bit for bit, training like the same model on one GPU (fp32).

    python -m pytest -q tests/gpu/test_uneven_pp_gpu.py
"""

import os

import pytest
import torch

from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

STEPS, MICRO, NUM_MICRO, LAYERS = 6, 2, 2, 3


def _run(pp, last):
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.models import tiny_gpt2
    from tests.training import WARMUP, optimizer_for, token_dataset

    hf = tiny_gpt2("tied", n_layer=LAYERS)
    initial = {k: v.clone() for k, v in hf.state_dict().items()}
    plugin = MegatronLMPlugin(pp_degree=pp, decoder_last_pipeline_num_layers=last, num_micro_batches=NUM_MICRO)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    opt = optimizer_for(hf)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    loader = DataLoader(token_dataset(STEPS * MICRO * NUM_MICRO, hf.config.vocab_size), batch_size=MICRO)
    engine, opt, sched, loader = accelerator.prepare(hf, opt, sched, loader)
    state = engine.hf_state_dict()
    layers = sorted({int(k.split(".")[2]) for k in state if k.startswith("transformer.h.")})
    exact = all(torch.equal(v.cpu(), initial[k]) for k, v in state.items())
    built = len(engine.model.module.decoder.layers)
    engine.train()
    losses = [engine(**batch).loss.item() for batch in loader]
    return dict(rank=int(os.environ["RANK"]), layers=layers, built=built, exact=exact, losses=losses)


@two_gpus
def test_uneven_last_stage_holds_its_layers_and_trains_like_one_gpu():
    (single,) = run_on_ranks(_run, 1, 1, None)
    assert single["layers"] == [0, 1, 2] and single["exact"]
    for got in run_on_ranks(_run, 2, 2, 1):
        first = got["rank"] == 0
        assert got["layers"] == ([0, 1] if first else [2]), got
        assert got["built"] == (2 if first else 1), got  # megatron-core built that many layers there
        assert got["exact"], got  # each stage's weights are the HF layers it should hold
        assert len(got["losses"]) == STEPS
        for a, b in zip(got["losses"], single["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], single["losses"])
