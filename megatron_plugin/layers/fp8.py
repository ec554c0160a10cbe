"""FP8 training of the parallel linears without Transformer Engine: `torch._scaled_mm` GEMMs.

Megatron's names and meanings (megatron-core's TransformerConfig: `fp8`, `fp8_recipe`, `fp8_margin`,
`fp8_amax_history_len`, `fp8_amax_compute_algo`, `fp8_wgrad`, `first_last_layers_bf16`,
`num_layers_at_start_in_bf16`, `num_layers_at_end_in_bf16`); megatron-core's own `fp8` is never set, since it
would route the layers to Transformer Engine. Here a linear that should run in FP8 carries an `FP8State`
(`attach_fp8`), and our linears' `_forward_impl` (layers/linear.py) then compute y = x W^T with
`fp8_linear` around megatron-core's own TP collectives (`fp8_forward`).

Formats: "e4m3" quantizes every operand to float8_e4m3fn; "hybrid" the forward's (input, weight) to e4m3 and
the output gradient to e5m2 (more range, less precision: what gradients need).

Recipes, each a way of choosing the scale q = x * scale (the GEMM gets 1/scale):
- "tensorwise" (Megatron's tensor-wise current scaling): one scale per tensor from its amax now:
  fp8_max / amax / 2^margin.
- "delayed" (Megatron's default, TE's DelayedScaling): one scale per tensor from an amax history of the last
  `fp8_amax_history_len` uses, taken as their max ("max") or the latest ("most_recent"); each use quantizes with
  the scale of the uses before it, then records its amax and updates the scale exactly as TE's
  `_default_get_amax_and_update_history` / `_default_sf_compute` do (`delayed_update`).
  All three updates of a use (input, weight, output gradient) are written at the end of its backward, not the
  input's and weight's at the end of its forward as TE does: under torch.compile a buffer that the forward graph
  mutated reaches the backward graph by reference, and work the partitioner recomputes there from it read the
  new scale (measured: a weight gradient 217x too large). A backward graph writes after all it reads. The
  scales a forward quantizes with (the output gradient's too) are read once, through an opaque op whose output
  is saved (`_snapshot`). With one forward then one backward per micro-batch (schedules without pipeline
  parallelism) the scales are TE's; with forwards ahead of backwards (1F1B) a forward may see scales a
  micro-batch older than TE's. A forward without backward (eval) leaves the state as it was.
  One departure from TE: a tensor whose state no use has set yet (history all zero and scale still 1: the first
  step, or the first after a resume, since the state is not checkpointed) is quantized with its own amax, as
  "tensorwise" would. TE's scale of 1 there leaves e5m2 gradients below its smallest subnormal (~1.5e-5) at 0,
  which would zero the first step's weight gradients of whole layers. Its amax enters the history as TE's would,
  so every later use follows TE's formulas. That rule makes each cast wait for its tensor's amax (a where() on
  it); once every row of a state is set the CUDA engine marks it `settled` (`settle`, after training steps,
  normally the first), and its casts take the state's scales directly: the same scales (a set row's scale is
  what the where() picked), and in a compiled graph one pass fewer over each tensor, the cast fused into the
  kernel that reduces the amax (whose fp32 intermediates may round an element differently, as any fusion).
- "rowwise": one scale per row along the contraction: the input per token, the weight per output row in the
  forward; in the input-gradient GEMM the output gradient per token and the weight per input column. The weight
  gradient stays in bf16 (torchao's "rowwise_with_gw_hp"): rowwise along the token axis would need both
  operands re-quantized along the other dimension (two more passes), and a weight gradient sums over every
  token of the micro-batch, where one scale per feature over all tokens loses the rare large ones.

cuBLAS/CUTLASS's rules for `torch._scaled_mm` (torch 2.13, aten/src/ATen/native/cuda/ScaledBlas.cpp): the first
operand row-major, the second column-major (here always `.t()` of a contiguous tensor), the shared dimension and
the second operand's columns multiples of 16, scales fp32 reciprocal ("dequantize") scales: one element per
tensor, or [M, 1] and [1, N] per row; e5m2 x e5m2 is not a cuBLAS FP8 GEMM, which no GEMM here asks for.
A weight gradient over a token count that is not a multiple of 16 is computed in bf16.

The weight gradient is returned as the weight's `.grad` (megatron-core's DDP hook adds it into the fp32
main_grad): `attach_fp8` clears each FP8 linear's `gradient_accumulation_fusion`, so that the engine zeroes its
main_grad (engine/grad_buffers.py marks only fused linears as written by their first GEMM) and compiled layers
never run it as compiled_linear ops (layers/linear._as_ops).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch

from .compiled_linear import define_op

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# where a linear keeps its state: a plain attribute, not a submodule, so that it is in no state_dict (HF export,
# checkpoints) and no `.to(dtype)` of the model (Float16Module) casts its fp32 histories
ATTR = "fp8_state"
# the rows of a delayed state's history / scale: one per quantized tensor of the linear
INPUT, WEIGHT, GRAD = 0, 1, 2


@dataclass(frozen=True)
class FP8Recipe:
    """What a run's `fp8*` settings say, for every FP8 linear of it."""

    fmt: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1  # the plugin's defaults (Megatron-LM's)
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # Megatron's fp8_wgrad: the weight-gradient GEMM in FP8 too (False: bf16)

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    @classmethod
    def from_plugin(cls, plugin) -> "FP8Recipe":
        return cls(fmt=plugin.fp8, recipe=plugin.fp8_recipe, margin=plugin.fp8_margin,
                   amax_history_len=plugin.fp8_amax_history_len, amax_compute_algo=plugin.fp8_amax_compute_algo,
                   wgrad=plugin.fp8_wgrad)


class FP8State:
    """One linear's recipe and, for delayed scaling, its amax histories and current scales (rows INPUT, WEIGHT,
    GRAD), initialized as TE's are: histories zero, scales one."""

    def __init__(self, recipe: FP8Recipe, device):
        self.recipe = recipe
        self.history: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        # delayed: every row set by a use (`settle`, after a training step): the casts then take the state's
        # scales without the first-use rule, so they no longer wait for their tensor's amax (one pass, not two)
        self.settled = False
        if recipe.recipe == "delayed":
            self.history = torch.zeros(3, recipe.amax_history_len, dtype=torch.float32, device=device)
            self.scale = torch.ones(3, dtype=torch.float32, device=device)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int, fallback) -> torch.Tensor:
    """TE's `_default_sf_compute`: fp8_max / amax / 2^margin, keeping `fallback` where amax is 0 or not finite;
    an amax so small that the quotient overflows gives fp32's largest scale."""
    amax = amax.float()
    scale = (fp8_max(dtype) / amax) / (2.0 ** margin)
    scale = torch.clamp(scale, max=torch.finfo(torch.float32).max)
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range (as TE's cast), in FP8."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def current_scaling(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, its dequantize scale): one scale for the tensor from its own amax."""
    scale = amax_to_scale(x.detach().abs().amax(), dtype, margin, 1.0)
    return quantize(x, scale, dtype), scale.reciprocal()


def rowwise_scaling(x: torch.Tensor, dtype: torch.dtype, margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x [R, C] in FP8, its dequantize scales [R, 1]): one scale per row."""
    scale = amax_to_scale(x.detach().abs().amax(dim=-1, keepdim=True), dtype, margin, 1.0)
    return quantize(x, scale, dtype), scale.reciprocal()


def delayed_update(history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype,
                   margin: int, algo: str) -> None:
    """TE's delayed-scaling update, in place, after a use whose amax was `amax`: slot 0 of the history holds this
    use's amax; the amax is the history's max ("max") or slot 0 ("most_recent"); the history rolls back by one
    with slot 0 cleared for the next use; the scale is computed from the amax (kept where it is 0 or not
    finite)."""
    current = torch.cat([amax.float().reshape(1), history[1:]])
    reduced = current.amax() if algo == "max" else current[0]
    rolled = torch.cat([torch.zeros_like(current[:1]), torch.roll(current, -1, 0)[1:]])
    new_scale = amax_to_scale(reduced, dtype, margin, scale)
    history.copy_(rolled)
    scale.copy_(new_scale)


def pending_scales(scale: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The scales the next use quantizes with: the state's, or 0 (never a scale `amax_to_scale` gives) in a row
    that no use has set yet (its history all zero and its scale still 1), which `delayed_scaling` reads as "take
    the tensor's own amax". With `amax_history_len=1` the history is zero after every update, so the scale
    tells a set row from a new one (an amax of exactly fp8_max / 2^margin gives a scale of 1 too: that row's next
    use is current-scaled, rare and harmless)."""
    unset = (history == 0).all(dim=-1) & (scale == 1)
    return torch.where(unset, torch.zeros_like(scale), scale)


def delayed_scaling(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, margin: int,
                    settled: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x in FP8 with the scale the earlier uses gave, its dequantize scale, x's amax for `delayed_update`).
    `scale` comes from `pending_scales`: where it is 0, the scale is x's own (current scaling, as tensorwise),
    chosen by torch.where so that a compiled graph has no branch on it. That choice makes the cast wait for the
    whole tensor's amax; a `settled` state (every row set) skips it, and a compiled graph then casts in the
    kernel that reduces the amax (the same numbers: a set row's scale is > 0, so the where picks it)."""
    amax = x.detach().abs().amax()
    if not settled:
        scale = torch.where(scale > 0, scale, amax_to_scale(amax, dtype, margin, 1.0))
    return quantize(x, scale, dtype), scale.reciprocal(), amax


# The delayed scales as a forward reads them, through an opaque op: the partitioner of a compiled layer
# recomputes cheap elementwise work in the backward graph from the forward's inputs, and the state's scale and
# history buffers are inputs that another micro-batch's backward may have updated by then (measured: with two
# forwards before their backwards, an input gradient ~1000x too large). An opaque op's output is saved, never
# recomputed.
_snapshot = define_op("fp8_scale_snapshot(Tensor scale, Tensor history) -> Tensor", pending_scales,
                      lambda scale, history: torch.empty_like(scale))
# a settled state's scales as they stand (no row is unset), through an opaque op for the same reason
_settled_snapshot = define_op("fp8_settled_scale_snapshot(Tensor scale) -> Tensor", torch.clone,
                              lambda scale: torch.empty_like(scale))


def unsettled_rows(state: FP8State) -> torch.Tensor:
    """How many of a delayed state's rows no use has set yet (as `pending_scales` tells them), on its device."""
    return ((state.history == 0).all(dim=-1) & (state.scale == 1)).sum()


def settle(states: List[FP8State]) -> List[FP8State]:
    """Marks the delayed states whose rows are all set as `settled`; returns those still unsettled. The engine
    calls it after training steps until none is left (normally after the first: every FP8 linear's backward
    sets its three rows). One device read for all of them."""
    if not states:
        return []
    counts = torch.stack([unsettled_rows(st) for st in states]).tolist()
    for st, n in zip(states, counts):
        st.settled = n == 0
    return [st for st in states if not st.settled]


def _scaled(x, recipe: FP8Recipe, dtype, scale, row: int, settled: bool = False):
    """(FP8 x, dequantize scale, amax or None): current scaling, or delayed with the state's scale row."""
    if recipe.recipe == "delayed":
        return delayed_scaling(x, scale[row], dtype, recipe.margin, settled)
    return (*current_scaling(x, dtype, recipe.margin), None)


def _col_major(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] as the column-major second operand of _scaled_mm (same shape, transposed storage)."""
    return q.t().contiguous().t()


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with FP8 GEMMs in both directions (see the module docstring); out in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, history, scale, recipe: FP8Recipe, settled: bool):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x.dtype
        if recipe.recipe == "rowwise":
            xq, xs = rowwise_scaling(x2, E4M3, recipe.margin)
            wq, ws = rowwise_scaling(weight, E4M3, recipe.margin)
            y = torch._scaled_mm(xq, wq.t(), xs, ws.t(), out_dtype=out_dtype)
            ctx.save_for_backward(x2, weight)
        else:
            scales = None
            if scale is not None:
                scales = _settled_snapshot(scale) if settled else _snapshot(scale, history)
            xq, xs, x_amax = _scaled(x2, recipe, E4M3, scales, INPUT, settled)
            wq, ws, w_amax = _scaled(weight, recipe, E4M3, scales, WEIGHT, settled)
            y = torch._scaled_mm(xq, wq.t(), xs, ws, out_dtype=out_dtype)
            # the weight gradient reads the input again: in FP8 (a quarter of bf16's memory), or in bf16 when
            # it is computed in bf16 (fp8_wgrad=False, or a token count that FP8 GEMMs cannot take)
            ctx.fp8_wgrad = recipe.wgrad and x2.shape[0] % 16 == 0
            # delayed: the output gradient is quantized with the scale as it stood at this forward, eager and
            # compiled alike (a compiled backward sees its inputs as of the forward; see the module docstring)
            amaxes = () if x_amax is None else (x_amax, w_amax, scales[GRAD])
            ctx.save_for_backward(xq if ctx.fp8_wgrad else x2, xs, wq, ws, *amaxes)
        ctx.recipe, ctx.history, ctx.scale, ctx.shape, ctx.weight_dtype = recipe, history, scale, shape, weight.dtype
        ctx.settled = settled
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        recipe = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        gdtype = recipe.grad_dtype
        need_wgrad = ctx.needs_input_grad[1]
        if recipe.recipe == "rowwise":
            x2, weight = ctx.saved_tensors
            gq, gs = rowwise_scaling(g2, gdtype, recipe.margin)
            # the contraction runs over the output features: the weight scaled per input column
            wtq, wts = rowwise_scaling(weight.t().contiguous(), E4M3, recipe.margin)
            dx = torch._scaled_mm(gq, wtq.t(), gs, wts.t(), out_dtype=x2.dtype)
            dw = (g2.t() @ x2.to(g2.dtype)).to(weight.dtype) if need_wgrad else None
        else:
            saved, xs, wq, ws, *amaxes = ctx.saved_tensors
            if amaxes:
                gq, gs, g_amax = delayed_scaling(g2, amaxes[2], gdtype, recipe.margin, ctx.settled)
            else:
                gq, gs, g_amax = _scaled(g2, recipe, gdtype, None, GRAD)
            out_dtype = grad.dtype
            dx = torch._scaled_mm(gq, _col_major(wq), gs, ws, out_dtype=out_dtype)
            dw = None
            if need_wgrad and ctx.fp8_wgrad:
                dw = torch._scaled_mm(gq.t().contiguous(), _col_major(saved), gs, xs, out_dtype=ctx.weight_dtype)
            elif need_wgrad:
                dw = (g2.t() @ saved.to(g2.dtype)).to(ctx.weight_dtype)
            if amaxes:
                # the whole use's update, after its last GEMM (see "Delayed scaling" in the module docstring)
                for row, amax, dtype in ((INPUT, amaxes[0], E4M3), (WEIGHT, amaxes[1], E4M3), (GRAD, g_amax, gdtype)):
                    delayed_update(ctx.history[row], ctx.scale[row], amax, dtype, recipe.margin,
                                   recipe.amax_compute_algo)
        return dx.reshape(ctx.shape), dw, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: FP8State) -> torch.Tensor:
    """x @ weight.T in FP8 by `state`'s recipe (no bias, no collectives: see `fp8_forward`)."""
    return _FP8Linear.apply(x, weight, state.history, state.scale, state.recipe, state.settled)


def state_of(layer) -> Optional[FP8State]:
    return getattr(layer, ATTR, None)


def fp8_forward(layer, input: torch.Tensor, weight: torch.Tensor, kwargs) -> Optional[torch.Tensor]:
    """The linear's `_forward_impl` in FP8 when it carries an FP8State (else None): the collectives megatron-core's
    `LinearWithGradAccumulationAndAsyncCommunication` runs around its GEMM, with the FP8 GEMM between them. A
    column linear under SP gathers the sequence first (backward: reduce-scatter); without SP its input gradient
    is all-reduced over TP (`allreduce_dgrad`). A row linear's reduction follows in megatron-core's forward."""
    state = state_of(layer)
    if state is None:
        return None
    group = kwargs.get("tp_group") if kwargs.get("tp_group") is not None else layer.tp_group
    if kwargs.get("sequence_parallel"):
        from .sp_comm import gather_first_dim

        input = gather_first_dim(input, group)
    elif kwargs.get("allreduce_dgrad"):
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        input = copy_to_tensor_model_parallel_region(input, group=group)
    out = fp8_linear(input, weight, state)
    bias = kwargs.get("bias")
    return out + bias if bias is not None else out


def is_bf16_layer(layer_no: int, num_layers: int, plugin) -> bool:
    """megatron-core's `fp8_utils.is_first_last_bf16_layer` (0-based global layer number)."""
    if not plugin.first_last_layers_bf16:
        return False
    return layer_no < plugin.num_layers_at_start_in_bf16 or layer_no >= num_layers - plugin.num_layers_at_end_in_bf16


LINEAR_SLOTS = (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"), ("mlp", "linear_fc1"),
                ("mlp", "linear_fc2"))


def _fp8_linears(layer) -> List[torch.nn.Module]:
    """The layer's attention and dense-MLP linears (an MoE layer's experts run as grouped GEMMs and stay bf16).
    Only ours (layers/linear.py, by module: it imports this one) read the state; megatron-core's own, in a
    custom_model_provider_function's module, would ignore it and are left alone."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    found = []
    for block, name in LINEAR_SLOTS:
        linear = getattr(getattr(layer, block, None), name, None)
        if (isinstance(linear, (ColumnParallelLinear, RowParallelLinear)) and linear.weight is not None
                and type(linear).__module__ == f"{__package__}.linear"):
            found.append(linear)
    return found


def fits_fp8(linear) -> bool:
    """Both GEMM dimensions of the weight (this rank's shard) multiples of 16, as _scaled_mm needs."""
    out_features, in_features = linear.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def attach_fp8(modules: Iterable[torch.nn.Module], plugin) -> List[str]:
    """Give the linears of the decoder layers that run in FP8 an FP8State; returns their names. Nothing when
    `plugin.fp8` is unset. The embedding, the output layer and, with `first_last_layers_bf16`, the first and
    last layers stay bf16, as do linears whose shard has a dimension that is not a multiple of 16."""
    if not getattr(plugin, "fp8", None):
        return []
    from megatron.core.models.gpt import GPTModel

    from ..errors import MegatronPluginConfigError

    recipe = FP8Recipe.from_plugin(plugin)
    names = []
    for module in modules:
        if not isinstance(module, GPTModel):
            # BERT keeps its layers in an encoder, T5 numbers two stacks apart: neither is laid out here yet
            raise MegatronPluginConfigError(
                "fp8", plugin.fp8, f"FP8 linears are for decoder-only (GPTModel) models, not {type(module).__name__}: "
                "leave fp8 unset for this model")
        if getattr(module, "decoder", None) is None:
            continue
        for layer in module.decoder.layers:
            if is_bf16_layer(layer.layer_number - 1, layer.config.num_layers, plugin):
                continue
            for linear in _fp8_linears(layer):
                if not fits_fp8(linear):
                    continue
                setattr(linear, ATTR, FP8State(recipe, linear.weight.device))
                linear.gradient_accumulation_fusion = False
                names.append(f"decoder.layers.{layer.layer_number - 1}." + next(
                    n for n, m in layer.named_modules() if m is linear))
    meant = [layer for m in modules if getattr(m, "decoder", None) is not None for layer in m.decoder.layers
             if not is_bf16_layer(layer.layer_number - 1, layer.config.num_layers, plugin)]
    if meant and not names:
        # a warning, not an error: pipeline stages whose layers all stay bf16 would not raise it, and the
        # others' error would leave them waiting in the engine's first collective
        warnings.warn(
            f"fp8={plugin.fp8!r}: no linear of this stage runs in FP8: its layers' linears are not megatron_plugin's "
            "(a custom_model_provider_function's module: build it with megatron_plugin's layer spec), or their "
            "weight shards have a dimension that is not a multiple of 16; the layers run in bf16", stacklevel=2)
    return names
