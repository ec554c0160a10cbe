"""HF's embedding padding_idx on CUDA, fp32: the CPU test's comparisons (tests/test_padding_idx.py) with the
models, their lookups (mcore's, and ours into main_grad) and NCCL's reductions on the GPU, at TP = 1, 2 and
TP = 2 + SP.

    python -m pytest -q tests/gpu/test_padding_idx_gpu.py
"""

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.test_padding_idx import PAD, _worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("world_size, sp", [(1, False), pytest.param(2, False, marks=pytest.mark.two_gpus),
                                            pytest.param(2, True, marks=pytest.mark.two_gpus)])
def test_embedding_gradient_leaves_hf_padding_row_alone_on_cuda(world_size, sp):
    # the GEMMs' summation order differs from HF's on the GPU: 1e-4 relative, the pad row's zero exact
    for rank, per_rank in enumerate(run_on_ranks(_worker, world_size, sp, "cuda")):
        for name, res in per_rank.items():
            where = (rank, world_size, sp, name, res)
            assert res["reduce_scatter"] == sp, where
            assert res["padding_idx"] == res["hf_padding_idx"] == (None if name == "gpt2" else PAD), where
            assert res["rel"] < 1e-4 and res["pad_row_rel"] < 1e-4, where
            assert (res["unfixed_pad_row_rel"] < 1e-4) if name == "gpt2" else (res["unfixed_pad_row_rel"] > 1e-2), where
            if name in ("llama", "bert_untied"):
                assert res["pad_row_norm"] == 0.0, where
            if name == "llama":
                assert res["main_grad_rel"] < 1e-4 and res["main_grad_marked"], where
