"""engine/gpu._distopt_direct_copies against megatron-core's own per-weight loops, on CPU.

megatron-core's DistributedOptimizer needs CUDA to be built, so this test hands mcore's two methods
(`_copy_model_grads_to_main_grads`, `_copy_main_params_to_model_params`) an optimizer object holding just the state
they read (bf16 and fp32 buffers, shards that start and end inside weights), and checks that our replacements
hand over the same gradient views and leave the parameter buffers bit for bit as mcore's do. On GPUs:
tests/gpu/test_optimizer_fields_gpu.py::test_distributed_optimizer_direct_copies_train_as_mcores_loops_bit_for_bit.

    python -m pytest -q tests/test_distributed_optimizer_copies.py
"""

import types

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

from megatron_plugin.engine.gpu import _distopt_direct_copies


def _optimizer(seed):
    """This rank's shard of two buckets: bf16 weights w1 (12) and w2 (5) in one, fp32 weight w3 (6) in the other.
    It owns w1[3:12], w2[0:2] and w3[2:6]."""
    g = torch.Generator().manual_seed(seed)
    buffers, gbuf_ranges, gbuf_map = [], [], {}
    owned = {}  # weight -> the fp32 master of its shard
    params = {}
    for gbuf, (dtype, sizes, shards) in enumerate([(torch.bfloat16, [12, 5], [(3, 12), (0, 2)]),
                                                   (torch.float32, [6], [(2, 6)])]):
        param_data = torch.randn(sum(sizes) + 3, generator=g).to(dtype)  # + padding, as mcore's buckets have
        param_map, offset, bucket_params = {}, 0, []
        for i, (size, (start, end)) in enumerate(zip(sizes, shards)):
            p = torch.nn.Parameter(param_data[offset:offset + size].view(size))
            p.main_grad = torch.randn(size, generator=g)
            param_map[p] = {"param": Range(start, end), "gbuf_world_in_bucket": Range(offset + start, offset + end)}
            gbuf_map[p] = (gbuf, dtype, 0)
            owned[p] = torch.randn(end - start, generator=g)
            params[f"{gbuf}.{i}"] = p
            bucket_params.append(p)
            offset += size
        buffers.append(types.SimpleNamespace(params=bucket_params, buckets=[types.SimpleNamespace(param_data=param_data)]))
        gbuf_ranges.append({dtype: [{"param_map": param_map}]})
    opt = DistributedOptimizer.__new__(DistributedOptimizer)
    opt.__dict__.update(
        is_stub_optimizer=False, data_parallel_group=None, buffers=buffers, gbuf_ranges=gbuf_ranges,
        model_param_gbuf_map=gbuf_map,
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False),
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
                                     reuse_grad_buf_for_mxfp8_param_ag=False),
        model_float16_groups=[[params["0.0"], params["0.1"]]],
        shard_fp32_from_float16_groups=[[owned[params["0.0"]], owned[params["0.1"]]]],
        model_fp32_groups=[[params["1.0"]]], shard_fp32_groups=[[owned[params["1.0"]]]])
    return opt


def _masters(opt):
    return [m for group in opt.shard_fp32_from_float16_groups + opt.shard_fp32_groups for m in group]


def _state(opt):
    return [m.grad for m in _masters(opt)], [b.buckets[0].param_data.clone() for b in opt.buffers]


def test_direct_copies_hand_over_and_copy_as_megatron_core_does():
    mcore, ours = _optimizer(0), _optimizer(0)
    _distopt_direct_copies(ours)
    assert {"_copy_model_grads_to_main_grads", "_copy_main_params_to_model_params"} <= set(ours.__dict__)
    for step in range(2):  # the second step reuses the places taken once
        for opt in (mcore, ours):
            for m in _masters(opt):
                m.grad = None
                m.data.add_(0.25 * (step + 1))  # an optimizer step's update of the masters
        DistributedOptimizer._copy_model_grads_to_main_grads(mcore)
        DistributedOptimizer._copy_main_params_to_model_params(mcore)
        ours._copy_model_grads_to_main_grads()
        ours._copy_main_params_to_model_params()
        (grads_a, bufs_a), (grads_b, bufs_b) = _state(mcore), _state(ours)
        weights = [p for group in ours.model_float16_groups + ours.model_fp32_groups for p in group]
        for a, b, w in zip(grads_a, grads_b, weights):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
            # handed over as a view of the weight's main_grad (DDP's buffer), as mcore's `.float()` of fp32 does
            assert b.untyped_storage().data_ptr() == w.main_grad.untyped_storage().data_ptr()
        for a, b in zip(bufs_a, bufs_b):
            assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    # the weights' own values are the buffers': the updated shards reached them, the rest stayed
    assert not torch.equal(_optimizer(0).buffers[0].buckets[0].param_data, bufs_b[0])


def test_other_paths_keep_megatron_cores_loops():
    opt = _optimizer(0)
    opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    _distopt_direct_copies(opt)
    assert "_copy_main_params_to_model_params" not in opt.__dict__
