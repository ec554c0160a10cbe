"""LoRA export under bf16 on the GPU engine (issue 29): Float16Module holds the adapters in bf16 and the fp32
masters live in megatron-core's optimizer (whole with Float16OptimizerWithFloat16Params, sharded over the
data-parallel ranks with the distributed optimizer). `save_model` must write the masters (peft keeps adapters in
fp32), and the merged export must merge them (engine/lora.fp32_masters).

    python -m pytest -q tests/gpu/test_lora_gpu_export.py
"""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests import test_lora_training as T
from tests.spawn import run_on_ranks
from tests.training import token_dataset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus

STEPS, MICRO = 4, 2


def _bf16_worker(out_dir, distributed_optimizer):
    """STEPS bf16 steps, then the adapter folder and the merged export; returns this rank's masters of the adapters
    (peft name -> (start, end, flattened fp32 part)) as the optimizer holds them, and their bf16 model values."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from megatron_plugin.models.lora import lora_param_sources

    dp = int(os.environ["WORLD_SIZE"])
    model = T.peft_model("llama")
    loader = DataLoader(token_dataset(STEPS * MICRO * dp, model.config.vocab_size), batch_size=MICRO, shuffle=False)
    opt = T.make_optimizer(model)
    plugin = MegatronLMPlugin(use_distributed_optimizer=distributed_optimizer, gradient_clipping=1.0)
    accelerator = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    engine, opt, loader = accelerator.prepare(model, opt, loader)
    engine.train()
    for step, batch in zip(range(STEPS), loader):
        engine(**batch)
    accelerator.save_model(engine, os.path.join(out_dir, "adapter"))
    accelerator.save_model(engine, os.path.join(out_dir, "merged"), merge_lora=True)
    sources = lora_param_sources(engine.model)
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    masters, values = {}, {}
    for name, p in engine.model.module.named_parameters():
        if name not in sources:
            continue
        key = sources[name][0].replace(".default.weight", ".weight")
        values[key] = p.detach().float().cpu()
        main = getattr(p, "main_param", None)
        if main is None:  # the distributed optimizer: no part of this adapter on this rank
            continue
        start, end = 0, p.numel()
        if getattr(p, "main_param_sharded", False):
            owner = next(o for o in optimizers if isinstance(o, DistributedOptimizer) and p in o.model_param_gbuf_map)
            part = owner._get_model_param_range_map(p)["param"]
            start, end = part.start, part.end
        masters[key] = (start, end, main.detach().float().view(-1).cpu())
    return {"masters": masters, "values": values, "dtype": str(next(engine.model.module.parameters()).dtype)}


def _check(results, out_dir):
    from safetensors.torch import load_file

    folder = load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))
    assert results[0]["dtype"] == "torch.bfloat16"
    assert set(folder) == set(results[0]["values"])
    covered = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in folder.items()}
    for res in results:
        for key, (start, end, main) in res["masters"].items():
            assert folder[key].dtype == torch.float32, key
            assert torch.equal(folder[key].reshape(-1)[start:end], main), key  # the master, bit for bit
            covered[key][start:end] = True
    assert all(c.all() for c in covered.values())  # every element checked against some rank's master
    # the masters are not the bf16 copies: the folder would have lost precision otherwise
    assert any(not torch.equal(folder[k], v) for k, v in results[0]["values"].items())
    # merged: the bf16 base plus the fp32 masters' delta, rounded once (peft's merge_and_unload of a bf16 model)
    merged = {}
    for name in os.listdir(os.path.join(out_dir, "merged")):
        if name.endswith(".safetensors"):
            merged.update(load_file(os.path.join(out_dir, "merged", name)))
    base = {k: v.to(torch.bfloat16) for k, v in T.base_model("llama").state_dict().items()}
    scaling = 8 / 4  # T.peft_model's lora_alpha / r
    checked = 0
    for key, a in folder.items():
        if ".lora_A." not in key:
            continue
        module = key[len("base_model.model."):-len(".lora_A.weight")]
        b = folder[key.replace(".lora_A.", ".lora_B.")]
        want = (base[module + ".weight"].float() + (b @ a) * scaling).to(torch.bfloat16)
        got = merged[module + ".weight"]
        assert got.dtype == torch.bfloat16
        # GPU and CPU fp32 GEMMs sum in other orders: a rounding boundary may fall either side (one bf16 step)
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all(), module
        checked += 1
    assert checked == len(T.TARGETS["llama"]) * T.base_model("llama").config.num_hidden_layers


def test_bf16_adapter_folder_holds_the_fp32_masters_single_gpu(tmp_path):
    results = run_on_ranks(_bf16_worker, 1, str(tmp_path), False)
    _check(results, str(tmp_path))


@two_gpus
def test_bf16_adapter_folder_holds_the_distributed_optimizer_masters(tmp_path):
    results = run_on_ranks(_bf16_worker, 2, str(tmp_path), True)
    assert all(res["masters"] for res in results)  # the shards are spread over both ranks
    _check(results, str(tmp_path))


def _untrained_worker(out_dir, distributed_optimizer):
    from peft import get_peft_model_state_dict

    from megatron_plugin import Accelerator, MegatronLMPlugin

    dp = int(os.environ["WORLD_SIZE"])
    model = T.peft_model("llama")
    theirs = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    loader = DataLoader(token_dataset(MICRO * dp, model.config.vocab_size), batch_size=MICRO)
    plugin = MegatronLMPlugin(use_distributed_optimizer=distributed_optimizer)
    accelerator = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    engine, _, _ = accelerator.prepare(model, T.make_optimizer(model), loader)
    accelerator.save_model(engine, os.path.join(out_dir, "adapter"))
    return theirs


@pytest.mark.parametrize("world,distributed_optimizer", [
    (1, False), pytest.param(2, True, marks=two_gpus)], ids=["single", "distopt_dp2"])
def test_bf16_masters_start_from_peft_fp32_adapters(tmp_path, world, distributed_optimizer):
    """build_engine's load_fp32_masters: the masters are peft's fp32 adapters, not their bf16 rounding, so the folder
    saved before any step is the PeftModel's adapters bit for bit."""
    from safetensors.torch import load_file

    theirs = run_on_ranks(_untrained_worker, world, str(tmp_path), distributed_optimizer)[0]
    folder = load_file(os.path.join(str(tmp_path), "adapter", "adapter_model.safetensors"))
    assert set(folder) == set(theirs)
    assert all(torch.equal(folder[k], v) for k, v in theirs.items())
    # bf16 would not have held them: the check above sees the masters
    assert any(not torch.equal(v.bfloat16().float(), v) for v in theirs.values())
