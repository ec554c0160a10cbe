"""The MoE layer (`layers/moe.py`) against transformers' sparse MoE blocks: one layer of each family
(Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE) in fp32 on CPU, alone and split over
EP=2, TP=2 with sequence parallelism and TP=2 x EP=2; HF's load-balancing loss from the router
statistics; capacity dropping."""

import types

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_on_ranks

H, FFN, SHARED, E, K = 32, 24, 40, 8, 2
S, B = 8, 2


def _hf_block(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E,
                                                    num_experts_per_tok=K))
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FFN, num_experts=E,
                                                      num_experts_per_tok=K, shared_expert_intermediate_size=SHARED,
                                                      norm_topk_prob=False))
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=FFN, num_experts=E,
                                                      num_experts_per_tok=K, norm_topk_prob=True))
    with torch.no_grad():
        for p in block.parameters():  # HF leaves the stacked experts uninitialized (torch.empty)
            p.normal_(0.0, 0.2)
    return block.float()


def _config(family: str, tp: int = 1, ep: int = 1, sp: bool = False, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN,
               moe_router_pre_softmax=family == "qwen2_moe", moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
    if family == "qwen2_moe":
        moe.update(moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)
    moe.update(extra)
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN,
                             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                             bias_activation_fusion=False, use_cpu_initialization=True, perform_initialization=False,
                             tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=sp,
                             params_dtype=torch.float32, **moe)


def _start(tp: int = 1, ep: int = 1):
    from megatron.core import parallel_state

    from megatron_plugin import patches
    from megatron_plugin.engine.distributed import init_process_group

    # what prepare installs on CPU (undone after each task by tests/spawn.py): megatron-core's sequence-parallel
    # collectives over gloo
    patches.install(*patches.for_run("cpu", wgrad_fusion=False, rotary=False))
    init_process_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def _shard(t, dim, size, rank, interleave=1):
    """The TP rank's slice of `t` along `dim`; interleave=2: [gate; up] cut per rank (mcore's fused fc1)."""
    parts = t.chunk(interleave, dim=dim)
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in parts], dim=dim)


def _copy_weights(layer, hf, family):
    """HF's block into our layer, each rank its experts and its tensor-parallel slices."""
    from megatron.core import parallel_state as ps

    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        layer.router.weight.copy_(hf.gate.weight)
        for local, g in enumerate(layer.local_expert_indices):
            expert = layer.experts.local_experts[local]
            expert.linear_fc1.weight.copy_(_shard(hf.experts.gate_up_proj[g], 0, etp, etp_rank, interleave=2))
            expert.linear_fc2.weight.copy_(_shard(hf.experts.down_proj[g], 1, etp, etp_rank))
        if family == "qwen2_moe":
            se = hf.shared_expert
            fc1 = torch.cat([se.gate_proj.weight, se.up_proj.weight])
            layer.shared_experts.linear_fc1.weight.copy_(_shard(fc1, 0, tp, tp_rank, interleave=2))
            layer.shared_experts.linear_fc2.weight.copy_(_shard(se.down_proj.weight, 1, tp, tp_rank))
            layer.shared_experts.gate_weight.copy_(hf.shared_expert_gate.weight)


def _hf_grads(hf, family):
    out = {"router": hf.gate.weight.grad, "fc1": hf.experts.gate_up_proj.grad, "fc2": hf.experts.down_proj.grad}
    if family == "qwen2_moe":
        se = hf.shared_expert
        out.update(shared_fc1=torch.cat([se.gate_proj.weight.grad, se.up_proj.weight.grad]),
                   shared_fc2=se.down_proj.weight.grad, shared_gate=hf.shared_expert_gate.weight.grad)
    return out


def _close(a, b, tol=1e-5):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) < tol


def _compare_worker(family, tp, ep, sp, mask_tokens):
    """Our layer (this rank's part) against HF's block on the whole batch: outputs, input and weight
    gradients (the SP-replicated ones summed over TP, as the engine does), router statistics."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugin.layers.moe import padding_mask_from_hf
    from megatron_plugin.layers.spec import moe_mlp_spec

    _start(tp, ep)
    cfg = _config(family, tp, ep, sp)
    layer = build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1)
    hf = _hf_block(family)
    _copy_weights(layer, hf, family)

    torch.manual_seed(1)
    x = torch.randn(B, S, H)
    probe = torch.randn(B, S, H)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, S - mask_tokens:] = 0

    x_hf = x.clone().requires_grad_(True)
    ref = hf(x_hf)
    (ref * probe).sum().backward()

    tp_rank = ps.get_tensor_model_parallel_rank()
    # data parallel (EP ranks are data-parallel ranks of the dense part): each its rows of the batch,
    # so the gathered tokens of the EP group are the whole batch once
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    x, probe, attention_mask, ref, gx_all = (t.chunk(dp, dim=0)[dp_rank] for t in
                                             (x, probe, attention_mask, ref.detach(), x_hf.grad))
    # mcore's layout: [s, b, H]; under SP each TP rank holds a slice of the sequence
    xs = x.transpose(0, 1)
    pad = padding_mask_from_hf(attention_mask) if mask_tokens else None
    if sp:
        xs = xs.chunk(tp, dim=0)[tp_rank]
        pad = None if pad is None else pad.chunk(tp, dim=1)[tp_rank]
    xs = xs.contiguous().requires_grad_(True)
    # TP > 1 without SP: inference only (generation, log-probs); mcore refuses to train so
    forward_only = tp > 1 and not sp
    layer.train(not forward_only)
    out, bias = layer(xs, padding_mask=pad)
    assert bias is None
    probe_s = probe.transpose(0, 1)
    ref_s = ref.transpose(0, 1)
    gx_ref = gx_all.transpose(0, 1)
    if sp:
        probe_s, ref_s, gx_ref = (t.chunk(tp, dim=0)[tp_rank] for t in (probe_s, ref_s, gx_ref))
    if forward_only:
        st = layer.router.stats
        return {k: v for k, v in dict(out=_close(out.detach(), ref_s), tokens=float(st.tokens) == S * B - mask_tokens,
                                      counts=float(st.counts.sum()) == (S * B - mask_tokens) * K).items()
                if not v} or "ok"
    (out * probe_s.contiguous()).sum().backward()

    def summed_over_dp(g):
        g = g.clone()
        dist.all_reduce(g, group=ps.get_data_parallel_group())
        return g

    def summed_over_tp_dp(g):
        g = summed_over_dp(g)
        if sp and tp > 1:
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        return g

    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    g = _hf_grads(hf, family)
    checks = {"out": _close(out.detach(), ref_s), "dx": _close(xs.grad, gx_ref),
              "router": _close(summed_over_tp_dp(layer.router.weight.grad), g["router"])}
    for local, ge in enumerate(layer.local_expert_indices):
        expert = layer.experts.local_experts[local]
        checks[f"fc1_{ge}"] = _close(expert.linear_fc1.weight.grad, _shard(g["fc1"][ge], 0, etp, etp_rank, 2))
        checks[f"fc2_{ge}"] = _close(expert.linear_fc2.weight.grad, _shard(g["fc2"][ge], 1, etp, etp_rank))
    if family == "qwen2_moe":
        se = layer.shared_experts
        checks["shared_fc1"] = _close(summed_over_dp(se.linear_fc1.weight.grad),
                                      _shard(g["shared_fc1"], 0, tp, tp_rank, 2))
        checks["shared_fc2"] = _close(summed_over_dp(se.linear_fc2.weight.grad),
                                      _shard(g["shared_fc2"], 1, tp, tp_rank))
        checks["shared_gate"] = _close(summed_over_tp_dp(se.gate_weight.grad), g["shared_gate"])

    # router statistics: HF's router on this rank's rows (the whole micro-batch of its TP group)
    with torch.no_grad():
        logits, _, idx = hf.gate(x.reshape(-1, H))
        valid = attention_mask.reshape(-1).float()
        counts = torch.zeros(E).scatter_add_(0, idx.reshape(-1), valid.repeat_interleave(K))
        prob_sum = (torch.softmax(logits, -1) * valid[:, None]).sum(0)
        z_sum = (torch.logsumexp(logits, -1).square() * valid).sum()
    st = layer.router.stats
    checks["counts"] = torch.equal(st.counts, counts)
    checks["tokens"] = float(st.tokens) == float(valid.sum())
    checks["prob_sum"] = _close(st.prob_sum.detach(), prob_sum)
    checks["z_sum"] = _close(st.z_sum.detach(), z_sum)
    checks["dropped"] = float(st.dropped) == 0.0
    return {k: v for k, v in checks.items() if not v} or "ok"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_one_layer_matches_hf(family):
    """fp32, one process: outputs, input and weight gradients within 1e-5 (relative) of HF's block,
    with padding left out of the router statistics."""
    assert run_on_ranks(_compare_worker, 1, family, 1, 1, False, 3) == ["ok"]


@pytest.mark.parametrize("family,tp,ep,sp", [
    ("qwen2_moe", 1, 2, False),   # EP=2: each rank half the experts, tokens all-gathered over EP
    ("qwen2_moe", 2, 1, True),    # TP=2 + SP with the shared expert: our linears gather/scatter on gloo
    ("mixtral", 2, 1, True),      # TP=2 + SP: experts split over expert-TP, sequence split over TP
    ("qwen2_moe", 2, 1, False),   # TP=2 without SP: forward only (what generation runs)
])
def test_two_ranks_match_hf(family, tp, ep, sp):
    assert run_on_ranks(_compare_worker, 2, family, tp, ep, sp, 2) == ["ok"] * 2


def test_tp2_ep2_matches_hf():
    assert run_on_ranks(_compare_worker, 4, "qwen2_moe", 2, 2, True, 2) == ["ok"] * 4


def _lb_worker():
    """hf_load_balancing_loss over 2 layers' statistics equals transformers' load_balancing_loss_func on
    the same router logits, with and without an attention mask, and so do the gradients it sends to the
    router weights; z_loss equals megatron-core's z_loss_func summed over layers."""
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    from megatron.core.transformer.spec_utils import build_module
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from megatron_plugin.layers.moe import hf_load_balancing_loss, moe_routers, padding_mask_from_hf, z_loss
    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config("qwen3_moe")
    layers = torch.nn.ModuleList([build_module(moe_mlp_spec(cfg), config=cfg, layer_number=i + 1) for i in range(2)])
    hfs = [_hf_block("qwen3_moe", seed=i) for i in range(2)]
    for layer, hf in zip(layers, hfs):
        _copy_weights(layer, hf, "qwen3_moe")
    assert moe_routers(layers) == [layers[0].router, layers[1].router]
    torch.manual_seed(2)
    xs = [torch.randn(B, S, H) for _ in range(2)]
    results = {}
    for masked in (False, True):
        mask = torch.ones(B, S, dtype=torch.long)
        if masked:
            mask[0, :3] = 0
        hf_logits = tuple(hf.gate(x.reshape(-1, H))[0] for hf, x in zip(hfs, xs))
        ref = load_balancing_loss_func(hf_logits, E, K, mask if masked else None)
        ref.backward()
        pad = padding_mask_from_hf(mask) if masked else None
        for layer, x in zip(layers, xs):
            layer(x.transpose(0, 1).contiguous(), padding_mask=pad)
        stats = [r.stats for r in moe_routers(layers)]
        ours = hf_load_balancing_loss(stats, E, K)
        ours.backward()
        z_ref = sum(z_loss_func(lg.detach(), 1.0, padding_mask=None if pad is None else pad.reshape(-1))
                    for lg in hf_logits)
        results[masked] = dict(
            loss=_close(ours.detach(), ref.detach(), 1e-6),
            grads=all(_close(layer.router.weight.grad, hf.gate.weight.grad, 1e-5) for layer, hf in zip(layers, hfs)),
            z=_close(z_loss(stats).detach(), z_ref, 1e-6),
            nonzero=float(ref) > 0,
        )
        for m in list(layers) + hfs:
            m.zero_grad(set_to_none=True)
    return results


def test_hf_load_balancing_loss():
    (res,) = run_on_ranks(_lb_worker, 1)
    assert res == {m: dict(loss=True, grads=True, z=True, nonzero=True) for m in (False, True)}, res


def _capacity_worker():
    """With a capacity factor, assignments over an expert's capacity are dropped: a token whose experts
    all dropped it gets a zero routed output, the others HF's output restricted to the kept experts; the
    statistics count the drops."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config("mixtral", moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    layer = build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1)
    hf = _hf_block("mixtral")
    _copy_weights(layer, hf, "mixtral")
    torch.manual_seed(3)
    x = torch.randn(S, B, H)
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        out, _ = layer(x)
        out = out.reshape(-1, H)
        xt = x.reshape(-1, H)
        # what the kept assignments give, expert by expert, as HF computes one expert
        expected = torch.zeros_like(xt)
        for e in range(E):
            rows = routing_map[:, e].nonzero().flatten()
            gate, up = F.linear(xt[rows], hf.experts.gate_up_proj[e]).chunk(2, dim=-1)
            expected[rows] += F.linear(F.silu(gate) * up, hf.experts.down_proj[e]) * probs[rows, e, None]
    st = layer.router.stats
    capacity = -(-S * B * K * 0.5 // E)
    dropped_rows = ~routing_map.any(dim=1)
    return dict(
        within_capacity=bool((routing_map.sum(0) <= capacity).all()),
        some_dropped=float(st.dropped) > 0,
        dropped_counted=float(st.dropped) == float(S * B * K - routing_map.sum()),
        fraction=abs(float(st.dropped_fraction) - float(st.dropped) / (S * B * K)) < 1e-7,
        zero_when_all_dropped=bool(dropped_rows.any()) and bool((out[dropped_rows] == 0).all()),
        kept_match=_close(out, expected),
    )


def test_capacity_drops_tokens():
    (res,) = run_on_ranks(_capacity_worker, 1)
    assert all(res.values()), res


def _grouped_worker():
    """The grouped-GEMM expert path (`grouped_expert_mlp`, what `Experts` runs on CUDA in bf16) computes
    what mcore's loop over the experts computes, gradients included, with an expert that gets no token;
    on CPU in fp32, where torch's grouped GEMM also runs."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugin.layers.moe import grouped_expert_mlp
    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config("qwen3_moe")
    layer = build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1)
    _copy_weights(layer, _hf_block("qwen3_moe"), "qwen3_moe")
    experts = layer.experts
    torch.manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1, 2, 4, 1, 2])
    x = torch.randn(int(counts.sum()), H)
    probs = torch.rand(int(counts.sum()))
    probe = torch.randn(int(counts.sum()), H)

    def run(fn):
        xx = x.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        (fn(xx) * probe).sum().backward()
        grads = [p.grad.clone() for e in experts.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
        return fn(x).detach(), xx.grad, grads

    loop = run(lambda xx: experts(xx, counts, probs)[0])
    fc1 = [e.linear_fc1.weight for e in experts.local_experts]
    fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    grouped = run(lambda xx: grouped_expert_mlp(xx, fc1, fc2, counts, probs))
    # gradient_accumulation_fusion: the weight gradients land in main_grad, on top of what it held
    for w in fc1 + fc2:
        w.main_grad = torch.ones_like(w)
    xx = x.clone().requires_grad_(True)
    (grouped_expert_mlp(xx, fc1, fc2, counts, probs, fuse_wgrad=True) * probe).sum().backward()
    fused = [w.main_grad - 1 for e in experts.local_experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)]
    marked = all(w.grad_added_to_main_grad for w in fc1 + fc2)
    return dict(out=_close(grouped[0], loop[0]), dx=_close(grouped[1], loop[1]),
                dw=all(_close(a, b) for a, b in zip(grouped[2], loop[2])),
                fused_dx=_close(xx.grad, loop[1]), marked=marked,
                fused_dw=all(_close(a, b) for a, b in zip(fused, loop[2]) if b.abs().max() > 0),
                unrouted_expert_no_grad=float(loop[2][2].abs().sum()) == 0.0 and float(fused[2].abs().sum()) == 0.0)


def test_grouped_gemm_path_matches_the_loop():
    (res,) = run_on_ranks(_grouped_worker, 1)
    assert all(res.values()), res


def _grouped_bf16_layer():
    """A Qwen3-MoE layer with HF's weights in bf16, on the grouped-GEMM path with the fused weight gradient
    (the checks that keep that path to CUDA switched off: torch's grouped GEMM runs on CPU)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_plugin.layers import moe
    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config("qwen3_moe")
    layer = build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1)
    _copy_weights(layer, _hf_block("qwen3_moe"), "qwen3_moe")
    layer = layer.bfloat16()
    cfg.gradient_accumulation_fusion = True
    moe.Experts._can_group = lambda self, x: True
    moe.Experts._weights_can_group = lambda self: True
    return layer


def _compiled_worker():
    """The MoE layer on its grouped-GEMM path compiles as ONE graph (fullgraph=True: a graph break raises),
    in bf16 through AOT autograd, forward and backward, and computes what eager computes, with the fused
    weight gradient (`_GroupedLinear`'s op, opaque to the compiler, adding into main_grad).
    A graph break there split each transformer layer into 14 compiled frames on the GPU (issue 26)."""
    layer = _grouped_bf16_layer()
    weights = list(layer.experts.parameters())
    torch.manual_seed(5)
    x0 = torch.randn(S, B * 4, H, dtype=torch.bfloat16)

    def run(fn):
        # main_grads as views of one buffer, as DDP's: they share one version counter
        buffer = torch.zeros(sum(w.numel() for w in weights))
        views = buffer.split([w.numel() for w in weights])
        for w, view in zip(weights, views):
            w.main_grad = view.view(w.shape)
            w.grad = None
        x = x0.clone().requires_grad_(True)
        out = fn(x)[0]
        buffer.add_(0.0)  # another weight's gradient lands in the buffer between forward and backward
        out.float().square().sum().backward()
        return out.detach().float(), x.grad.float(), torch.cat([w.main_grad.flatten() for w in weights])

    eager = run(layer)
    compiled = run(torch.compile(layer, backend="aot_eager", fullgraph=True))
    marked = all(w.grad_added_to_main_grad for w in weights)
    return dict(diffs=[float((a - b).abs().max()) for a, b in zip(eager, compiled)],
                dw_nonzero=float(compiled[2].abs().max()) > 0, marked=marked)


def test_grouped_layer_compiles_as_one_graph():
    (res,) = run_on_ranks(_compiled_worker, 1)
    assert res.pop("diffs") == [0.0, 0.0, 0.0] and all(res.values()), res


def test_expert_slots_is_the_stable_sort():
    """The counting sort of the dispatcher (`expert_slots`) gives exactly the permutation a stable sort of
    the (token, expert) pairs by expert gives, and the token counts."""
    from megatron_plugin.layers.moe import expert_slots

    torch.manual_seed(0)
    for tokens, experts, k in ((37, 8, 2), (1000, 32, 4), (5, 4, 4), (64, 16, 1)):
        top = torch.randn(tokens, experts).topk(k, dim=1).indices
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
        order, slots, top_i, per_expert = expert_slots(routing_map, k)
        ref_top = torch.topk(routing_map.float(), k, dim=1).indices
        ref_order = torch.argsort(ref_top.reshape(-1), stable=True)
        assert torch.equal(top_i, ref_top)
        assert torch.equal(order, ref_order)
        assert torch.equal(slots[order], torch.arange(tokens * k))
        assert torch.equal(per_expert.long(), routing_map.sum(0))


def _stacked_worker():
    """The engine's path (`stack_experts_each_forward`): hooks on the model stack the expert weights before
    each forward into leaves made outside the compiled layer; the layer compiles as one graph over them
    (fullgraph), the per-expert weights never enter the graph (no .grad), and the stacked gradient lands in
    each expert's main_grad: equal to the eager per-expert path's, across two forwards (the stacks refilled)."""
    from megatron_plugin.layers import moe

    layer = _grouped_bf16_layer()
    weights = list(layer.experts.parameters())
    torch.manual_seed(5)
    x0 = torch.randn(S, B * 4, H, dtype=torch.bfloat16)

    def run(fn, steps=2):
        for w in weights:
            w.main_grad = torch.zeros(w.shape)
            w.grad = None
        for _ in range(steps):
            x = x0.clone().requires_grad_(True)
            out = fn(x)[0]
            out.float().square().sum().backward()
        return out.detach().float(), x.grad.float(), torch.cat([w.main_grad.flatten() for w in weights])

    eager = run(layer)

    class Model(torch.nn.Module):  # the engine hooks the (uncompiled) model; its layers are compiled
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return compiled(x)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    model = Model()
    moe.stack_experts_each_forward(model)
    stacked = run(model)
    return dict(diffs=[float((a - b).abs().max() / b.abs().max()) for a, b in zip(eager, stacked)],
                no_weight_grad=all(w.grad is None for w in weights),
                stacks_dropped=layer.experts._stacks is None,
                stacks_kept=layer.experts._stack_store is not None)


def test_stacked_experts_compile_and_feed_main_grad():
    (res,) = run_on_ranks(_stacked_worker, 1)
    # the same grouped GEMMs on the same bf16 values: bit for bit (outputs, input and weight gradients)
    assert res.pop("diffs") == [0.0, 0.0, 0.0] and all(res.values()), res


def _compile_kwargs_worker():
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.engine.gpu import wants_cpp_wrapper
    from megatron_plugin.layers import fp8
    from megatron_plugin.layers.spec import moe_mlp_spec

    _start()
    cfg = _config("qwen3_moe")
    moe_layer = torch.nn.Sequential(build_module(moe_mlp_spec(cfg), config=cfg, layer_number=1))
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))  # no TransformerConfig: not a transformer layer

    def layer_with(**sizes):
        """A dense transformer layer's stand-in: a module carrying a real TransformerConfig (whose __post_init__
        sets expert_tensor_parallel_size to TP, as the models' configs have it)."""
        m = torch.nn.Linear(4, 4)
        m.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **sizes)
        return m

    def moe_at(**sizes):
        """The MoE layer's rule at other parallel sizes (its config read, not its modules rebuilt)."""
        built = moe_layer[0].config
        moe_layer[0].config = _config("qwen3_moe", **sizes)
        try:
            return wants_cpp_wrapper(moe_layer, {})
        finally:
            moe_layer[0].config = built

    fp8_layer = layer_with()
    setattr(fp8_layer, fp8.ATTR, object())  # a linear carrying FP8 state (layers/fp8.attach_fp8)
    return dict(
        dense_layer=wants_cpp_wrapper(layer_with(), {}),
        dense_tp2=wants_cpp_wrapper(layer_with(tensor_model_parallel_size=2), {}),
        dense_tp2_overlap=wants_cpp_wrapper(layer_with(tensor_model_parallel_size=2, sequence_parallel=True,
                                                       tp_comm_overlap=True), {}),
        dense_cp2=wants_cpp_wrapper(layer_with(context_parallel_size=2), {}),
        dense_user_mode=wants_cpp_wrapper(layer_with(), {"mode": "reduce-overhead"}),
        dense_fp8=wants_cpp_wrapper(fp8_layer, {}),
        plain=wants_cpp_wrapper(moe_layer, {}),
        default_mode=wants_cpp_wrapper(moe_layer, {"backend": "inductor", "mode": "default"}),
        user_mode=wants_cpp_wrapper(moe_layer, {"mode": "max-autotune-no-cudagraphs"}),
        user_options=wants_cpp_wrapper(moe_layer, {"options": {"cpp_wrapper": False}}),
        other_backend=wants_cpp_wrapper(moe_layer, {"backend": "aot_eager"}),
        dense=wants_cpp_wrapper(dense, {}),
        moe_tp2=moe_at(tp=2),  # expert TP = 2 too (mcore's default): the dispatcher's collectives
        moe_ep2=moe_at(ep=2),
    )


def test_layers_compile_with_the_cpp_wrapper():
    """The CUDA engine compiles transformer layers (MoE or dense) with Inductor's C++ wrapper (the step is bound by
    kernel launches on the host) unless a collective inside them would run in the wrapper's tuning run (CP; MoE
    at TP or EP > 1; dense TP's ops skip that run, and two H200s timed TP = 2 8% faster under it) or they run
    tp_comm_overlap or FP8 (those keep the Python wrapper, which their GPU tests cover), or the user chose a mode,
    options or another backend. Real TransformerConfigs: mcore sets a dense layer's expert TP to its TP."""
    (got,) = run_on_ranks(_compile_kwargs_worker, 1)
    assert got == dict(dense_layer=True, dense_tp2=True, dense_tp2_overlap=False, dense_cp2=False,
                       dense_user_mode=False, dense_fp8=False, moe_tp2=False, moe_ep2=False,
                       plain=True, default_mode=True, user_mode=False, user_options=False, other_backend=False, dense=False), got
