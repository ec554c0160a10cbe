"""benchmarks/random_checkpoint.py writes sharded checkpoints that transformers and our reader load."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from random_checkpoint import has_checkpoint, write_random_checkpoint  # noqa: E402


def test_sharded_random_checkpoint_loads_with_from_pretrained(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32)
    total, largest = write_random_checkpoint(str(tmp_path), GPT2LMHeadModel, cfg, shard_bytes=100_000,
                                             skip=("lm_head.weight",))
    assert has_checkpoint(str(tmp_path))
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and largest <= 100_000 + 4096  # a shard closes before it overflows (+ its header)
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path))
    state = model.state_dict()
    n = sum(v.numel() for k, v in state.items() if k != "lm_head.weight")
    assert total == 4 * n
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    assert 0.015 < state["transformer.h.0.mlp.c_fc.weight"].std().item() < 0.025
