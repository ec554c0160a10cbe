"""layers/tp_grads (the patch `tp_grad_sums`): the TP sums of the gradients each TP rank holds whole (SP's norms and
biases, q/k norms), bit for bit megatron-core's, with the parameters found once and the sums copied back in one
launch instead of one copy_ each.

    python -m pytest -q tests/test_tp_grads.py
"""

import pytest
import torch

from tests.spawn import run_on_ranks


def _chunk(rank):
    import types

    m = torch.nn.Module()
    m.norm = torch.nn.LayerNorm(8)
    m.proj = torch.nn.Linear(8, 6)
    m.q_layernorm = torch.nn.LayerNorm(4)  # summed under qk_layernorm, whatever its marks
    m.frozen = torch.nn.LayerNorm(8)
    for p in (m.norm.weight, m.norm.bias, m.proj.bias, m.frozen.weight):
        p.sequence_parallel = True
    m.frozen.weight.requires_grad_(False)
    m.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    g = torch.Generator().manual_seed(10 + rank)
    for p in m.parameters():
        p.main_grad = torch.randn(p.shape, generator=g)
    return m


def _worker():
    import importlib
    import types

    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_plugin import patches
    from megatron_plugin.layers import tp_grads

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    dist.init_process_group("gloo")
    assert "tp_grad_sums" not in patches.installed()  # so fmg's function below is megatron-core's own
    rank, group = dist.get_rank(), dist.group.WORLD
    config = types.SimpleNamespace(sequence_parallel=True, qk_layernorm=True)
    theirs, ours = [_chunk(rank), _chunk(rank)], [_chunk(rank), _chunk(rank)]
    before = [p.main_grad.clone() for m in ours for p in m.parameters()]
    counts = {}
    for step in range(2):  # the second call takes the parameters found by the first
        with Count() as c:
            fmg._allreduce_non_tensor_model_parallel_grads(theirs, config, group)
        counts[f"mcore{step}"] = c.calls
        with Count() as c:
            tp_grads.allreduce_non_tensor_model_parallel_grads(ours, config, group)
        counts[f"ours{step}"] = c.calls
    a = [p.main_grad for m in theirs for p in m.parameters()]
    b = [p.main_grad for m in ours for p in m.parameters()]
    names = [n for m in ours for n, _ in m.named_parameters()]
    return {"equal": [torch.equal(x, y) for x, y in zip(a, b)],
            "changed": {n: not torch.equal(x, y) for n, x, y in zip(names, before, b)},
            "counts": counts}


def test_sums_over_tensor_parallel_equal_megatron_cores_in_one_copy():
    for res in run_on_ranks(_worker, 2):
        assert all(res["equal"]), res["equal"]
        # summed: the SP-marked trainable norm and bias, the row linear's bias, the q/k norm; left alone: the
        # linear's weight (TP-split, not marked) and a frozen marked weight
        assert res["changed"] == {"norm.weight": True, "norm.bias": True, "proj.weight": False, "proj.bias": True,
                                  "q_layernorm.weight": True, "q_layernorm.bias": True, "frozen.weight": False,
                                  "frozen.bias": False}, res["changed"]
        for step in range(2):
            mcore, ours = res["counts"][f"mcore{step}"], res["counts"][f"ours{step}"]
            assert mcore.get("copy_") == 10, mcore  # 5 summed parameters in each of 2 chunks, one copy_ each
            assert ours.get("copy_", 0) == 0 and ours.get("_foreach_copy_") == 1, ours
