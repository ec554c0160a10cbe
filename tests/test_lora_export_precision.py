"""The adapters' fp32 masters for export (engine/lora.fp32_masters), on CPU over gloo with megatron-core's
optimizer layouts stood in for: a bf16 run's adapter folder holds the optimizer's fp32 masters, whole from
Float16OptimizerWithFloat16Params' `main_param`, put back together from the distributed optimizer's shards
(a part per data-parallel rank, none on some ranks, the precision-aware optimizer's masters read through its
accessor). The GPU engine's own run is tests/gpu/test_lora_gpu_export.py."""

import types

import torch

from tests.spawn import run_on_ranks


def _fake_distributed_optimizer(params, ranges, mains, group):
    """A megatron-core DistributedOptimizer with only what fp32_masters reads: the buffers' parameters, this rank's
    parts (`model_param_gbuf_map`, `_get_model_param_range_map`) and the precision-aware accessor."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.is_stub_optimizer = False
    # as megatron-core's buffers: `params` a list (compared by value), `param_index_map` keyed by parameter
    opt.buffers = [types.SimpleNamespace(params=list(params), param_index_map={p: (0, p.numel(), 0) for p in params})]
    opt.model_param_gbuf_map = {p: (0, torch.bfloat16, 0) for p in ranges}
    opt._get_model_param_range_map = lambda p: {"param": types.SimpleNamespace(start=ranges[p][0], end=ranges[p][1])}
    opt._get_main_param_and_optimizer_states = lambda p: {"param": mains[p]}
    opt.data_parallel_group = group
    return opt


def _worker():
    import torch.distributed as dist

    from megatron_plugin.engine.lora import fp32_masters

    dist.init_process_group("gloo")  # spawn.py's environment: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)  # the same tensors on both ranks
    whole = {n: torch.randn(6, 4, generator=g) for n in ("a", "b", "c")}
    params = {n: torch.nn.Parameter((t + 1e-3).bfloat16()) for n, t in whole.items()}  # bf16 copies, off the masters
    fp32 = torch.nn.Parameter(torch.randn(3, 2, generator=g))
    frozen = torch.nn.Parameter(torch.randn(3, 2, generator=g).bfloat16(), requires_grad=False)
    out = {"cpu_engine": fp32_masters(types.SimpleNamespace(optimizer=None)) is None,
           "fp32_run": fp32_masters(types.SimpleNamespace(dtype=None, optimizer=None)) is None}

    # Float16OptimizerWithFloat16Params: the whole master on every rank
    for n, p in params.items():
        p.main_param = whole[n].clone()
    value = fp32_masters(types.SimpleNamespace(dtype=torch.bfloat16, optimizer=types.SimpleNamespace()))
    out["whole"] = all(torch.equal(value(p), whole[n]) and value(p).dtype == torch.float32 for n, p in params.items())
    out["fp32_and_frozen"] = torch.equal(value(fp32), fp32) and torch.equal(value(frozen), frozen)

    # the distributed optimizer: a split inside "a", "b" on rank 1 only, "c" through the precision-aware accessor
    for p in params.values():
        del p.main_param
    mine = {0: {"a": (0, 10), "c": (0, 24)}, 1: {"a": (10, 24), "b": (0, 24)}}[rank]
    ranges, mains = {}, {}
    for n, (start, end) in mine.items():
        p = params[n]
        ranges[p] = (start, end)
        mains[p] = whole[n].view(-1)[start:end].clone()
        p.main_param = None if n == "c" else mains[p]
        p.main_param_sharded = True
    opt = _fake_distributed_optimizer(list(params.values()), ranges, mains, dist.group.WORLD)
    value = fp32_masters(types.SimpleNamespace(dtype=torch.bfloat16,
                                               optimizer=types.SimpleNamespace(chained_optimizers=[opt])))
    out["sharded"] = {n: torch.equal(value(p), whole[n]) for n, p in params.items()}  # same order on both ranks
    return out


def test_fp32_masters_whole_and_from_distributed_optimizer_shards():
    for out in run_on_ranks(_worker, 2):
        assert out["cpu_engine"] and out["fp32_run"]
        assert out["whole"] and out["fp32_and_frozen"]
        assert out["sharded"] == {"a": True, "b": True, "c": True}


def _round_trip_worker():
    """peft's fp32 adapters -> the masters of a bf16 model (load_fp32_masters) -> the folder's tensors
    (adapter_tensors): with whole masters and with the distributed optimizer's shards (half of every adapter on
    each data-parallel rank). Before the load, the masters are the bf16 parameters' values, as megatron-core
    makes them."""
    import torch.distributed as dist
    from peft import get_peft_model_state_dict

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.lora import adapter_tensors, load_fp32_masters, peft_inputs
    from tests.test_lora import LLAMA_ALL, _peft, _twin

    pm = _peft("llama", LLAMA_ALL)
    theirs = get_peft_model_state_dict(pm)
    model, _ = _twin(pm, MegatronLMPlugin())  # DP=2
    _, run = peft_inputs((pm,))
    adapters = [p for n, p in model.module.named_parameters() if ".lora_adapters." in n]
    for p in adapters:
        p.data = p.data.bfloat16()
    rank, out = dist.get_rank(), {}

    def exact(tensors):
        return set(tensors) == set(theirs) and all(torch.equal(tensors[k], theirs[k]) for k in theirs)

    for layout in ("whole", "sharded"):
        ranges = {}
        for p in adapters:
            flat = p.detach().float().reshape(-1)
            if layout == "whole":
                p.main_param = flat.view(p.shape).clone()
            else:
                half = p.numel() // 2
                ranges[p] = (0, half) if rank == 0 else (half, p.numel())
                p.main_param, p.main_param_sharded = flat[ranges[p][0]:ranges[p][1]].clone(), True
        optimizer = types.SimpleNamespace()
        if layout == "sharded":
            mains = {p: p.main_param for p in adapters}
            optimizer.chained_optimizers = [_fake_distributed_optimizer(adapters, ranges, mains, dist.group.WORLD)]
        engine = types.SimpleNamespace(dtype=torch.bfloat16, optimizer=optimizer, chunks=[model])
        out[layout] = (exact(adapter_tensors(engine)), exact(adapter_tensors(engine, masters=False)))
        load_fp32_masters(engine, run)
        out[layout] += (exact(adapter_tensors(engine)),)
    return out


def test_masters_take_peft_fp32_adapters_and_give_them_back():
    for out in run_on_ranks(_round_trip_worker, 2):
        # (folder from the masters before the load, from the bf16 parameters, from the masters after the load)
        assert out == {"whole": (False, False, True), "sharded": (False, False, True)}
