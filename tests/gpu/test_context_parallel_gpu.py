"""Context parallelism's attention on CUDA in bf16: each rank's two local query chunks over their causal key
prefixes (SDPA's lower-right causal bias) equal those rows of whole-sequence causal attention, with GQA,
forward and backward, on flash kernels (no math fallback); on two GPUs, the NCCL gather of keys and values
and its reduce-scatter backward.

    python -m pytest -q tests/gpu/test_context_parallel_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, GROUPS = 8, 2


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _attention(head_dim):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.layers.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * head_dim, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, kv_channels=head_dim, attention_dropout=0.0)
    return SDPAttention(cfg, 1, AttnMaskType.causal, "self").eval()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cp", [2, 4])
def test_local_chunks_are_rows_of_whole_causal_attention(cp, head_dim, monkeypatch):
    """One GPU stands in for every CP rank: the gather hands back the whole keys and values, so each rank's
    output rows and the sum over ranks of the key/value gradients must equal whole-sequence attention's."""
    from megatron_plugin.layers import attention
    from megatron_plugin.layers.context_parallel import cp_index

    s, b = 1024, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, b, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for n in (HEADS, GROUPS, GROUPS))
    w = torch.randn(s, b, HEADS * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    # reference: fp32 causal attention over the whole sequence, from the same bf16 values
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (qr, kr, vr)), is_causal=True,
                                         enable_gqa=True).permute(2, 0, 1, 3).reshape(s, b, -1)
    (ref * w.float()).sum().backward()

    whole_k, whole_v = k.clone().requires_grad_(), v.clone().requires_grad_()
    gathered = iter([])
    monkeypatch.setattr(attention, "gather_sequence", lambda t, cp_size, dim: next(gathered))
    attn = _attention(head_dim)
    attn.cp_size = cp
    kernels = set()
    for r in range(cp):
        index = cp_index(s, cp, r, device="cuda")
        attn.cp_rank = r
        gathered = iter([whole_k, whole_v])
        q_local = q[index].clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = attn(q_local, k[index], v[index], None)
            (out.float() * w[index].float()).sum().backward()
            torch.cuda.synchronize()
        kernels |= {e.name for e in prof.events()}
        assert _rel(out, ref[index]) < 2e-2, (r, _rel(out, ref[index]))
        assert _rel(q_local.grad, qr.grad[index]) < 2e-2, r
    assert _rel(whole_k.grad, kr.grad) < 2e-2 and _rel(whole_v.grad, vr.grad) < 2e-2
    assert any("flash" in n.lower() for n in kernels), sorted(kernels)
    assert not any("softmax" in n.lower() for n in kernels), sorted(kernels)  # no math fallback


def _nccl_gather_worker():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_plugin.engine.distributed import init_process_group
    from megatron_plugin.layers.context_parallel import cp_index, gather_sequence, unshard

    init_process_group()
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    cp, r = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    s = 64
    whole = torch.randn(s, 3, 5, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    weights = torch.randn(s, 3, 5, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1 + r))
    index = cp_index(s, cp, r, device="cuda")
    local = whole[index].clone().requires_grad_()
    got = gather_sequence(local, cp, 0)
    (got * weights).sum().backward()  # a different consumer on each rank: the gradient is the sum over ranks
    everyone = weights.clone()
    dist.all_reduce(everyone)
    on_dim1 = unshard(whole[index].transpose(0, 1).contiguous(), 1)
    return torch.equal(got.detach(), whole), torch.allclose(local.grad, everyone[index]), torch.equal(
        on_dim1, whole.transpose(0, 1))


@pytest.mark.two_gpus
def test_nccl_gather_and_reduce_scatter():
    for ok in run_on_ranks(_nccl_gather_worker, 2):
        assert ok == (True, True, True)
