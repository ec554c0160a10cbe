"""Megatron indexed datasets on the CUDA engine (pinned batches, non-blocking copies, mcore's schedules):
fp32 training on them equals HF trained on the same global batches, on one GPU and with PP=2."""

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.test_indexed_data import _hf_losses, _megatron_run, corpus  # noqa: F401 (corpus is a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "world,tp,pp,micro,num_micro",
    [(1, 1, 1, 8, 1),
     pytest.param(2, 1, 2, 4, 2, marks=pytest.mark.two_gpus)],
    ids=["1gpu", "pp2"],
)
def test_indexed_data_training_matches_hf_on_gpu(corpus, tmp_path, world, tp, pp, micro, num_micro):  # noqa: F811
    ref = _hf_losses(corpus, micro * num_micro, {})
    results = run_on_ranks(_megatron_run, world, corpus.prefix, str(corpus.root / "cache"), tp, micro, num_micro, {},
                           str(tmp_path / "ckpt"), pp)
    for rank, (losses, seen, resumed, evals, wrapped) in enumerate(results):
        assert seen[0].is_cuda, rank
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) / b < 1e-4, (rank, step, losses, ref)
        assert torch.equal(resumed, seen[3]) and wrapped, rank
