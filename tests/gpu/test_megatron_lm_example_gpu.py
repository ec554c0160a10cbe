"""The Megatron-LM checkpoint flow on the CUDA engine: checkpoint_utils converts an HF model to torch_dist
(in this process, on a machine with CUDA), and the example fine-tunes from it on one GPU at learning rate 0
with the eval loss of the HF model (fp32: no autocast, so only kernel-order differences remain).

    python -m pytest -q tests/gpu/test_megatron_lm_example_gpu.py
"""

import pytest
import torch

pytest.importorskip("datasets", reason="the example reads its text with datasets (absent on the lent GPU machines)")
from tests.test_megatron_lm_example import check_finetune_matches_hf  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU1_FP32 = """compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_num_micro_batches: 1
  megatron_lm_pp_degree: 1
  megatron_lm_recompute_activations: false
  megatron_lm_sequence_parallelism: false
  megatron_lm_tp_degree: 1
  megatron_lm_use_distributed_optimizer: false
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_finetune_from_converted_torch_dist_on_gpu(tmp_path):
    config = tmp_path / "gpu1_fp32.yaml"
    config.write_text(GPU1_FP32)
    # converted for TP=2 (vocabulary padded for 2 ranks), loaded at TP=1: torch_dist reshards
    check_finetune_matches_hf(tmp_path, str(config), tp=2, tol=1e-4)
