"""An experiment for issue 32's TP = 2 + SP row, not a setting: DeepSpeed Domino's overlap left to Inductor.

Each compiled transformer layer runs its micro-batch as two halves (along the batch) in one graph, and the SP
linears' collectives are torch's functional collectives, which Inductor sees and can schedule (our own ops are
opaque to it and wait where they are issued). Whether Inductor then runs one half's collectives under the other
half's GEMMs, forward and backward, is what `benchmarks/compiler_overlap_probe.py` asks on a stand-in layer and
`train_throughput.py --domino MODE` times on the real model. Patched in the benchmark's process only.

Modes: `visible` (functional collectives, whole batch: the control), `halves` (two halves, Inductor's default
order), `halves_reorder` (its reordering passes: sink waits, raise collectives, compute for overlap),
`halves_sched` (its overlap scheduler, without FSDP-minded bucketing).

    PYTHONPATH=. python benchmarks/domino_patch.py

checks the patched path's numbers on CPU (two gloo ranks, TP = 2 + SP, the compiled path's ops run eagerly): the
same three losses as the plain engine, the functional collectives and the halves counted.
"""

from __future__ import annotations

MODES = ("visible", "halves", "halves_reorder", "halves_sched")


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

    TransformerLayer.forward = halves_forward
    if mode == "halves_reorder":
        inductor.reorder_for_compute_comm_overlap = True
        inductor.reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]
    elif mode == "halves_sched":
        if not hasattr(getattr(inductor, "aten_distributed_optimizations", None), "enable_overlap_scheduling"):
            raise SystemExit(f"torch {torch.__version__} has no Inductor overlap scheduler: --domino halves_sched")
        inductor.aten_distributed_optimizations.enable_overlap_scheduling = True
        inductor.aten_distributed_optimizations.pre_bucketing_fsdp_collectives = False


def _cpu_run(mode):
    import torch
    from torch.distributed import _functional_collectives as fc
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.models import tiny_gpt2
    from tests.training import optimizer_for, token_dataset

    calls = {"gathers": 0, "scatters": 0, "layer calls": 0}
    if mode:
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from megatron_plugin.layers import linear

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
        linear._as_ops = lambda layer: True  # the compiled layers' ops (CUDA, main_grad), eagerly on CPU
        torch.compiler.is_compiling = lambda: True
    model = tiny_gpt2()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, sequence_parallelism=True))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=6, warmup_num_steps=2),
        DataLoader(token_dataset(16, model.config.vocab_size), batch_size=4))
    engine.train()
    return [engine(**batch).loss.item() for batch, _ in zip(loader, range(3))], calls


if __name__ == "__main__":
    import os

    os.environ["MP_TEST_FRESH"] = "1"  # the patches stay in their processes
    from tests.spawn import run_on_ranks

    plain, _ = run_on_ranks(_cpu_run, 2, "")[0]
    for mode in ("visible", "halves"):
        losses, calls = run_on_ranks(_cpu_run, 2, mode)[0]
        print(f"{mode:8s} losses {losses} (plain {plain}); {calls}")
        assert max(abs(a - b) for a, b in zip(losses, plain)) < 1e-5, (mode, losses, plain)
        assert calls["gathers"] and calls["scatters"], calls
