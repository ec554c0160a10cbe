"""Megatron-Core's tensor-parallel linears, with what they lack without TE/apex and on CPU."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear as _McoreColumnParallelLinear
from megatron.core.tensor_parallel import RowParallelLinear as _McoreRowParallelLinear

from . import compiled_linear
from .fp8 import fp8_forward, state_of as fp8_state_of
from .lora import adapters_of, fused_column_forward, lora_delta
from .rng_fork import dropout_call
from .sp_comm import gather_first_dim


@torch.compiler.disable
def _outside_compiled_graph(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _as_ops(layer) -> bool:
    """Whether this linear runs as custom ops here: inside a compiled layer, when the weight gradient
    accumulates into main_grad (`gradient_accumulation_fusion`); see `compiled_linear.py`."""
    # an FP8 linear (layers/fp8.py) is its own autograd function (its weight gradient into main_grad by its own
    # op): it is traced, or with TP > 1 eager
    return (torch.compiler.is_compiling() and layer.config.gradient_accumulation_fusion
            and fp8_state_of(layer) is None)


def _forward(layer, parent_forward, *args, **kwargs):
    """Under torch.compile with TP > 1 the linear, with its collectives and mcore's custom autograd
    function (async all-gather/reduce-scatter into a shared buffer for SP), runs eagerly between the
    compiled pieces of the layer: compiled whole, TP=2 + SP trained to wrong losses on GPU. The GEMM
    gains nothing from compiling; the norms, attention and elementwise work around it stay compiled.
    As custom ops (`_as_ops`) it stays in the graph instead."""
    if (layer.tp_group is not None and layer.tp_group.size() > 1 and torch.compiler.is_compiling()
            and not _as_ops(layer)):
        return _outside_compiled_graph(parent_forward, *args, **kwargs)
    return parent_forward(*args, **kwargs)


def _with_lora(layer, out, input_):
    """The base output plus the LoRA adapters' (`layers/lora.py`), after the base's own reduction. Their
    TP collectives run where the linear's do: as ops inside the compiled graph (`_as_ops`), else eagerly
    between compiled pieces (see `_forward`)."""
    if not adapters_of(layer):
        return out
    output, bias = out
    if _as_ops(layer):
        delta = lora_delta(layer, input_, traced=True)
    elif layer.tp_group is not None and layer.tp_group.size() > 1 and torch.compiler.is_compiling():
        delta = _outside_compiled_graph(lora_delta, layer, input_)
    else:
        delta = lora_delta(layer, input_)
    return output + delta.to(output.dtype), bias


def _with_lora_shards(layer, sharded, prefix, sharded_offsets, metadata):
    """mcore's sharded state dict of a linear takes every tensor but its weight and bias as replicated
    over TP; an adapter's split tensor (column: lora_B along its rows; row: lora_A along its columns) is
    sharded like the weight instead, so that a distributed checkpoint holds each adapter whole."""
    adapters = getattr(layer, "lora_adapters", None)
    if not adapters:
        return sharded
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    own = {k: v for k, v in layer.state_dict(prefix="", keep_vars=True).items() if k.startswith("lora_adapters.")}
    axes = {}
    for name, a in adapters.items():
        column = a.parallel == "column"
        axes[f"lora_adapters.{name}.lora_{'B' if column else 'A'}"] = 0 if column else 1
    dp_cp_group = ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]
    sharded.update(make_sharded_tensors_for_checkpoint(own, prefix, axes, sharded_offsets, tp_group=layer.tp_group,
                                                       dp_cp_group=dp_cp_group))
    return sharded


def _ops_linear(layer, input, weight, kwargs):
    """The linear as `compiled_linear` ops (see `_as_ops`), with mcore's arguments; None when not."""
    if not _as_ops(layer):
        return None
    gather_input, dgrad = compiled_linear.column_args(kwargs)
    return compiled_linear.parallel_linear(
        input, weight, kwargs.get("bias"), compiled_linear.group_name(layer.tp_group), gather_input, dgrad,
        fuse_wgrad=bool(kwargs.get("gradient_accumulation_fusion")), overlap=_overlaps(layer),
    )


def _ops_or_fp8(layer, input, weight, kwargs):
    """The linear as `compiled_linear` ops (`_as_ops`) or in FP8 (layers/fp8.py), where either applies; None
    where megatron-core's own forward runs."""
    out = _ops_linear(layer, input, weight, kwargs)
    return out if out is not None else fp8_forward(layer, input, weight, kwargs)


def _overlaps(layer) -> bool:
    """Megatron's `tp_comm_overlap` (other_megatron_args; plugin.check_tp_comm_overlap says where it runs): SP's
    collectives overlapped with the GEMMs next to them (`compiled_linear._ag_matmul`, `_matmul_rs`)."""
    return bool(layer.config.tp_comm_overlap and layer.sequence_parallel)


def _fuse_only_with_main_grad(weight, kwargs):
    """mcore's gradient-accumulation fusion assumes the weight has a main_grad (DDP's fp32 buffer); a
    weight without one (run outside the GPU engine's DDP) takes the plain path."""
    if kwargs.get("gradient_accumulation_fusion") and not hasattr(weight, "main_grad"):
        kwargs["gradient_accumulation_fusion"] = False


def _cpu_sequence_parallel(layer, x) -> bool:
    """Sequence parallelism on CPU: mcore's column linear gathers the sequence inside its autograd function,
    into a CUDA buffer; on CPU ours gathers with `sp_comm` first (same autograd). The row linear's
    reduce-scatter goes through mcore's mappings, which the `cpu_sequence_parallel` patch routes to `sp_comm`."""
    return (layer.sequence_parallel and not layer.explicit_expert_comm and layer.tp_group is not None
            and layer.tp_group.size() > 1 and x.device.type == "cpu")


def _cast_for_cpu_autocast(input, weight, kwargs):
    """mcore's linear autograd functions declare autocast for CUDA only. Under CPU autocast their
    forward computes in bf16 but their backward multiplies the bf16 gradient with the fp32 weight and
    fails. Casting input, weight and bias before the function makes both directions run in the
    autocast dtype; the cast's own backward returns the weight gradient in fp32."""
    if input.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return input, weight
    dtype = torch.get_autocast_dtype("cpu")
    if kwargs.get("bias") is not None:
        kwargs["bias"] = kwargs["bias"].to(dtype)
    return input.to(dtype), weight.to(dtype)


class ColumnParallelLinear(_McoreColumnParallelLinear):
    """mcore's ColumnParallelLinear that also trains under CPU autocast (see `_cast_for_cpu_autocast`) and
    stays out of compiled graphs with TP > 1 (see `_forward`)."""

    def forward(self, input_, *args, **kwargs):
        if fp8_state_of(self) is None and not args and not kwargs:
            fused = fused_column_forward(self, input_)  # LoRA on a frozen weight at TP = 1: one GEMM
            if fused is not None:
                return fused
        return _with_lora(self, _forward(self, super().forward, input_, *args, **kwargs), input_)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _with_lora_shards(self, super().sharded_state_dict(prefix, sharded_offsets, metadata), prefix,
                                 sharded_offsets, metadata)

    def _forward_impl(self, input, weight, *args, **kwargs):
        out = _ops_or_fp8(self, input, weight, kwargs)
        if out is not None:
            return out
        if kwargs.get("sequence_parallel") and _cpu_sequence_parallel(self, input):
            # gathered here, the gradient of the gathered input is reduce-scattered by the gather's backward
            input = gather_first_dim(input, self.tp_group)
            kwargs["sequence_parallel"] = False
        _fuse_only_with_main_grad(weight, kwargs)
        input, weight = _cast_for_cpu_autocast(input, weight, kwargs)
        return super()._forward_impl(input, weight, *args, **kwargs)


class RowParallelLinear(_McoreRowParallelLinear):
    """mcore 0.16's RowParallelLinear hands `tp_group=None` to its matmul, which then raises a
    deprecation warning on every call: host time each step, and a graph break that keeps
    torch.compile from capturing a transformer layer whole. Hand it the layer's own group. Trains
    under CPU autocast too (see `_cast_for_cpu_autocast`), and stays out of compiled graphs with TP > 1
    unless it runs as custom ops (`_as_ops`)."""

    def forward(self, input_, *args, **kwargs):
        if (_as_ops(self) and self.tp_group is not None and self.tp_group.size() > 1 and self.input_is_parallel
                and not self.explicit_expert_comm):
            return _with_lora(self, self._ops_forward(input_), input_)
        return _with_lora(self, _forward(self, super().forward, input_, *args, **kwargs), input_)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _with_lora_shards(self, super().sharded_state_dict(prefix, sharded_offsets, metadata), prefix,
                                 sharded_offsets, metadata)

    def _ops_forward(self, input_):
        """mcore's forward for an input split over TP, with the linear and the TP sum (all-reduce, or
        reduce-scatter over the sequence under SP) as `compiled_linear` ops."""
        group = compiled_linear.group_name(self.tp_group)
        if _overlaps(self):
            out = compiled_linear.row_linear_reduce_scatter(input_, self.weight, group,
                                                            fuse_wgrad=self.gradient_accumulation_fusion)
        else:
            out = compiled_linear.parallel_linear(input_, self.weight, None, group,
                                                  fuse_wgrad=self.gradient_accumulation_fusion)
            out = compiled_linear.tp_reduce(out, group, scatter_seq=self.sequence_parallel)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    def _forward_impl(self, input, weight, *args, **kwargs):
        out = _ops_or_fp8(self, input, weight, kwargs)
        if out is not None:
            return out
        if kwargs.get("tp_group") is None:
            kwargs["tp_group"] = self.tp_group
        _fuse_only_with_main_grad(weight, kwargs)
        input, weight = _cast_for_cpu_autocast(input, weight, kwargs)
        return super()._forward_impl(input, weight, *args, **kwargs)


class DropoutInputRowParallelLinear(RowParallelLinear):
    """A RowParallelLinear that drops out its input: T5's MLP applies dropout between the activation and
    `wo`, which mcore's MLP has no slot for. The input is split over TP ranks, so on CUDA at TP > 1 the mask
    is drawn from the model-parallel RNG stream (layers/rng_fork.py)."""

    def forward(self, input_, *args, **kwargs):
        p = self.config.hidden_dropout
        if self.training and p > 0:
            input_ = dropout_call(torch.nn.functional.dropout, input_, p, True, dropout_p=p, on_cuda=input_.is_cuda,
                                  sequence_parallel=self.config.sequence_parallel)
        return super().forward(input_, *args, **kwargs)
