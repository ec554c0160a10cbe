"""LoRA on an MoE family through prepare (issue 29): Qwen2-MoE with adapters on attention, its shared expert (layer 0,
an MoE layer: transformers 5 stacks the routed experts, so peft's `gate_proj` there is the shared expert's) and the
dense MLP (layer 1, `mlp_only_layers`), trained at DP=2 and at TP=2 with sequence parallelism (megatron-core's MoE
layer needs it at TP > 1), step for step like HF peft. Logits and gradients per case: tests/test_lora.py."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import tiny_moe
from tests.spawn import run_on_ranks
from tests.training import token_dataset

STEPS, BATCH = 6, 4
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model():
    from peft import LoraConfig, get_peft_model

    model = tiny_moe("qwen2_moe").train()
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)


def _reference():
    model = _peft_model()
    wrapped = {n for n, _ in model.named_modules() if n.endswith(("gate_proj", "up_proj", "down_proj"))}
    opt, data, losses = _optimizer(model), token_dataset(STEPS * BATCH, model.config.vocab_size), []
    for step in range(STEPS):
        rows = data[step * BATCH:(step + 1) * BATCH]
        loss = model(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, wrapped


def _worker(tp):
    from megatron_plugin import Accelerator, MegatronLMPlugin

    model = _peft_model()
    dp = int(os.environ["WORLD_SIZE"]) // tp
    loader = DataLoader(token_dataset(STEPS * BATCH, model.config.vocab_size), batch_size=BATCH // dp, shuffle=False)
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=tp > 1)
    engine, _, loader = Accelerator(megatron_lm_plugin=plugin).prepare(model, _optimizer(model), loader)
    adapted = sorted({n.split(".lora_adapters.")[0] for n, p in engine.model.module.named_parameters()
                      if p.requires_grad})
    engine.train()
    losses = []
    for batch in loader:
        losses.append(engine(**batch).loss.item())
        if len(losses) == STEPS:
            break
    return losses, adapted


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2_sp"])
def test_qwen2_moe_shared_expert_lora_trains_like_hf_peft(tp):
    ref, wrapped = _reference()
    # peft wrapped the shared expert's and the dense MLP's linears only: no routed expert is an nn.Linear
    assert {w.split("layers.")[1] for w in wrapped} == {
        "0.mlp.shared_expert.gate_proj", "0.mlp.shared_expert.up_proj", "0.mlp.shared_expert.down_proj",
        "1.mlp.gate_proj", "1.mlp.up_proj", "1.mlp.down_proj"}
    for losses, adapted in run_on_ranks(_worker, 2, tp):
        assert {"decoder.layers.0.mlp.shared_experts.linear_fc1", "decoder.layers.0.mlp.shared_experts.linear_fc2",
                "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2"} <= set(adapted)
        assert not any(".experts." in a or "router" in a for a in adapted)
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) / abs(b) < 1e-5, f"step {step}: megatron {a} vs peft {b}"
