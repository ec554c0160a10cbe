"""An experiment for issue 32's TP = 2 + SP row, not a setting: DeepSpeed Domino's overlap left to Inductor.

Each compiled transformer layer runs its micro-batch as two halves (along the batch) in one graph, and the SP
linears' collectives are torch's functional collectives, which Inductor sees and can schedule (our own ops are
opaque to it and wait where they are issued). Whether Inductor then runs one half's collectives under the other
half's GEMMs, forward and backward, is what `benchmarks/compiler_overlap_probe.py` asks on a stand-in layer and
`train_throughput.py --domino MODE` times on the real model. Patched in the benchmark's process only.
Its answer (two H200s, 2026-11-30): on the stand-in, forward and backward, the halves run 0.87-0.99x the whole
compiled batch and `hand` 0.91x; on the real model `hand` with its collectives on the copy engines
(benchmarks/ce_collectives_patch.py) ran 1.01x the plain step, inside the rows' spread. No setting.

Modes: `visible` (functional collectives, whole batch: the control), `halves` (two halves, Inductor's default
order), `halves_reorder` (its reordering passes: sink waits, raise collectives, compute for overlap),
`halves_sched` (its overlap scheduler, without FSDP-minded bucketing), `hand` (DeepSpeed Domino's own way, not
Inductor's: the layer written out for two halves, run eagerly, each SP collective asynchronous in both directions
as a pair of autograd nodes; GPT-2-style layers, other layers as before).

    PYTHONPATH=. python benchmarks/domino_patch.py

checks the patched path's numbers on CPU (two gloo ranks, TP = 2 + SP, the compiled path's ops run eagerly): the
same three losses as the plain engine, the functional collectives and the halves counted.
"""

from __future__ import annotations

MODES = ("visible", "halves", "halves_reorder", "halves_sched", "hand")


class _Box:
    """One collective's handles: its work forward, its reverse's work and result backward."""
    work = back_work = back_out = None


def _issue(kind, x, group):
    from megatron_plugin.layers import compiled_linear

    dist = compiled_linear.dist  # torch.distributed, or SP's collectives on the copy engines (ce_collectives_patch)
    x = x.contiguous()
    if kind == "gather":
        out = x.new_empty(x.shape[0] * group.size(), *x.shape[1:])
        return out, dist.all_gather_into_tensor(out, x, group=group, async_op=True)
    out = x.new_empty(x.shape[0] // group.size(), *x.shape[1:])
    return out, dist.reduce_scatter_tensor(out, x, group=group, async_op=True)


def _autograd_pair():
    """(start, wait): an SP collective ("gather" along the sequence, or "scatter": the sum's share) issued
    asynchronously by `start` and waited for by `wait` where its result is first needed. Backward, `wait`'s node
    issues the reverse collective of its gradient and `start`'s node waits for it: whatever the autograd engine
    runs between the two (the other half's backward) runs under it."""
    import torch

    reverse = {"gather": "scatter", "scatter": "gather"}

    class Start(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, kind, group, box):
            ctx.box = box
            out, box.work = _issue(kind, x, group)
            return out

        @staticmethod
        def backward(ctx, _):
            ctx.box.back_work.wait()
            return ctx.box.back_out, None, None, None

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, kind, group, box):
            ctx.kind, ctx.group, ctx.box = kind, group, box
            box.work.wait()
            return out.view_as(out)

        @staticmethod
        def backward(ctx, grad):
            ctx.box.back_out, ctx.box.back_work = _issue(reverse[ctx.kind], grad, ctx.group)
            return grad, None, None, None  # carries the order only: Start returns the collective's result

    def start(x, kind, group):
        box = _Box()
        return Start.apply(x, kind, group, box), kind, group, box

    def wait(started):
        return Wait.apply(*started)

    return start, wait


def install(mode: str) -> None:
    import torch
    import torch._inductor.config as inductor
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed import _functional_collectives as fc

    from megatron_plugin.layers import compiled_linear, linear

    assert mode in MODES, mode
    # torch 2.13's name (2.11's, on the GPU machines, is the older one, deprecated in 2.13)
    gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    scatter_autograd = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
    ops_linear = linear._ops_linear

    def visible_ops_linear(layer, input, weight, kwargs):
        # the column linear under SP: the sequence gather as a functional collective, then the local linear
        # (its input gradient traced, its weight gradient still the fused op into main_grad)
        gather_input, _ = compiled_linear.column_args(kwargs)
        if not (linear._as_ops(layer) and gather_input and layer.tp_group.size() > 1):
            return ops_linear(layer, input, weight, kwargs)
        full = gather_autograd(input.contiguous(), 0, layer.tp_group)
        return compiled_linear.parallel_linear(full, weight, kwargs.get("bias"), "", False, compiled_linear.DGRAD_NONE,
                                               fuse_wgrad=bool(kwargs.get("gradient_accumulation_fusion")))

    row_ops_forward = linear.RowParallelLinear._ops_forward

    def visible_row_ops_forward(self, input_):
        if not self.sequence_parallel or linear._overlaps(self):
            return row_ops_forward(self, input_)
        out = compiled_linear.parallel_linear(input_, self.weight, None, "", fuse_wgrad=self.gradient_accumulation_fusion)
        out = scatter_autograd(out, "sum", 0, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    linear._ops_linear = visible_ops_linear
    linear.RowParallelLinear._ops_forward = visible_row_ops_forward
    if mode == "visible":
        return
    if mode == "hand":  # the plain ops where the hand-written layer does not run
        linear._ops_linear = ops_linear
        linear.RowParallelLinear._ops_forward = row_ops_forward

    layer_forward = TransformerLayer.forward

    def halves_forward(self, *args, **kwargs):
        hidden = kwargs.get("hidden_states")
        if (args or not torch.compiler.is_compiling() or hidden is None or hidden.shape[1] < 2
                or kwargs.get("context") is not None or kwargs.get("packed_seq_params") is not None):
            return layer_forward(self, *args, **kwargs)
        b = hidden.shape[1]
        outs = []
        for half in range(2):
            part = dict(kwargs)
            rows = slice(half * (b // 2), b if half else b // 2)
            part["hidden_states"] = hidden[:, rows].contiguous()  # [s / TP, b, h]: the batch is dim 1
            for key in ("attention_mask", "padding_mask"):
                value = kwargs.get(key)
                if value is not None and value.shape[0] == b:
                    part[key] = value[rows]
            outs.append(layer_forward(self, **part))
        return torch.cat([o[0] for o in outs], dim=1), outs[0][1]

    TransformerLayer.forward = _hand_forward(layer_forward) if mode == "hand" else halves_forward
    if mode == "halves_reorder":
        inductor.reorder_for_compute_comm_overlap = True
        inductor.reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]
    elif mode == "halves_sched":
        if not hasattr(getattr(inductor, "aten_distributed_optimizations", None), "enable_overlap_scheduling"):
            raise SystemExit(f"torch {torch.__version__} has no Inductor overlap scheduler: --domino halves_sched")
        inductor.aten_distributed_optimizations.enable_overlap_scheduling = True
        inductor.aten_distributed_optimizations.pre_bucketing_fsdp_collectives = False


def _hand_forward(layer_forward):
    """TransformerLayer.forward with GPT-2-style layers under SP (self-attention without rotary or q/k norms,
    pre-norm, no cross-attention) run as DeepSpeed Domino runs them: the micro-batch in two halves along the batch,
    each stage's collectives of both halves issued before either half's compute waits for its own."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_plugin.layers import compiled_linear

    start, wait = _autograd_pair()

    def local(x, layer):  # the GEMM alone, its weight gradient into main_grad where the layer fuses it
        return compiled_linear.parallel_linear(x, layer.weight, None, "", False, compiled_linear.DGRAD_NONE,
                                               fuse_wgrad=bool(layer.gradient_accumulation_fusion))

    def add(residual, out, bias, p, training):
        out = out + bias if bias is not None else out
        return residual + F.dropout(out, p=p, training=training)

    def bias_act(h, bias, act, gated):
        h = h + bias if bias is not None else h
        if gated:
            gate, up = torch.chunk(h, 2, dim=-1)
            return act(gate) * up
        return act(h)

    if torch.cuda.is_available():  # the elementwise pieces fused, as in a compiled layer (compiled inside `run` too)
        add, bias_act = torch.compile(add, dynamic=False), torch.compile(bias_act, dynamic=False)

    @torch.compiler.disable
    def run(self, hidden, mask):
        att, mlp, cfg = self.self_attention, self.mlp, self.config
        group = att.linear_qkv.tp_group
        b = hidden.shape[1]
        rows = [slice(0, b // 2), slice(b // 2, b)]
        xs = [hidden[:, r].contiguous() for r in rows]
        masks = [mask[r] if mask is not None and mask.shape[0] == b else mask for r in rows]
        hn = att.hidden_size_per_attention_head
        per_group = att.num_attention_heads_per_partition // att.num_query_groups_per_partition
        gathers = [start(self.input_layernorm(x), "gather", group) for x in xs]
        scatters = []
        for full, m in zip(gathers, masks):
            mixed = local(wait(full), att.linear_qkv)
            if att.linear_qkv.bias is not None:
                mixed = mixed + att.linear_qkv.bias
            mixed = mixed.view(*mixed.shape[:2], att.num_query_groups_per_partition, (per_group + 2) * hn)
            q, k, v = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
            q = q.reshape(q.size(0), q.size(1), -1, hn)
            core = att.core_attention(q, k, v, m, attn_mask_type=att.attn_mask_type)
            scatters.append(start(local(core, att.linear_proj), "scatter", group))
        gathers = []
        for i in range(2):
            xs[i] = add(xs[i], wait(scatters[i]), att.linear_proj.bias, cfg.hidden_dropout, self.training)
            gathers.append(start(self.pre_mlp_layernorm(xs[i]), "gather", group))
        scatters = []
        for full in gathers:
            h = bias_act(local(wait(full), mlp.linear_fc1), mlp.linear_fc1.bias, mlp.activation_func,
                         bool(cfg.gated_linear_unit))
            scatters.append(start(local(h, mlp.linear_fc2), "scatter", group))
        outs = [add(x, wait(sc), mlp.linear_fc2.bias, cfg.hidden_dropout, self.training) for x, sc in zip(xs, scatters)]
        return torch.cat(outs, dim=1), None

    def forward(self, *args, **kwargs):
        hidden = kwargs.get("hidden_states")
        att = getattr(self, "self_attention", None)
        if (args or hidden is None or hidden.shape[1] < 2 or not self.config.sequence_parallel or att is None
                or att.linear_qkv.tp_group is None or att.linear_qkv.tp_group.size() < 2
                or not isinstance(self.cross_attention, IdentityOp)
                or not all(isinstance(n, (type(None), IdentityOp)) for n in (att.q_layernorm, att.k_layernorm))
                or att.config.num_query_groups < att.world_size
                or any(kwargs.get(k) is not None for k in ("rotary_pos_emb", "context", "packed_seq_params",
                                                           "inference_context", "attention_bias"))):
            return layer_forward(self, *args, **kwargs)
        return run(self, hidden, kwargs.get("attention_mask"))

    return forward


def _cpu_run(mode):
    from torch.distributed import _functional_collectives as fc

    from bench_steps import cpu_tp2_sp_losses

    calls = {"gathers": 0, "scatters": 0, "layer calls": 0}
    if mode:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        def counted(fn, key):
            def run(*args, **kwargs):
                calls[key] += 1
                return fn(*args, **kwargs)
            return run

        for names, key in ((("all_gather_single_autograd", "all_gather_tensor_autograd"), "gathers"),
                           (("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd"), "scatters")):
            for name in names:
                if hasattr(fc, name):
                    setattr(fc, name, counted(getattr(fc, name), key))
        TransformerLayer.forward = counted(TransformerLayer.forward, "layer calls")
        install(mode)
    return cpu_tp2_sp_losses(compiled_ops=bool(mode)), calls


if __name__ == "__main__":
    import os

    os.environ["MP_TEST_FRESH"] = "1"  # the patches stay in their processes
    from tests.spawn import run_on_ranks

    plain, _ = run_on_ranks(_cpu_run, 2, "")[0]
    for mode in ("visible", "halves", "hand"):
        losses, calls = run_on_ranks(_cpu_run, 2, mode)[0]
        print(f"{mode:8s} losses {losses} (plain {plain}); {calls}")
        assert max(abs(a - b) for a, b in zip(losses, plain)) < 1e-5, (mode, losses, plain)
        # the hand-written layers call no layer forward of megatron-core's and no functional collective
        assert (calls == {"gathers": 0, "scatters": 0, "layer calls": 0} if mode == "hand"
                else calls["gathers"] and calls["scatters"]), calls
