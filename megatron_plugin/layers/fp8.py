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

Per training step the CUDA engine quantizes each FP8 linear's weight once (`cache_weights`, TE's
`is_first_microbatch`): its forward copy and its transposed copy for the input gradient, which every micro-batch's
GEMMs read; forwards outside a training step quantize the weight themselves. The input's FP8 copy is saved for
the weight gradient already transposed ([in, tokens], as `_scaled_mm` takes it), and the output gradient's is
transposed where it is cast: in a compiled layer each cast and its transpose are one kernel. The forward GEMM
accumulates fast (TE's and torchao's default there), the backward GEMMs do not.

With `gradient_accumulation_fusion` (the engine's default) the weight gradient goes into the fp32 main_grad inside
the backward (`_wgrad_into_main_grad`, an opaque op), as megatron-core's fused linear does: the step's first
micro-batch's FP8 GEMM writes main_grad directly in fp32 (engine/grad_buffers.py leaves those unzeroed,
`write_first`); `_scaled_mm` cannot accumulate (no beta), so later micro-batches add its bf16 result, as DDP's hook
added `.grad` before. A bf16 weight gradient (rowwise, `fp8_wgrad=False`) is layers/wgrad.py's fused GEMM. Without
a main_grad (outside the engine) the gradient is returned as `.grad`. Compiled layers never run FP8 linears as
compiled_linear ops (layers/linear._as_ops).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch

from ..errors import MegatronPluginConfigError
from .compiled_linear import accumulate_wgrad, define_op, into_main_grad

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

    def __init__(self, recipe: FP8Recipe, device, weight: Optional[torch.Tensor] = None):
        self.recipe = recipe
        # the linear's weight (for `cache_weights`), and its FP8 copies while a training step runs
        self.weight = weight
        self.cached: Optional[Tuple[torch.Tensor, ...]] = None
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
    # a Python fallback stays a scalar: made a device tensor it would be a host-to-device copy, which a CUDA graph
    # capture (the full-iteration graph) does not allow
    fallback = fallback.float() if torch.is_tensor(fallback) else float(fallback)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range (as TE's cast), in FP8."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def current_scaling(x: torch.Tensor, dtype: torch.dtype, margin: int,
                    amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, its dequantize scale): one scale for the tensor from its own amax (`amax`: reduced already)."""
    scale = amax_to_scale(x.detach().abs().amax() if amax is None else amax, dtype, margin, 1.0)
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
                    settled: bool = False, amax: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x in FP8 with the scale the earlier uses gave, its dequantize scale, x's amax for `delayed_update`).
    `scale` comes from `pending_scales`: where it is 0, the scale is x's own (current scaling, as tensorwise),
    chosen by torch.where so that a compiled graph has no branch on it. That choice makes the cast wait for the
    whole tensor's amax; a `settled` state (every row set) skips it, and a compiled graph then casts in the
    kernel that reduces the amax (the same numbers: a set row's scale is > 0, so the where picks it). `amax`:
    x's, reduced already (`cache_weights`)."""
    if amax is None:
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


def settle(states: List[FP8State], group=None) -> List[FP8State]:
    """Marks the delayed states whose rows are all set as `settled`; returns those still unsettled. The engine
    calls it after training steps until none is left (normally after the first: every FP8 linear's backward
    sets its three rows). One device read for all of them. `group`: ranks holding the same linears in the same
    order (the full-iteration graph's, which must capture on every rank in the same step): a state settles on
    all of them when it has on each."""
    if not states:
        return []
    counts = torch.stack([unsettled_rows(st) for st in states])
    if group is not None:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
    counts = counts.tolist()
    for st, n in zip(states, counts):
        st.settled = n == 0
    return [st for st in states if not st.settled]


def _scaled(x, recipe: FP8Recipe, dtype, scale, row: int, settled: bool = False, amax=None):
    """(FP8 x, dequantize scale, amax or None): current scaling, or delayed with the state's scale row. `amax`:
    x's, where it was reduced already."""
    if recipe.recipe == "delayed":
        return delayed_scaling(x, scale[row], dtype, recipe.margin, settled, amax)
    return (*current_scaling(x, dtype, recipe.margin, amax), None)


def _wgrad_into_main_grad(gq_t: torch.Tensor, x_t: torch.Tensor, gs: torch.Tensor, xs: torch.Tensor,
                          weight: torch.Tensor, fp8: bool) -> torch.Tensor:
    """weight.main_grad += the weight gradient, inside the op: the FP8 GEMM (operands transposed as
    `_scaled_mm` takes them: gq_t [out, T], x_t [in, T]) or, with `fp8` False, the bf16 one (then gq_t is the
    gradient [T, out] and x_t the input [T, in], layers/wgrad.py's fused GEMM). `_scaled_mm` cannot accumulate
    (no beta), so the FP8 GEMM writes main_grad directly (fp32 out) only where the step's first GEMM may
    overwrite it (`write_first`, engine/grad_buffers.py); later micro-batches add its bf16 result, as DDP's hook
    would have. Returns the placeholder gradient that the hook skips (`grad_added_to_main_grad`)."""
    if not fp8:
        return accumulate_wgrad(gq_t, x_t, weight)

    def write(main_grad):
        if getattr(main_grad, "write_first", False):
            main_grad.write_first = False
            torch._scaled_mm(gq_t, x_t.t(), gs, xs, out_dtype=main_grad.dtype, out=main_grad)
        else:
            main_grad.add_(torch._scaled_mm(gq_t, x_t.t(), gs, xs, out_dtype=weight.dtype))

    return into_main_grad(weight, write)


# an opaque op (a side effect on main_grad that a compiled graph must call as it is; see compiled_linear.py)
_wgrad_op = define_op(
    "fp8_wgrad_into_main_grad(Tensor gq_t, Tensor x_t, Tensor gs, Tensor xs, Tensor weight, bool fp8) -> Tensor",
    _wgrad_into_main_grad,
    lambda gq_t, x_t, gs, xs, weight, fp8: torch.empty_like(weight, memory_format=torch.contiguous_format))


def quantize_weight(weight: torch.Tensor, recipe: FP8Recipe, scales: Optional[torch.Tensor] = None,
                    settled: bool = False, for_dgrad: bool = True, amax: Optional[torch.Tensor] = None):
    """The weight as the GEMMs take it: (w [out, in] and its dequantize scale for the forward, w_t [in, out]
    contiguous and its scale for the input gradient (None without `for_dgrad`; the scale None where it is the
    forward's), the amax for delayed scaling or None). Tensor-wise recipes quantize once and transpose; rowwise
    scales the forward's copy per output row and the input gradient's per input column (the contraction's side
    each time). `amax`: the weight's, reduced already (tensor-wise recipes)."""
    if recipe.recipe == "rowwise":
        wq, ws = rowwise_scaling(weight, E4M3, recipe.margin)
        if not for_dgrad:
            return wq, ws.t(), None, None, None
        wtq, wts = rowwise_scaling(weight.t().contiguous(), E4M3, recipe.margin)
        return wq, ws.t(), wtq, wts.t(), None
    wq, ws, amax = _scaled(weight, recipe, E4M3, scales, WEIGHT, settled, amax)
    # w_t's scale is w's: None, as autograd.Function.apply takes no tensor twice under torch.compile
    return wq, ws, (wq.t().contiguous() if for_dgrad else None), None, amax


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with FP8 GEMMs in both directions (see the module docstring); out in x's dtype.

    `need_dx` / `need_dw` say which gradients the backward will compute (decided outside, where grad mode is
    known): the forward then saves only what those need, already laid out for their GEMMs (the input's FP8
    copy transposed, [in, T], in the kernel that casts it). `cw, cws, cwt, cwts`: the weight quantized once for
    the step (`cache_weights`: w, its scale, w_t, its scale), or None. `fuse_wgrad`: the weight gradient goes
    into main_grad inside the backward (`_wgrad_into_main_grad`)."""

    @staticmethod
    def forward(ctx, x, weight, history, scale, recipe: FP8Recipe, settled: bool, need_dx: bool, need_dw: bool,
                fuse_wgrad: bool, cw, cws, cwt, cwts):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out_dtype = x.dtype
        scales = None
        if scale is not None:
            scales = _settled_snapshot(scale) if settled else _snapshot(scale, history)
        if recipe.recipe == "rowwise":
            xq, xs = rowwise_scaling(x2, E4M3, recipe.margin)
            xs_mm, x_amax = xs, None
        else:
            xq, xs, x_amax = _scaled(x2, recipe, E4M3, scales, INPUT, settled)
            xs_mm = xs
        cached = cw is not None
        if cached:
            wq, ws, wt, wts = cw, cws, cwt, cwts
            w_amax = None  # recorded when the step's copy was made
        else:
            wq, ws, wt, wts, w_amax = quantize_weight(weight, recipe, scales, settled, for_dgrad=need_dx)
        if wts is None:
            wts = ws
        # the forward GEMM accumulates fast (TE's and torchao's default for it); the backward GEMMs do not
        y = torch._scaled_mm(xq, wq.t(), xs_mm, ws, out_dtype=out_dtype, use_fast_accum=xq.is_cuda)
        # rowwise keeps its weight gradient in bf16; so does a token count that FP8 GEMMs cannot take
        ctx.fp8_wgrad = recipe.recipe != "rowwise" and recipe.wgrad and x2.shape[0] % 16 == 0
        saved_x = None
        if need_dw:
            # the weight gradient reads the input again: in FP8 (a quarter of fp32's memory), transposed here
            saved_x = xq.t().contiguous() if ctx.fp8_wgrad else x2
        empty = x2.new_empty(0)
        amaxes = ()
        if recipe.recipe == "delayed":
            # delayed: the output gradient is quantized with the scale as it stood at this forward, eager and
            # compiled alike (a compiled backward sees its inputs as of the forward; see the module docstring)
            amaxes = (x_amax, w_amax if w_amax is not None else empty, scales[GRAD])
        ctx.save_for_backward(saved_x if saved_x is not None else empty, xs if ctx.fp8_wgrad else empty,
                              wt if need_dx else empty, wts if need_dx else empty,
                              weight if fuse_wgrad and need_dw else empty, *amaxes)
        ctx.recipe, ctx.history, ctx.scale, ctx.shape, ctx.weight_dtype = recipe, history, scale, shape, weight.dtype
        ctx.settled, ctx.need_dx, ctx.need_dw, ctx.fuse_wgrad = settled, need_dx, need_dw, fuse_wgrad and need_dw
        ctx.weight_row = not cached
        return y.reshape(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        recipe = ctx.recipe
        g2 = grad.reshape(-1, grad.shape[-1])
        gdtype = recipe.grad_dtype
        saved_x, xs, wt, wts, weight, *amaxes = ctx.saved_tensors
        if recipe.recipe == "rowwise":
            gq, gs = rowwise_scaling(g2, gdtype, recipe.margin) if ctx.need_dx else (None, None)
            g_amax = None
        elif amaxes:
            gq, gs, g_amax = delayed_scaling(g2, amaxes[2], gdtype, recipe.margin, ctx.settled)
        else:
            gq, gs, g_amax = _scaled(g2, recipe, gdtype, None, GRAD)
        dx = torch._scaled_mm(gq, wt.t(), gs, wts, out_dtype=grad.dtype).reshape(ctx.shape) if ctx.need_dx else None
        dw = None
        if ctx.need_dw:
            if ctx.fp8_wgrad:
                # the gradient's FP8 copy transposed in the kernel that casts it (compiled)
                gq_t = gq.t().contiguous()
                dw = (_wgrad_op(gq_t, saved_x, gs, xs, weight, True) if ctx.fuse_wgrad else
                      torch._scaled_mm(gq_t, saved_x.t(), gs, xs, out_dtype=ctx.weight_dtype))
            elif ctx.fuse_wgrad:
                dw = _wgrad_op(g2, saved_x.to(g2.dtype), g2.new_empty(0), g2.new_empty(0), weight, False)
            else:
                dw = (g2.t() @ saved_x.to(g2.dtype)).to(ctx.weight_dtype)
        if amaxes:
            # the whole use's update, after its last GEMM (see "Delayed scaling" in the module docstring); the
            # weight's row only when this use quantized the weight itself (a step's cached copy recorded it)
            rows = ((INPUT, amaxes[0], E4M3), (GRAD, g_amax, gdtype))
            if ctx.weight_row:
                rows += ((WEIGHT, amaxes[1], E4M3),)
            for row, amax, dtype in rows:
                delayed_update(ctx.history[row], ctx.scale[row], amax, dtype, recipe.margin,
                               recipe.amax_compute_algo)
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: FP8State, fuse_wgrad: bool = False) -> torch.Tensor:
    """x @ weight.T in FP8 by `state`'s recipe (no bias, no collectives: see `fp8_forward`). `fuse_wgrad`: the
    weight gradient goes into `weight.main_grad` (which it must have) instead of `.grad`."""
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
    if not (need_dx or need_dw):
        fuse_wgrad = False
    cached = state.cached or (None, None, None, None)
    return _FP8Linear.apply(x, weight, state.history, state.scale, state.recipe, state.settled, need_dx, need_dw,
                            fuse_wgrad, *cached)


def _step_copy(weight: torch.Tensor, amax: Optional[torch.Tensor], recipe: FP8Recipe,
               scale: Optional[torch.Tensor], history: Optional[torch.Tensor], settled: bool):
    """One weight's copies for a step (`quantize_weight`; `amax` the weight's, reduced already, or None);
    delayed scaling quantizes with the scale the earlier steps gave (or, unset, the weight's own amax) and then
    records this amax in the weight's row."""
    scales = None
    if scale is not None:
        scales = scale if settled else pending_scales(scale, history)
    wq, ws, wt, wts, amax = quantize_weight(weight, recipe, scales, settled, amax=amax)
    if amax is not None:
        delayed_update(history[WEIGHT], scale[WEIGHT], amax, E4M3, recipe.margin, recipe.amax_compute_algo)
    return wq, ws, wt, wts


_compiled_step_copy = {}  # by torch.compile backend


def cache_weights(states: List[FP8State], compiled=None) -> None:
    """Quantize every FP8 linear's weight once for a training step (TE's `is_first_microbatch`): its forward and
    input-gradient copies and their scales, which each micro-batch's GEMMs then read instead of casting and
    transposing the weight again. Delayed scaling records the weight's amax here, once a step (as TE does with
    cached weights), with the scale the earlier steps gave. The engine calls it before the step's first
    micro-batch and `drop_weight_cache` after the last: the weights change only in the optimizer's step.
    `compiled`: a torch.compile backend ("inductor"; the engine's when it compiles the layers) or None (eager):
    eager, the cast is four passes over every weight (to fp32, scale, clamp, to FP8) and the scale's update a
    dozen launches; compiled, one kernel writes both copies. Tensor-wise recipes take every weight's amax in one
    multi-tensor launch first (`_foreach_norm` with ord inf: the largest |w|, the same number as
    `abs().amax()`): Inductor's reduction for it, compiled with the weight's sizes symbolic, ran 0.9 ms a
    weight, 50 ms a Llama-1B step (H200, 2026-11-29), for 1.7 GB of weights."""
    fn = _step_copy
    if compiled:
        if compiled not in _compiled_step_copy:
            # the Python wrapper even where another run set the C++ one for the process, as the FP8 layers have
            # (engine/gpu.wants_cpp_wrapper)
            options = {"cpp_wrapper": False} if compiled == "inductor" else None
            _compiled_step_copy[compiled] = torch.compile(_step_copy, fullgraph=True, backend=compiled,
                                                          options=options)
        fn = _compiled_step_copy[compiled]
    with torch.no_grad():
        tensorwise = [st for st in states if st.recipe.recipe != "rowwise"]
        amaxes = dict(zip(map(id, tensorwise), torch._foreach_norm([st.weight for st in tensorwise], float("inf"))
                          if tensorwise else ()))
        for st in states:
            weight = st.weight
            if compiled:
                # one graph for every weight shape: a Parameter's shape is guarded as static, so each shape (and
                # each `settled`) would compile anew and a model with four or more shapes hits dynamo's limit
                weight = weight.detach()
                torch._dynamo.maybe_mark_dynamic(weight, 0)
                torch._dynamo.maybe_mark_dynamic(weight, 1)
            cached = fn(weight, amaxes.get(id(st)), st.recipe, st.scale, st.history, st.settled)
            if compiled:
                # AOTAutograd marks a dynamic graph's outputs dynamic for the next graph that takes them
                # (torch 2.11: `_dynamo_weak_dynamic_indices`; 2.13: `_dynamo_propagated_dynamic_indices`): the FP8
                # layers then compiled with symbolic weight sizes, and their elementwise kernels (run-time div/mod,
                # no vector loads) ran up to 4x slower (SwiGLU's backward 0.61 ms against bf16's 0.16, H200,
                # 2026-11-29). Detached aliases carry no mark.
                cached = tuple(t.detach() if t is not None else None for t in cached)
            st.cached = cached


def drop_weight_cache(states: List[FP8State]) -> None:
    """Forget the step's quantized weights (their memory returns to the allocator): a forward outside a training
    step (evaluation, generation, log-probs after the optimizer moved the weights) quantizes them itself."""
    for st in states:
        st.cached = None


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
    # the weight gradient into main_grad as megatron-core's fused linear does (gradient_accumulation_fusion), where
    # the weight has one (DDP's buffer)
    fuse = bool(kwargs.get("gradient_accumulation_fusion")) and hasattr(weight, "main_grad")
    out = fp8_linear(input, weight, state, fuse_wgrad=fuse)
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
                and _ours(linear)):
            found.append(linear)
    return found


def _ours(linear) -> bool:
    return type(linear).__module__ == f"{__package__}.linear"


def _dims_fit(rows: int, cols: int) -> bool:
    return rows % 16 == 0 and cols % 16 == 0


def fits_fp8(linear) -> bool:
    """Both GEMM dimensions of the weight (this rank's shard) multiples of 16, as _scaled_mm needs."""
    return _dims_fit(*linear.weight.shape)


def check_output_layer(rows: int, cols: int) -> None:
    """`fp8_output_layer` on an output-layer weight shard of `rows` x `cols`: refused by name where `fits_fp8` would
    keep it bf16. resolve asks it from the model's sizes before any process group, so that no pipeline stage is
    left waiting for the last one's error."""
    if not _dims_fit(rows, cols):
        raise MegatronPluginConfigError(
            "fp8_output_layer", True, f"the output layer's weight shard is {rows} x {cols}; FP8 GEMMs need both "
            "multiples of 16 (pad the vocabulary: make_vocab_size_divisible_by) or leave it False")


def _attach_output_layer(module, recipe: "FP8Recipe") -> List[str]:
    """The output layer's FP8State (`fp8_output_layer`), on the stage that holds it. Tied to the embedding, its
    weight is the embedding's, handed to each forward; its weight gradient goes into the shared main_grad first,
    the lookup's rows added after, as in bf16 (engine/grad_buffers.written_first_by_gemm)."""
    out = getattr(module, "output_layer", None)
    if out is None:
        return []
    weight = out.weight
    if weight is None and getattr(module, "share_embeddings_and_output_weights", False):
        weight = module.shared_embedding_or_output_weight()
    if weight is None or not _ours(out):
        raise MegatronPluginConfigError(
            "fp8_output_layer", True, "the output layer is not megatron_plugin's linear (a custom_model_provider_"
            "function's module: build it with megatron_plugin's models), so it cannot run in FP8: leave it False")
    check_output_layer(*weight.shape)
    setattr(out, ATTR, FP8State(recipe, weight.device, weight))
    return ["output_layer"]


def attach_fp8(modules: Iterable[torch.nn.Module], plugin) -> List[str]:
    """Give the linears of the decoder layers that run in FP8 an FP8State; returns their names. Nothing when
    `plugin.fp8` is unset. The embedding and, with `first_last_layers_bf16`, the first and last layers stay bf16,
    as do linears whose shard has a dimension that is not a multiple of 16; the output layer too unless
    `fp8_output_layer`."""
    if not getattr(plugin, "fp8", None):
        return []
    from megatron.core.models.gpt import GPTModel

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
                setattr(linear, ATTR, FP8State(recipe, linear.weight.device, linear.weight))
                names.append(f"decoder.layers.{layer.layer_number - 1}." + next(
                    n for n, m in layer.named_modules() if m is linear))
        if getattr(plugin, "fp8_output_layer", False) and getattr(module, "post_process", False):
            names += _attach_output_layer(module, recipe)
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
