"""FP8 training without Transformer Engine (layers/fp8.py), on CPU: torch._scaled_mm runs there, so the numerics
of every recipe are checked here against references built from the same quantized operands, TE's delayed-scaling
formulas are replayed by hand, and compiled == eager. Training itself is refused on CPU (the GPU tests train)."""

import math

import pytest
import torch

from megatron_plugin import MegatronLMPlugin
from megatron_plugin.layers.fp8 import (E4M3, E5M2, FP8Recipe, FP8State, current_scaling, delayed_scaling,
                                        delayed_update, fp8_linear, pending_scales, rowwise_scaling)
from megatron_plugin.plugin import check_fp8
from tests.errors import check_refusal, expecter, refusal
from tests.spawn import run_on_ranks

RECIPES = ("tensorwise", "delayed", "rowwise")
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
MIN_SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}


def _data(seed=0, tokens=32, k=64, n=48):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    dy = (torch.randn(2, tokens // 2, n, generator=g) * 1e-3).bfloat16()
    return x, w, dy


def _q(x, scale, dtype):
    """An independent quantizer for the references: x * scale, saturated, rounded to the format."""
    m = torch.finfo(dtype).max
    return (x.double() * scale.double()).clamp(-m, m).to(dtype)


# -- quantization -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude", [1e-4, 1.0, 300.0])
def test_quantize_round_trip_error_bounds(dtype, magnitude):
    x = torch.randn(64, 80, generator=torch.Generator().manual_seed(1)) * magnitude
    q, inv = current_scaling(x, dtype, margin=0)
    back = q.float() * inv
    scale = 1 / inv
    # round to nearest: half a unit in the last place of the normal numbers, half the smallest subnormal below
    bound = torch.maximum(x.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1), torch.full_like(x, MIN_SUBNORMAL[dtype] / 2) / scale)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # the largest element lands on the format's largest value
    assert q.float().abs().max().item() == torch.finfo(dtype).max
    rq, rinv = rowwise_scaling(x, dtype, margin=0)
    assert rinv.shape == (64, 1)
    assert torch.equal(rq.float().abs().amax(dim=1), torch.full((64,), torch.finfo(dtype).max))
    rback = rq.float() * rinv
    rbound = torch.maximum(x.abs() * 2.0 ** -(MANTISSA_BITS[dtype] + 1), MIN_SUBNORMAL[dtype] / 2 * rinv)
    assert ((rback - x).abs() <= rbound * (1 + 1e-6)).all()


def test_margin_halves_the_scale_and_zero_keeps_it():
    x = torch.tensor([[3.0, -7.0]])
    _, inv0 = current_scaling(x, E4M3, margin=0)
    _, inv2 = current_scaling(x, E4M3, margin=2)
    assert inv0.item() == pytest.approx(7.0 / 448.0) and inv2.item() == pytest.approx(4 * 7.0 / 448.0)
    _, inv = current_scaling(torch.zeros(2, 2), E4M3, margin=0)
    assert inv.item() == 1.0


# -- TE's delayed scaling, replayed by hand -----------------------------------------------------------------
def _te_delayed(amaxes, length, algo, margin, dtype):
    """TE 1.x `_default_get_amax_and_update_history` + `_default_sf_compute` over a sequence of uses: the scale
    each use quantizes with, and the history and scale after the last. One change (layers/fp8.py): while no use
    has set the scale (every amax so far 0), a use quantizes with its own amax's scale, as tensorwise does."""
    history, scale, used = [0.0] * length, 1.0, []
    fmax = float(torch.finfo(dtype).max)
    for i, a in enumerate(amaxes):
        unset = not any(b > 0 for b in amaxes[:i])
        used.append((fmax / a / 2 ** margin if a > 0 else 1.0) if unset else scale)
        history[0] = a
        amax = max(history) if algo == "max" else history[0]
        if length > 1:
            history = history[1:] + history[:1]
        history[0] = 0.0
        if amax > 0 and math.isfinite(amax):
            scale = fmax / amax / 2 ** margin
    return used, history, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length,margin", [(1, 0), (3, 0), (3, 1), (5, 2)])
@pytest.mark.parametrize("start", [(), (0.0, 0.0)], ids=["first_nonzero", "zeros_first"])
def test_delayed_scaling_follows_te(algo, length, margin, start):
    amaxes = [*start, 2.0, 8.0, 0.5, 0.0, 3.0, 1.0, 0.25, 6.0]
    history = torch.zeros(length)
    scale = torch.ones(1)
    for i, a in enumerate(amaxes):
        x = torch.tensor([[a, -a / 2], [0.0, a / 4]])
        _, inv, amax = delayed_scaling(x, pending_scales(scale, history[None])[0], E4M3, margin)
        delayed_update(history, scale[0], amax, E4M3, margin, algo)
        used, want_history, want_scale = _te_delayed(amaxes[: i + 1], length, algo, margin, E4M3)
        assert inv.item() == pytest.approx(1 / used[-1], rel=1e-6), (i, inv, used)
        if i == len(start):  # the first use with an amax: tensorwise's scale, not TE's 1
            assert inv.item() == current_scaling(x, E4M3, margin)[1].item() != 1.0
        assert history.tolist() == pytest.approx(want_history, rel=1e-6), (i, history, want_history)
        assert scale.item() == pytest.approx(want_scale, rel=1e-6), (i, scale, want_scale)
    if algo == "max" and length == 3:  # the window really is three uses long: 6 is the max of (1, 0.25, 6)
        assert scale.item() == pytest.approx(448.0 / 6.0 / 2 ** margin)


def test_delayed_state_rows_update_in_fp8_linear():
    x, w, dy = _data()
    state = FP8State(FP8Recipe(fmt="hybrid", recipe="delayed", amax_history_len=4, amax_compute_algo="max"), "cpu")
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(xr, wr, state).backward(dy)
    amax = [x.float().abs().max().item(), w.float().abs().max().item(), dy.float().abs().max().item()]
    assert state.history[:, -1].tolist() == pytest.approx(amax)  # after the roll, this use's amax is last
    assert state.history[:, 0].tolist() == [0.0, 0.0, 0.0]
    fmax = [448.0, 448.0, 57344.0]
    assert state.scale.tolist() == pytest.approx([f / a for f, a in zip(fmax, amax)], rel=1e-6)


@pytest.mark.parametrize("length", [1, 4])
def test_delayed_first_use_is_tensorwise_then_te(length):
    """A new state (the first step, or a resumed run's: the state is not checkpointed) quantizes with each
    tensor's own amax: gradients of ~1e-6, below e5m2's smallest subnormal at TE's start scale of 1, survive.
    The next use quantizes with the scales the first one's amaxes gave, as TE's."""
    x, w, dy = _data(seed=7)
    dy = dy * 1e-3  # ~1e-6: all of it 0 in e5m2 at scale 1
    assert not _q(dy.float(), torch.tensor(1.0), E5M2).float().any()
    grads = {}
    for recipe in ("delayed", "tensorwise"):
        state = FP8State(FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=length), "cpu")
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xr, wr, state)
        y.backward(dy)
        grads[recipe] = (y, xr.grad, wr.grad, state)
    for name, a, b in zip(("y", "dx", "dw"), grads["delayed"][:3], grads["tensorwise"][:3]):
        assert torch.equal(a, b), name
    assert grads["delayed"][1].abs().min() > 0 and grads["delayed"][2].abs().min() > 0
    state = grads["delayed"][3]
    # the second use: TE's scales from the first use's amaxes (fp8_max / amax), not the second's own
    amax = [x.float().abs().max(), w.float().abs().max(), dy.float().abs().max()]
    want = torch.stack([448.0 / amax[0], 448.0 / amax[1], 57344.0 / amax[2]])
    assert torch.equal(state.scale, want)
    x2 = x * 2
    xr, wr = x2.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, state)
    ref = _q(x2.reshape(-1, 64).float(), want[0], E4M3).double() / want[0].double() @ (
        _q(w.float(), want[1], E4M3).double() / want[1].double()).t()
    # x * 2 saturates at the first use's scale (TE's behaviour): its own amax would not
    assert not torch.equal(y, fp8_linear(x2, w, FP8State(FP8Recipe(fmt="hybrid", recipe="tensorwise"), "cpu")))
    err = (y.reshape(ref.shape).double() - ref).abs()
    assert (err <= ref.abs() * 2.0 ** -8 + ref.abs().max() * 1e-5).all(), err.max()


# -- fp8_linear against references --------------------------------------------------------------------------
def _reference(recipe, fmt, x, w, dy):
    """y, dx, dw in float64 from the operands quantized as the recipe says (a delayed state's first use scales
    each tensor by its own amax, as tensorwise)."""
    gdtype = E5M2 if fmt == "hybrid" else E4M3
    x2, g2 = x.reshape(-1, x.shape[-1]).double(), dy.reshape(-1, dy.shape[-1]).double()
    w = w.double()

    # scales in fp32, as the recipes (and TE) compute them: a scale one fp32 ulp away rounds some elements to
    # the neighbouring FP8 value
    def tensor(t, dtype):
        s = torch.finfo(dtype).max / t.abs().max().float()
        return _q(t, s, dtype).double() * s.reciprocal().double()

    def rows(t, dtype):
        s = torch.finfo(dtype).max / t.abs().amax(dim=1, keepdim=True).float()
        return _q(t, s, dtype).double() * s.reciprocal().double()

    if recipe == "rowwise":
        y = rows(x2, E4M3) @ rows(w, E4M3).t()
        dx = rows(g2, gdtype) @ rows(w.t(), E4M3).t()
        dw = g2.t() @ x2  # bf16 weight gradient (rowwise_with_gw_hp)
    else:
        xq, wq, gq = tensor(x2, E4M3), tensor(w, E4M3), tensor(g2, gdtype)
        y, dx, dw = xq @ wq.t(), gq @ wq, gq.t() @ xq
    return y, dx, dw


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_equals_quantized_reference(recipe, fmt):
    x, w, dy = _data()
    state = FP8State(FP8Recipe(fmt=fmt, recipe=recipe), "cpu")
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xr, wr, state)
    y.backward(dy)
    ry, rdx, rdw = _reference(recipe, fmt, x, w, dy)
    for name, got, ref in (("y", y, ry), ("dx", xr.grad, rdx), ("dw", wr.grad, rdw)):
        assert got.dtype == torch.bfloat16, name
        got, ref = got.reshape(ref.shape).double(), ref
        # the one rounding left: fp32 accumulation then bf16 output (8 bits of mantissa)
        err = (got - ref).abs()
        assert (err <= ref.abs() * 2.0 ** -8 + ref.abs().max() * 1e-5).all(), (name, err.max())


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_close_to_bf16_linear(recipe, fmt):
    x, w, dy = _data(seed=3)
    state = FP8State(FP8Recipe(fmt=fmt, recipe=recipe), "cpu")
    outs = []
    for fp8 in (True, False):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        for _ in range(2):  # delayed: the second use quantizes with scales from the first
            xr.grad = wr.grad = None
            y = fp8_linear(xr, wr, state) if fp8 else torch.nn.functional.linear(xr, wr)
            y.backward(dy)
        outs.append((y, xr.grad, wr.grad))
    for name, got, ref in zip(("y", "dx", "dw"), *outs):
        if recipe == "rowwise" and name == "dw":  # in bf16 by design (rowwise_with_gw_hp)
            assert torch.equal(got, ref)
            continue
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        # e4m3 rounds to 3 mantissa bits (about 2-4% RMS on random data); hybrid's e5m2 gradients to 2 (about 6%)
        e5m2 = fmt == "hybrid" and (name == "dx" or (name == "dw" and recipe != "rowwise"))
        assert rel < (8e-2 if e5m2 else 5e-2), (name, rel)
        assert rel > 0, (name, "FP8 gave bf16's result bit for bit: was it used?")


def test_weight_gradient_in_bf16_when_fp8_wgrad_is_off():
    x, w, dy = _data(seed=4)
    grads = {}
    for wgrad in (True, False):
        state = FP8State(FP8Recipe(fmt="hybrid", recipe="tensorwise", wgrad=wgrad), "cpu")
        wr = w.clone().requires_grad_()
        fp8_linear(x, wr, state).backward(dy)
        grads[wgrad] = wr.grad
    g2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    assert torch.equal(grads[False], (g2.t() @ x2).bfloat16())
    assert not torch.equal(grads[True], grads[False])


def test_token_count_not_a_multiple_of_16_takes_the_bf16_weight_gradient():
    x, w, dy = _data(tokens=18)
    state = FP8State(FP8Recipe(fmt="e4m3", recipe="tensorwise"), "cpu")
    wr = w.clone().requires_grad_()
    fp8_linear(x, wr, state).backward(dy)
    g2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    assert torch.equal(wr.grad, (g2.t() @ x2).bfloat16())


@pytest.fixture
def cpu_fused_wgrad(monkeypatch):
    """layers/wgrad.py's fused bf16 weight gradient is CUDA's bf16 x bf16 -> fp32 addmm (no CPU kernel): here the
    same product in fp32, with its write-first rule, where the fused path calls it (compiled_linear)."""
    from megatron_plugin.layers import compiled_linear, wgrad

    monkeypatch.setattr(compiled_linear, "wgrad_gemm_accum_fp32",
                        lambda x, g, mg: mg.addmm_(g.t().float(), x.float(), beta=wgrad._beta(mg)))


# -- a training step's quantized weights, and the weight gradient into main_grad --------------------------------
def _step(state, x, w, dys, cache, fuse=False, main_grad=None):
    """One training step of len(dys) micro-batches through one FP8 linear, the weight quantized once for the step
    (`cache`) or by every micro-batch; the weight gradient into `main_grad` (`fuse`) or summed from `.grad`."""
    from megatron_plugin.layers.fp8 import cache_weights, drop_weight_cache

    wr = w.clone().requires_grad_()
    if fuse:
        wr.main_grad = main_grad
    state.weight = wr
    if cache:
        cache_weights([state])
    ys, dxs, dws = [], [], []
    for i, dy in enumerate(dys):
        xr = (x * (i + 1)).clone().requires_grad_()
        y = fp8_linear(xr, wr, state, fuse_wgrad=fuse)
        y.backward(dy)
        ys.append(y)
        dxs.append(xr.grad)
        dws.append(wr.grad)
        wr.grad = None
    drop_weight_cache([state])
    assert state.cached is None
    return ys, dxs, dws


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_steps_cached_weight_gives_the_same_numbers(recipe):
    """The weight quantized once a step (layers/fp8.cache_weights, as TE's is_first_microbatch) instead of by each
    micro-batch: the same GEMM operands, so the same outputs and gradients bit for bit; delayed scaling records the
    weight's amax once a step, which with an unchanged weight leaves the same history and scales."""
    x, w, _ = _data(seed=11)
    dys = [torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(i)).bfloat16() * 1e-3 for i in range(3)]
    r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=1)
    states = [FP8State(r, "cpu"), FP8State(r, "cpu")]
    for step in range(2):  # the first step sets a delayed state's rows, the second uses them
        got = [_step(st, x, w, dys, cache) for st, cache in zip(states, (True, False))]
        for name, a, b in zip(("y", "dx", "dw"), *got):
            for i, (u, v) in enumerate(zip(a, b)):
                assert torch.equal(u, v), (step, name, i)
        if recipe == "delayed":
            assert torch.equal(states[0].history, states[1].history) and torch.equal(states[0].scale, states[1].scale)
            assert (states[0].scale != 1).all()


def test_a_changed_weight_is_quantized_with_the_earlier_steps_scale():
    """Delayed scaling with a cached weight (TE's): the step's copy takes the scale the weight's earlier amaxes gave,
    then records this step's amax."""
    from megatron_plugin.layers.fp8 import WEIGHT, cache_weights

    x, w, _ = _data(seed=12)
    state = FP8State(FP8Recipe(fmt="hybrid", recipe="delayed"), "cpu")
    state.weight = w
    cache_weights([state])  # a new state: the weight's own amax, then recorded
    old_scale = 448.0 / w.float().abs().max()
    assert state.scale[WEIGHT] == old_scale and torch.equal(state.cached[0].float(), _q(w.float(), old_scale, E4M3).float())
    w2 = w * 3  # saturates at the old scale
    state.weight = w2
    cache_weights([state])
    wq, ws, wt, wts = state.cached
    assert torch.equal(wq.float(), _q(w2.float(), old_scale, E4M3).float()) and ws == 1 / old_scale
    assert torch.equal(wt, wq.t().contiguous()) and wts is None  # the forward's scale
    assert state.scale[WEIGHT] == 448.0 / w2.float().abs().max()


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_step_copies_equal_eager(recipe):
    """cache_weights through torch.compile (Inductor, as the engine runs it with compiled layers): the same FP8
    copies, scales and delayed history as eager, bit for bit, over three steps, five weight shapes of nn.Parameters
    (whose shapes dynamo would guard as static) and two runs' recipes in one process: one graph per `settled`
    (delayed scaling's first step and the rest), not one per shape, which hit dynamo's recompile limit on a GPU."""
    from torch._dynamo.utils import counters

    from megatron_plugin.layers import fp8
    from megatron_plugin.layers.fp8 import cache_weights

    torch._dynamo.reset()
    fp8._compiled_step_copy.clear()
    counters.clear()
    g = torch.Generator().manual_seed(14)
    shapes = [(48, 64), (96, 32), (32, 96), (64, 64), (80, 48)]
    for run in range(2):
        r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=3, amax_compute_algo="max")
        eager, compiled = ([FP8State(r, "cpu") for _ in shapes] for _ in range(2))
        for step in range(3):
            for i, shape in enumerate(shapes):
                w = torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.05 * (step + 1)).bfloat16())
                eager[i].weight = compiled[i].weight = w
            cache_weights(eager)
            cache_weights(compiled, compiled="inductor")
            for a, b in zip(eager, compiled):
                for u, v in zip(a.cached, b.cached):
                    assert (u is None and v is None) or (torch.equal(u.float(), v.float()) and u.dtype == v.dtype)
                if recipe == "delayed":
                    assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale), (run, step)
    assert counters["stats"]["unique_graphs"] <= 2, counters["stats"]


def test_compiled_step_copies_reach_the_layers_with_static_shapes():
    """The step's copies come out of one graph for every weight shape (dynamic sizes), and AOTAutograd marks such
    outputs dynamic for the next graph that takes them: the compiled layers then had symbolic weight sizes, and
    their elementwise kernels ran up to 4x slower on an H200. A graph that takes the cached copies must see their
    sizes as plain ints."""
    from megatron_plugin.layers import fp8
    from megatron_plugin.layers.fp8 import cache_weights

    torch._dynamo.reset()
    fp8._compiled_step_copy.clear()
    r = FP8Recipe(fmt="hybrid", recipe="tensorwise")
    states = [FP8State(r, "cpu") for _ in range(2)]
    for st, shape in zip(states, [(48, 64), (96, 32)]):  # two shapes: the copy's graph turns dynamic
        st.weight = torch.nn.Parameter(torch.randn(*shape).bfloat16())
    cache_weights(states, compiled="inductor")
    seen = []

    def backend(gm, example_inputs):
        seen.extend(example_inputs)
        return gm

    for st in states:  # each as a first call (a second shape would turn the graph dynamic by itself)
        torch._dynamo.reset()
        torch.compile(lambda wq, wt: wq.float().sum(0) + wt.float().sum(1), backend=backend)(st.cached[0], st.cached[2])
    sizes = [s for t in seen if torch.is_tensor(t) for s in t.shape]
    assert seen and all(type(s) is int for s in sizes) and not any(isinstance(t, torch.SymInt) for t in seen), seen


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_compiled_step_copy_takes_the_weight_amax_reduced_outside(recipe):
    """The step copy's graph (sizes symbolic: one graph for every weight shape) casts; it does not reduce the
    weight's amax. Inductor's reduction over a symbolic-size weight ran 0.9 ms a weight on an H200 (50 ms a
    Llama-1B step, a tenth of memory speed): cache_weights takes every weight's amax in one multi-tensor launch
    before it, the same numbers (test_compiled_step_copies_equal_eager)."""
    from megatron_plugin.layers import fp8
    from megatron_plugin.layers.fp8 import cache_weights

    torch._dynamo.reset()
    fp8._compiled_step_copy.clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    r = FP8Recipe(fmt="hybrid", recipe=recipe)
    states = [FP8State(r, "cpu") for _ in range(2)]
    for st, shape in zip(states, [(48, 64), (96, 32)]):
        st.weight = torch.nn.Parameter(torch.randn(*shape).bfloat16())
    cache_weights(states, compiled=backend)
    for st in states:  # the weight's own amax where the recipe takes it (tensorwise, delayed's first step)
        assert st.cached[1] == 1 / (448.0 / st.weight.float().abs().max())
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert graphs and ops and not [o for o in ops if "amax" in o or "max" == o.split(".")[-1]], ops


@pytest.mark.parametrize("recipe,wgrad", [("tensorwise", True), ("delayed", True), ("tensorwise", False),
                                          ("rowwise", True)], ids=["tensorwise", "delayed", "bf16_wgrad", "rowwise"])
def test_weight_gradient_into_main_grad(recipe, wgrad, cpu_fused_wgrad):
    """With gradient_accumulation_fusion the weight gradient goes into the fp32 main_grad inside the backward
    (layers/fp8._wgrad_into_main_grad), not through `.grad` and DDP's hook: the step's first GEMM writes main_grad
    whole where the engine left it unzeroed (`write_first`; the FP8 GEMM in fp32, without bf16's rounding),
    later micro-batches add theirs as the hook added `.grad`. The bf16 weight gradient (fp8_wgrad=False,
    rowwise) is layers/wgrad.py's fused GEMM (`cpu_fused_wgrad`: the same in fp32 on CPU)."""
    x, w, _ = _data(seed=13)
    dys = [torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(i)).bfloat16() * 1e-2 for i in range(3)]
    r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=1, wgrad=wgrad)
    main_grad = torch.full((48, 64), float("nan"))  # as the engine leaves a write_first buffer: never read
    main_grad.write_first = True
    fused = _step(FP8State(r, "cpu"), x, w, dys, cache=True, fuse=True, main_grad=main_grad)
    ref = _step(FP8State(r, "cpu"), x, w, dys, cache=True)
    for name, a, b in zip(("y", "dx"), fused[:2], ref[:2]):
        for u, v in zip(a, b):
            assert torch.equal(u, v), name
    assert main_grad.write_first is False and not main_grad.isnan().any()
    first = main_grad - ref[2][1].float() - ref[2][2].float()  # the first micro-batch's part, in fp32
    fp8_gemm = wgrad and recipe != "rowwise"
    if fp8_gemm:
        # fp32 out: bf16's rounding of it is the unfused gradient, and later micro-batches add exactly theirs
        assert torch.equal(first.bfloat16(), ref[2][0]) and not torch.equal(first, ref[2][0].float())
    else:  # every micro-batch's product in fp32 (the fused GEMM's), where the reference rounded each to bf16
        err = (main_grad - sum(d.float() for d in ref[2])).abs()
        assert (err <= sum(d.float().abs() for d in ref[2]) * 2.0 ** -8).all(), err.max()
        assert not torch.equal(main_grad, sum(d.float() for d in ref[2]))
    # an unmarked main_grad is added to
    again = main_grad.clone()
    _step(FP8State(r, "cpu"), x, w, dys[:1], cache=False, fuse=True, main_grad=main_grad)
    diff = main_grad - again
    if fp8_gemm:
        assert torch.equal(diff, ref[2][0].float() + again - again)
    else:
        assert torch.allclose(diff, ref[2][0].float(), rtol=2.0 ** -7, atol=1e-12)


# -- compiled == eager --------------------------------------------------------------------------------------
class _Two(torch.nn.Module):
    """Two FP8 linears with a GELU between, as in an MLP."""

    def __init__(self, recipe):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w1 = torch.nn.Parameter((torch.randn(64, 32, generator=g) * 0.1).bfloat16())
        self.w2 = torch.nn.Parameter((torch.randn(32, 64, generator=g) * 0.1).bfloat16())
        self.s1, self.s2 = FP8State(recipe, "cpu"), FP8State(recipe, "cpu")

    def forward(self, x):
        return fp8_linear(torch.nn.functional.gelu(fp8_linear(x, self.w1, self.s1)), self.w2, self.s2)


@pytest.mark.parametrize("interleaved", [False, True], ids=["fwd_bwd", "fwd_fwd_bwd_bwd"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_equals_eager(recipe, interleaved):
    """Per micro-batch forward then backward, and (interleaved) two forwards before their backwards, as
    pipeline schedules run them."""
    torch._dynamo.reset()
    r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=3)
    eager, compiled = _Two(r), _Two(r)
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(6)
    for step in range(3):
        xs = [torch.randn(2, 16, 32, generator=g).bfloat16() * (step + i + 1) for i in range(2)]
        dys = [torch.randn(2, 16, 32, generator=g).bfloat16() for _ in range(2)]
        xe = [x.clone().requires_grad_() for x in xs]
        xc = [x.clone().requires_grad_() for x in xs]
        if interleaved:
            ye, yc = [eager(x) for x in xe], [run(x) for x in xc]
            for y, dy in zip(ye + yc, dys + dys):
                y.backward(dy)
        else:
            ye, yc = [], []
            for i in range(2):
                ye.append(eager(xe[i]))
                ye[-1].backward(dys[i])
                yc.append(run(xc[i]))
                yc[-1].backward(dys[i])
        for i in range(2):
            assert torch.equal(ye[i], yc[i]), step
            assert torch.equal(xe[i].grad, xc[i].grad), step
        for a, b in ((eager.w1, compiled.w1), (eager.w2, compiled.w2)):
            assert torch.equal(a.grad, b.grad), step
        if recipe == "delayed":  # the in-place history and scale updates happen in the compiled graphs too
            for a, b in ((eager.s1, compiled.s1), (eager.s2, compiled.s2)):
                assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale), step
                assert (a.scale != 1).all(), step


class _TwoFused(_Two):
    """_Two as the CUDA engine runs it: weights with fp32 main_grads that the backward writes into."""

    def __init__(self, recipe):
        super().__init__(recipe)
        for w, st in ((self.w1, self.s1), (self.w2, self.s2)):
            w.main_grad = torch.zeros(w.shape)
            st.weight = w

    def forward(self, x):
        h = fp8_linear(x, self.w1, self.s1, fuse_wgrad=True)
        return fp8_linear(torch.nn.functional.gelu(h), self.w2, self.s2, fuse_wgrad=True)


def _engine_step(model, fn, xs, dys, recipe):
    """One training step of a _TwoFused as the CUDA engine runs it: main_grads left unzeroed for the first GEMM to
    write, the weights quantized once, each micro-batch's forward (through `fn`) and backward, the step's copies
    dropped, delayed states settled. Returns each micro-batch's output and input gradient."""
    from megatron_plugin.layers.fp8 import cache_weights, drop_weight_cache, settle

    states = [model.s1, model.s2]
    for w in (model.w1, model.w2):
        w.main_grad.fill_(float("nan"))
        w.main_grad.write_first = True
    cache_weights(states)
    outs = []
    for x, dy in zip(xs, dys):
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(dy)
        outs += [y.detach(), xr.grad]
    drop_weight_cache(states)
    if recipe == "delayed":
        settle(states)
    return outs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_cached_weights_and_fused_wgrad_equal_eager(recipe, backend, monkeypatch, cpu_fused_wgrad):
    """The engine's step: weights quantized once (cache_weights), two micro-batches whose weight gradients go into
    main_grad (the first writing it), settled after the first step. Traced (aot_eager, fullgraph) it equals eager
    bit for bit: outputs, input gradients, main_grads, delayed histories and scales. Inductor's fused kernels
    (GELU, the casts) may round an element otherwise, which FP8 then moves by a step of its grid: within 1%.
    One graph per variant, none recompiled when the next step brings new cached tensors."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)

    def same(a, b):
        if backend == "aot_eager":
            return torch.equal(a, b)
        return ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
    r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=3)
    eager, compiled = _TwoFused(r), _TwoFused(r)
    run = torch.compile(compiled, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        xs = [torch.randn(2, 16, 32, generator=g).bfloat16() * (step + i + 1) for i in range(2)]
        dys = [torch.randn(2, 16, 32, generator=g).bfloat16() for _ in range(2)]
        outs = [_engine_step(model, fn, xs, dys, recipe) for model, fn in ((eager, eager), (compiled, run))]
        for a, b in zip(*outs):
            assert same(a, b), step
        for a, b in ((eager.w1, compiled.w1), (eager.w2, compiled.w2)):
            assert not a.main_grad.isnan().any() and same(a.main_grad, b.main_grad), step
            assert a.grad_added_to_main_grad and b.grad_added_to_main_grad
        if recipe == "delayed":
            for a, b in ((eager.s1, compiled.s1), (eager.s2, compiled.s2)):
                assert same(a.history, b.history) and same(a.scale, b.scale), step
            assert compiled.s1.settled
    # the first step's graph and, for delayed, the settled variant's: later steps' new cached tensors reuse them
    assert counters["stats"]["unique_graphs"] == (2 if recipe == "delayed" else 1), counters["stats"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_cpp_wrapper_equals_python_wrapper(recipe, monkeypatch, cpu_fused_wgrad):
    """Inductor's C++ wrapper (what the CUDA engine compiles bf16 layers with where no collective runs in them;
    FP8 layers keep the Python wrapper: engine/gpu.wants_cpp_wrapper) against its
    Python wrapper, three engine steps of two micro-batches (weights cached, main_grad
    written first, settled after the first step): the same outputs, input gradients, main_grads, delayed
    histories and scales bit for bit, so the in-graph state updates and the custom ops (scale snapshots,
    main_grad writes) run once either way."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)  # compiled here, so that it is seen
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    cpp_graphs = []
    create = CppWrapperCpu.create
    monkeypatch.setattr(CppWrapperCpu, "create", staticmethod(lambda *a, **k: cpp_graphs.append(1) or create(*a, **k)))
    r = FP8Recipe(fmt="hybrid", recipe=recipe, amax_history_len=3)
    got = []
    for cpp in (False, True):
        torch._dynamo.reset()
        monkeypatch.setattr(torch._inductor.config, "cpp_wrapper", cpp)
        model = _TwoFused(r)
        run = torch.compile(model, backend="inductor", fullgraph=True)
        g = torch.Generator().manual_seed(9)
        seen = []
        for step in range(3):
            xs = [torch.randn(2, 16, 32, generator=g).bfloat16() * (step + i + 1) for i in range(2)]
            dys = [torch.randn(2, 16, 32, generator=g).bfloat16() for _ in range(2)]
            seen += _engine_step(model, run, xs, dys, recipe)
            seen += [model.w1.main_grad.clone(), model.w2.main_grad.clone()]
            if recipe == "delayed":
                seen += [t.clone() for st in (model.s1, model.s2) for t in (st.history, st.scale)]
        got.append(seen)
        # the C++ wrapper wrote the second run's forward and backward graphs (delayed: the settled ones too)
        assert len(cpp_graphs) == (0 if not cpp else 4 if recipe == "delayed" else 2), cpp_graphs
    python_wrapper, cpp_wrapper = got
    assert len(python_wrapper) == len(cpp_wrapper) and not any(t.isnan().any() for t in cpp_wrapper)
    for i, (a, b) in enumerate(zip(python_wrapper, cpp_wrapper)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"], ids=["eager", "aot_eager", "inductor"])
def test_settled_delayed_states_give_the_same_numbers(backend, length, monkeypatch):
    """After the first step the engine marks delayed states whose rows are all set as settled (layers/fp8.settle):
    their casts skip the first-use rule. Same weights, inputs and gradients, three steps of two micro-batches,
    one run settled after its first step and one never: outputs, input and weight gradients, histories and
    scales equal bit for bit, eager and compiled (the settled run compiles a second graph variant)."""
    from megatron_plugin.layers.fp8 import settle

    torch._dynamo.reset()
    # Inductor keeps a fused kernel's intermediates in fp32 (GELU's output is cast to FP8 without passing
    # through bf16 once fused): rounded as eager rounds them, the two graphs' numbers are comparable bit for bit
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)
    r = FP8Recipe(fmt="hybrid", recipe="delayed", amax_history_len=length)
    plain, settling = _Two(r), _Two(r)
    run_plain = plain if backend is None else torch.compile(plain, backend=backend, fullgraph=True)
    run_settling = settling if backend is None else torch.compile(settling, backend=backend, fullgraph=True)
    unsettled = [settling.s1, settling.s2]
    assert settle(unsettled) == unsettled  # no use yet: every row unset
    g = torch.Generator().manual_seed(8)
    for step in range(3):
        for i in range(2):
            x = torch.randn(2, 16, 32, generator=g).bfloat16() * (step + i + 1)
            dy = torch.randn(2, 16, 32, generator=g).bfloat16()
            xp, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
            yp, ys = run_plain(xp), run_settling(xs)
            yp.backward(dy)
            ys.backward(dy)
            assert torch.equal(yp, ys) and torch.equal(xp.grad, xs.grad), (step, i)
        for a, b in ((plain.w1, settling.w1), (plain.w2, settling.w2)):
            assert torch.equal(a.grad, b.grad), step
        for a, b in ((plain.s1, settling.s1), (plain.s2, settling.s2)):
            assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale), step
        unsettled = settle(unsettled)  # as the engine, after each training step
        assert unsettled == [] and settling.s1.settled and settling.s2.settled and not plain.s1.settled


def test_settled_casts_do_not_wait_for_the_amax(monkeypatch):
    """What settling is for: the cast of a settled state's input fuses with the kernel that computes it and its
    amax (Inductor, here on CPU), where the first-use rule's where() on the amax needs a second pass over the
    tensor: one kernel fewer (2 against 1 without `emulate_precision_casts`, which the bit-for-bit comparison
    with eager needs)."""
    import torch._inductor.metrics as metrics

    from megatron_plugin.layers.fp8 import _scaled

    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", True)  # eager's bf16 rounding
    r = FP8Recipe(fmt="hybrid", recipe="delayed")
    x = torch.randn(64, 128).bfloat16()
    scales = torch.tensor([2.0, 3.0, 4.0])
    counts = {}
    for settled in (False, True):
        def cast(t, s):
            return _scaled(torch.nn.functional.gelu(t), r, E4M3, s, 0, settled)

        torch._dynamo.reset()
        metrics.reset()
        q, inv, amax = torch.compile(cast, fullgraph=True)(x, scales)
        counts[settled] = metrics.generated_kernel_count
        want_q, want_inv, want_amax = _scaled(torch.nn.functional.gelu(x), r, E4M3, scales, 0, settled)
        assert torch.equal(q.float(), want_q.float()) and torch.equal(inv, want_inv) and torch.equal(amax, want_amax)
    assert counts[True] == counts[False] - 1, counts  # one pass over the tensor fewer


# -- settings -----------------------------------------------------------------------------------------------
def test_plugin_refusals():
    cases = {
        "format": (dict(fp8="e5m2"), "fp8", "'e4m3', 'hybrid'"),
        "format_case": (dict(fp8="HYBRID"), "fp8", "fp8='hybrid'"),
        "recipe": (dict(fp8="hybrid", fp8_recipe="current"), "fp8_recipe", "'delayed', 'tensorwise', 'rowwise'"),
        "te_recipe": (dict(fp8="hybrid", fp8_recipe="mxfp8"), "fp8_recipe", "Transformer Engine"),
        "algo": (dict(fp8="e4m3", fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo", "most_recent"),
        "history": (dict(fp8="e4m3", fp8_amax_history_len=0), "fp8_amax_history_len", ">= 1"),
        "margin": (dict(fp8="e4m3", fp8_margin=-1), "fp8_margin", ">= 0"),
        "wgrad": (dict(fp8="e4m3", fp8_wgrad="no"), "fp8_wgrad", "True or False"),
        "output_layer": (dict(fp8="e4m3", fp8_output_layer="yes"), "fp8_output_layer", "True or False"),
        "output_layer_alone": (dict(fp8_output_layer=True), "fp8_output_layer", "set fp8 ('hybrid' or 'e4m3')"),
    }
    for name, (kwargs, setting, words) in cases.items():
        check_refusal(refusal(MegatronLMPlugin, **kwargs), setting, words, exact=True, where=name)
    check_refusal(refusal(MegatronLMPlugin(fp8="hybrid").validate, num_layers=2),
                  "num_layers_at_start_in_bf16+num_layers_at_end_in_bf16", "none would run in FP8")
    MegatronLMPlugin(fp8="hybrid", first_last_layers_bf16=False).validate(num_layers=2)
    assert MegatronLMPlugin().fp8 is None


def test_device_and_mixed_precision_refusals(monkeypatch):
    plugin = MegatronLMPlugin(fp8="hybrid")
    check_refusal(refusal(check_fp8, plugin, "cpu", "bf16"), "fp8", "compute capability >= 8.9",
                  "leave fp8 unset on CPU", exact=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    check_refusal(refusal(check_fp8, plugin, "cuda", "bf16"), "fp8", "A100", "8.0", exact=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert refusal(check_fp8, plugin, "cuda", "bf16") is None
    for precision in ("no", "fp16"):
        check_refusal(refusal(check_fp8, plugin, "cuda", precision), "mixed_precision", "mixed_precision='bf16'",
                      exact=True)
    assert refusal(check_fp8, MegatronLMPlugin(), "cpu", "no") is None
    check_refusal(refusal(check_fp8, plugin, "cuda", "bf16", non_decoder_family="t5"), "fp8", "decoder-only", "not t5", exact=True)
    provided = MegatronLMPlugin(fp8="hybrid", custom_model_provider_function=lambda **kw: None)
    check_refusal(refusal(check_fp8, provided, "cuda", "bf16"), "fp8", "custom_model_provider_function", exact=True)


def _prepare_on_cpu():
    from megatron.core import parallel_state
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler
    from tests.models import tiny_gpt2
    from tests.training import optimizer_for, token_dataset

    out = {}
    expect = expecter(out, state=lambda name: parallel_state.model_parallel_is_initialized())

    def prepare():
        model = tiny_gpt2()
        opt = optimizer_for(model)
        Accelerator(megatron_lm_plugin=MegatronLMPlugin(fp8="hybrid"), mixed_precision="bf16").prepare(
            model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4), DataLoader(token_dataset(8, 1000), batch_size=4))

    expect("cpu", prepare)

    # fp8_output_layer on a vocabulary shard FP8 GEMMs cannot take (1000 rows, unpadded): refused from the model's
    # sizes, before any process group (the device check passed by hand: a CPU has no FP8 GEMMs)
    from megatron_plugin import plugin as plugin_module, resolve

    def prepare_unpadded():
        model = tiny_gpt2()
        opt = optimizer_for(model)
        plugin = MegatronLMPlugin(fp8="hybrid", fp8_output_layer=True, make_vocab_size_divisible_by=1,
                                  first_last_layers_bf16=False)
        Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16").prepare(
            model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4), DataLoader(token_dataset(8, 1000), batch_size=4))

    checks = [(m, m.check_fp8) for m in (resolve, plugin_module)]  # prepare's check, and the CPU run's
    for m, _ in checks:
        m.check_fp8 = lambda *args, **kwargs: None
    try:
        expect("output_layer", prepare_unpadded)
    finally:
        for m, check in checks:
            m.check_fp8 = check
    return out


def test_prepare_refuses_fp8_on_cpu_before_any_process_group():
    (got,) = run_on_ranks(_prepare_on_cpu, 1)
    check_refusal(got["cpu"], "fp8", "leave fp8 unset on CPU", exact=True)
    assert got["cpu"][2] is False
    check_refusal(got["output_layer"], "fp8_output_layer", "1000 x 64", "make_vocab_size_divisible_by", exact=True)
    assert got["output_layer"][2] is False


# -- in the model: which layers, and the TP + SP collectives around the FP8 GEMM ----------------------------
def _layers_and_tp_sp(sp, output_layer=False):
    import os

    from megatron_plugin.layers.fp8 import attach_fp8, state_of
    from tests.models import megatron_twin, tiny_gpt2

    tp = int(os.environ["WORLD_SIZE"])
    hf = tiny_gpt2(n_layer=4)  # its output layer tied to the embedding
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp, fp8="e4m3", fp8_recipe="tensorwise",
                              fp8_output_layer=output_layer)
    model = megatron_twin(hf, plugin).eval()
    for m in model.module.modules():  # as on the CUDA engine with gradient_accumulation_fusion
        if hasattr(m, "gradient_accumulation_fusion"):
            m.gradient_accumulation_fusion = True
    names = attach_fp8([model.module], plugin)
    from megatron_plugin.engine.grad_buffers import written_first_by_gemm

    # the engine zeroes the main_grad of every weight that no fused GEMM writes first: the FP8 linears' weight
    # gradients go into main_grad inside their backward (layers/fp8._wgrad_into_main_grad), the first one writing
    first = written_first_by_gemm(model.module)
    written_first = {n: p in first for n, p in model.module.named_parameters() if n.endswith("linear_fc1.weight")}
    linears = {n: state_of(m) is not None for n, m in model.module.named_modules()
               if n.split(".")[-1] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}
    ids = torch.randint(5, 900, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def run():
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss = loss.sum() / (labels != -100).sum()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.module.named_parameters()}

    fp8_loss, fp8_grads = run()
    logits_fp8 = model(ids).detach()
    for n, m in model.module.named_modules():
        if state_of(m) is not None:
            delattr(m, "fp8_state")
    ref_loss, ref_grads = run()
    logits_ref = model(ids).detach()
    rel = {n: ((fp8_grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in ref_grads}
    return dict(names=names, linears=linears, loss=(fp8_loss, ref_loss), written_first=written_first,
                logits_rel=((logits_fp8 - logits_ref).norm() / logits_ref.norm()).item(), grad_rel=rel)


@pytest.mark.parametrize("world_size,sp", [(1, False), (2, False), (2, True)], ids=["tp1", "tp2", "tp2_sp"])
def test_first_last_layers_stay_bf16_and_tp_collectives_hold(world_size, sp):
    """TP=2: the column linears' input-gradient all-reduce; under SP their sequence gather (and its
    reduce-scatter), all around the FP8 GEMM, as megatron-core's linear runs them."""
    results = run_on_ranks(_layers_and_tp_sp, world_size, sp)
    for r in results:
        fp8_layers = {int(n.split(".")[2]) for n, on in r["linears"].items() if on}
        assert fp8_layers == {1, 2}, r["linears"]  # 4 layers, the first and the last in bf16
        assert all(on == (int(n.split(".")[2]) in (1, 2)) for n, on in r["linears"].items()), r["linears"]
        assert len(r["names"]) == 8
        assert r["written_first"] == {f"decoder.layers.{i}.mlp.linear_fc1.weight": True for i in range(4)}
        fp8_loss, ref_loss = r["loss"]
        assert abs(fp8_loss - ref_loss) / ref_loss < 1e-2, r["loss"]
        assert 0 < r["logits_rel"] < 5e-2, r["logits_rel"]
        for n, rel in r["grad_rel"].items():  # e4m3's 3 mantissa bits, through up to 3 FP8 layers' gradients
            assert rel < 0.08, (n, rel)
        # the FP8 layers' weights get FP8 gradients; the bf16 layers' differ only through the FP8 layers after them
        assert r["grad_rel"]["decoder.layers.1.mlp.linear_fc1.weight"] > 0
    if world_size == 2:  # the TP ranks' losses agree: the sequence gathers and reductions ran
        assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.parametrize("world_size,sp", [(1, False), (2, True)], ids=["tp1", "tp2_sp"])
def test_output_layer_in_fp8_when_asked(world_size, sp):
    """fp8_output_layer: the output layer (tied to the embedding here) runs its GEMMs in FP8 too: its logits and
    the shared weight's gradient (the output layer's FP8 part written first, the lookup's rows added) close to
    bf16's and no longer equal to them."""
    asked = run_on_ranks(_layers_and_tp_sp, world_size, sp, True)
    plain = run_on_ranks(_layers_and_tp_sp, world_size, sp, False)
    emb = "embedding.word_embeddings.weight"
    for a, p in zip(asked, plain):
        assert a["names"] == p["names"] + ["output_layer"] and "output_layer" not in p["names"]
        fp8_loss, ref_loss = a["loss"]
        assert abs(fp8_loss - ref_loss) / ref_loss < 1e-2, a["loss"]
        # the logits now carry the output GEMM's FP8 error on top of the layers'; the shared weight's gradient too
        assert p["logits_rel"] < a["logits_rel"] < 5e-2, (a["logits_rel"], p["logits_rel"])
        assert p["grad_rel"][emb] < a["grad_rel"][emb] < 0.08, (a["grad_rel"][emb], p["grad_rel"][emb])
    if world_size == 2:
        assert asked[0]["loss"] == asked[1]["loss"]


# -- accelerate's mixed_precision="fp8" ---------------------------------------------------------------------
class TERecipeKwargs:
    """accelerate's TERecipeKwargs by its fields (the real one cannot be built without Transformer Engine)."""

    def __init__(self, **fields):
        self.__dict__.update(dict(use_autocast_during_eval=False, margin=None, interval=None, fp8_format=None,
                                  amax_history_len=None, amax_compute_algo=None, override_linear_precision=None,
                                  use_mxfp8_block_scaling=None), **fields)


class AORecipeKwargs:
    pass


def test_accelerate_fp8_maps_onto_the_plugin(monkeypatch):
    from megatron_plugin.plugin import fp8_from_accelerate

    for var in ("FORMAT", "MARGIN", "INTERVAL", "AMAX_HISTORY_LEN", "AMAX_COMPUTE_ALGO", "OVERRIDE_FPROP",
                "OVERRIDE_DGRAD", "OVERRIDE_WGRAD", "USE_MXFP8_BLOCK_SCALING", "BACKEND"):
        monkeypatch.delenv("ACCELERATE_FP8_" + var, raising=False)
    plugin = MegatronLMPlugin()
    assert fp8_from_accelerate(plugin, "bf16") == (plugin, "bf16")
    out, precision = fp8_from_accelerate(plugin, "fp8")
    assert precision == "bf16" and plugin.fp8 is None  # the user's plugin is not written
    # TERecipeKwargs' defaults (accelerate's), as Megatron's names
    assert (out.fp8, out.fp8_recipe, out.fp8_margin, out.fp8_amax_history_len, out.fp8_amax_compute_algo,
            out.fp8_wgrad) == ("hybrid", "delayed", 0, 1024, "most_recent", True)
    out, _ = fp8_from_accelerate(plugin, "fp8", [TERecipeKwargs(fp8_format="E4M3", margin=1, amax_history_len=16,
                                                                amax_compute_algo="max",
                                                                override_linear_precision=(False, False, True))])
    assert (out.fp8, out.fp8_margin, out.fp8_amax_history_len, out.fp8_amax_compute_algo, out.fp8_wgrad) == (
        "e4m3", 1, 16, "max", False)
    monkeypatch.setenv("ACCELERATE_FP8_FORMAT", "E4M3")
    monkeypatch.setenv("ACCELERATE_FP8_AMAX_HISTORY_LEN", "32")
    out, _ = fp8_from_accelerate(plugin, "fp8")
    assert (out.fp8, out.fp8_amax_history_len) == ("e4m3", 32)
    # what `accelerate launch` writes for a config's fp8_override_linear_precision: three flags
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_WGRAD", "True")
    assert fp8_from_accelerate(plugin, "fp8")[0].fp8_wgrad is False
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_FPROP", "True")
    check_refusal(refusal(fp8_from_accelerate, plugin, "fp8"), "TERecipeKwargs.override_linear_precision",
                  "(False, False, True)", exact=True, where="env fprop")
    monkeypatch.delenv("ACCELERATE_FP8_OVERRIDE_FPROP")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "AO")  # a launch config's fp8_backend: torchao
    check_refusal(refusal(fp8_from_accelerate, plugin, "fp8"), "fp8_backend", "TE", exact=True, where="env backend")
    monkeypatch.delenv("ACCELERATE_FP8_BACKEND")
    out, _ = fp8_from_accelerate(MegatronLMPlugin(fp8="hybrid", fp8_recipe="rowwise"), "fp8")
    assert (out.fp8, out.fp8_recipe) == ("hybrid", "rowwise")  # the plugin's own settings win
    refused = {
        "e5m2": ([TERecipeKwargs(fp8_format="E5M2")], "TERecipeKwargs.fp8_format", "HYBRID"),
        "interval": ([TERecipeKwargs(interval=4)], "TERecipeKwargs.interval", "leave it 1"),
        "mxfp8": ([TERecipeKwargs(use_mxfp8_block_scaling=True)], "TERecipeKwargs.use_mxfp8_block_scaling", "Blackwell"),
        "fprop": ([TERecipeKwargs(override_linear_precision=(True, False, False))],
                  "TERecipeKwargs.override_linear_precision", "(False, False, True)"),
        "torchao": ([AORecipeKwargs()], "kwargs_handlers", "TERecipeKwargs"),
    }
    for name, (handlers, setting, words) in refused.items():
        check_refusal(refusal(fp8_from_accelerate, plugin, "fp8", handlers), setting, words, exact=True, where=name)


# -- compiled transformer layers ----------------------------------------------------------------------------
def _compiled_layers():
    from megatron_plugin.layers.fp8 import attach_fp8, state_of
    from tests.models import megatron_twin, tiny_gpt2

    plugin = MegatronLMPlugin(fp8="e4m3", fp8_recipe="delayed")
    model = megatron_twin(tiny_gpt2(n_layer=4), plugin).train()
    attach_fp8([model.module], plugin)
    ids = torch.randint(5, 900, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def run():
        model.zero_grad()
        loss = model(ids, labels=labels).sum()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.module.named_parameters()}

    eager = [run() for _ in range(2)]
    for m in model.module.modules():
        if state_of(m) is not None:  # the delayed scales start again, as the compiled run's
            state_of(m).history.zero_()
            state_of(m).scale.fill_(1.0)
    # as the CUDA engine compiles them: each layer, with the linears as compiled_linear ops where the weight
    # gradient is fused (`_as_ops`), which FP8 linears must not be
    model.config.gradient_accumulation_fusion = True
    for layer in model.module.decoder.layers:
        layer.compile(backend="aot_eager")
    compiled = [run() for _ in range(2)]
    # the compiled steps really quantized: every FP8 linear's delayed scales moved off their start (1) with the
    # amaxes they saw
    histories = [bool((state_of(m).scale != 1.0).all()) for m in model.module.modules() if state_of(m) is not None]
    return ([e[0] for e in eager], [c[0] for c in compiled],
            max((eager[1][1][n] - compiled[1][1][n]).abs().max().item() for n in eager[1][1]), histories)


def test_compiled_layers_run_the_fp8_linears():
    """Each decoder layer compiled (aot_eager on CPU), two steps of delayed scaling: the same losses and
    gradients as eager, bit for bit; the FP8 linears stay FP8 where bf16 linears would run as custom ops."""
    ((eager, compiled, grad_diff, histories),) = run_on_ranks(_compiled_layers, 1)
    assert eager == compiled and grad_diff == 0.0, (eager, compiled, grad_diff)
    assert histories and all(histories), histories


def _compiled_layers_as_the_engine_runs_them():
    """Eager against compiled layers, both as the CUDA engine runs FP8 linears: main_grads written first by the
    step's first micro-batch (gradient_accumulation_fusion), the weights quantized once a step, delayed states
    settled after the first step. Three steps of two micro-batches. Compiled, the step's copies are compiled too,
    as the engine compiles them (with the layers' backend); the layers' graphs record their inputs."""
    from torch._dynamo.backends.registry import lookup_backend

    from megatron_plugin.layers.fp8 import attach_fp8, cache_weights, drop_weight_cache, settle, state_of
    from tests.models import megatron_twin, tiny_gpt2

    layer_inputs = []

    def recording(gm, example_inputs):
        layer_inputs.extend(example_inputs)
        return lookup_backend("aot_eager")(gm, example_inputs)

    plugin = MegatronLMPlugin(fp8="e4m3", fp8_recipe="delayed")
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(6):
        ids = torch.randint(5, 900, (2, 16), generator=g)
        batches.append((ids, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)))
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = megatron_twin(tiny_gpt2(n_layer=4), plugin).train()
        attach_fp8([model.module], plugin)
        linears = [m for m in model.module.modules() if state_of(m) is not None]
        states = [state_of(m) for m in linears]
        for m in linears:
            m.gradient_accumulation_fusion = True
            m.weight.main_grad = torch.zeros(m.weight.shape)
        if compiled:
            for layer in model.module.decoder.layers:
                layer.compile(backend=recording)
        losses, grads = [], []
        for step in range(3):
            model.zero_grad()
            for m in linears:
                m.weight.main_grad.fill_(float("nan"))  # the engine leaves these unzeroed: the first GEMM writes
                m.weight.main_grad.write_first = True
            cache_weights(states, compiled="aot_eager" if compiled else None)
            for ids, labels in batches[2 * step: 2 * step + 2]:
                loss = model(ids, labels=labels).sum()
                loss.backward()
                losses.append(loss.item())
            drop_weight_cache(states)
            settle(states)
            grads.append({n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
                          for n, p in model.module.named_parameters()})
        fp8_placeholders = all(m.weight.grad_added_to_main_grad for m in linears)
        runs.append((losses, grads, fp8_placeholders, all(st.settled for st in states), len(linears)))
    (le, ge, pe, se, ne), (lc, gc, pc, sc, nc) = runs
    grad_diff = max((a[n] - b[n]).abs().max().item() for a, b in zip(ge, gc) for n in a)
    nan = any(t.isnan().any().item() for step in gc for t in step.values())
    # the layers' graphs take the step's copies with their sizes as plain ints (a symbolic size made the GPU's
    # kernels up to 4x slower: layers/fp8.cache_weights)
    symbolic = [t for t in layer_inputs if isinstance(t, torch.SymInt)
                or (torch.is_tensor(t) and not all(type(d) is int for d in t.shape))]
    return dict(losses=(le, lc), grad_diff=grad_diff, nan=nan, placeholders=(pe, pc), settled=(se, sc), n=(ne, nc),
                layer_graphs=len(layer_inputs) > 0, symbolic=len(symbolic))


def test_compiled_layers_as_the_engine_runs_them():
    """The FP8 linears in compiled transformer layers (aot_eager on CPU) with the engine's cached weights and
    main_grad writes: the same losses and main_grads as eager, bit for bit, three steps of delayed scaling; the
    layers' graphs compiled with static sizes though the step's copies come from a graph with dynamic ones."""
    ((got,),) = (run_on_ranks(_compiled_layers_as_the_engine_runs_them, 1),)
    assert got["losses"][0] == got["losses"][1] and got["grad_diff"] == 0.0 and not got["nan"], got
    assert got["placeholders"] == (True, True) and got["settled"] == (True, True) and got["n"] == (8, 8)
    assert got["layer_graphs"] and got["symbolic"] == 0, got


# -- benchmarks/fp8_parity.py: its logic on CPU (the FP8 arms need a GPU) -----------------------------------
def _parity_module():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import fp8_parity

    return fp8_parity


def _parity_arm(out):
    """The smoke arm again, in a worker process, from the cache the driver's run left."""
    fp8_parity = _parity_module()
    args = fp8_parity.parser().parse_args(["--one", "--size", "tiny", "--device", "cpu", "--mode", "megatron",
                                           "--steps", "3", "--seq", "64", "--vocab", "512", "--out", out])
    return fp8_parity.run_arm(args)["losses"]


def test_fp8_parity_smoke_on_cpu(tmp_path):
    """The driver runs a bf16 arm of a tiny GPT-2 on the demo corpus; a second run of the arm (another process,
    the cached blocks) gives the same losses bit for bit: same weights, same data, same order."""
    import json
    import subprocess
    import sys

    fp8_parity = _parity_module()
    out = str(tmp_path / "parity")
    cmd = [sys.executable, fp8_parity.__file__, "--sizes", "tiny", "--arms", "bf16", "--device", "cpu", "--mode",
           "megatron", "--steps", "3", "--seq", "64", "--vocab", "512", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "| tiny | bf16 | 3 |" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp_path / "parity" / "tiny_bf16.json") as f:
        got = json.load(f)
    assert got["arm"] == "bf16" and got["vocab"] == 512 and len(got["losses"]) == 3 and got["tok_s"] > 0
    # the corpus cut into 64-token blocks, of which 3 steps x 8 read a small part
    assert got["blocks"] > 1000 and got["epochs"] == round(24 / got["blocks"], 2)
    # a new model's loss is about ln(vocabulary)
    assert abs(got["losses"][0] - math.log(512)) < 0.05, got["losses"]
    (again,) = run_on_ranks(_parity_arm, 1, out)
    assert again == got["losses"]


def test_fp8_parity_data_order_cycles_epochs():
    fp8_parity = _parity_module()
    order = fp8_parity.sample_order(5, 13, seed=3)
    assert len(order) == 13
    for epoch in (order[:5], order[5:10]):  # every block once per epoch
        assert sorted(epoch) == list(range(5))
    assert order[:5] != order[5:10]  # each epoch its own permutation
    assert order == fp8_parity.sample_order(5, 13, seed=3) and order != fp8_parity.sample_order(5, 13, seed=4)


def test_fp8_parity_table():
    fp8_parity = _parity_module()

    def row(arm, tail, size="350m"):
        # 250 early steps that the table must not read, then 50 at `tail`
        return dict(size=size, arm=arm, steps=300, epochs=11.0, losses=[9.0] * 250 + [tail] * 50, tok_s=123456,
                    device="NVIDIA H100", global_batch=8, seq=512)

    rows = [row("fp8-hybrid-rowwise", 3.0 * 0.995), row("fp8-hybrid-delayed", 2.973), row("bf16", 3.0),
            row("fp8-hybrid-tensorwise", 3.0 * 1.009), row("fp8-hybrid-delayed", 2.0, size="llama-1b")]
    lines = fp8_parity.table(rows).splitlines()
    body = [l for l in lines if l.startswith("| 350m") or l.startswith("| llama-1b")]
    # per size, bf16 first, then the recipes in their order; a size without a bf16 arm gets no verdict
    assert [l.split(" | ")[:2] for l in body] == [["| 350m", "bf16"], ["| 350m", "fp8-hybrid-tensorwise"],
                                                   ["| 350m", "fp8-hybrid-delayed"], ["| 350m", "fp8-hybrid-rowwise"],
                                                   ["| llama-1b", "fp8-hybrid-delayed"]]
    cells = {tuple(l.split(" | ")[:2]): l.split(" | ")[4:7] for l in body}
    assert cells[("| 350m", "bf16")] == ["3.0000", "", ""]
    assert cells[("| 350m", "fp8-hybrid-delayed")] == ["2.9730", "-0.90%", "pass"]
    assert cells[("| 350m", "fp8-hybrid-tensorwise")] == ["3.0270", "+0.90%", "pass"]
    assert cells[("| 350m", "fp8-hybrid-rowwise")] == ["2.9850", "-0.50%", "pass"]
    assert cells[("| llama-1b", "fp8-hybrid-delayed")] == ["2.0000", "", ""]
    rows[0]["losses"][-50:] = [3.0303] * 50  # 1.01% above bf16
    assert "| 350m | fp8-hybrid-rowwise | 300 | 11.0 | 3.0303 | +1.01% | FAIL |" in fp8_parity.table(rows)


def test_docstring_corpus_keeps_prose_only():
    """benchmarks/docstring_corpus.py (the Llama parity run's text): prose paragraphs of every docstring, joined
    into one line each; doctests, parameter lists, directives and short or symbol-heavy blocks dropped."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "docstring_corpus.py")
    spec = importlib.util.spec_from_file_location("docstring_corpus", path)
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    prose = "This function computes the running mean of a sequence and returns it as a new list of the same length."
    source = f'''
"""Module text that is long enough to count as a paragraph of real English prose, written for the test here."""

def f(x):
    """{prose[:44]}
    {prose[45:]}

    x : int
        the input, described in a numpy-style parameter list that the corpus must leave out of its text

    >>> f([1, 2, 3])  # a doctest that the corpus must drop as well, whatever its length may be
    [1.0, 1.5, 2.0]

    .. note:: a reST directive that is long enough but not prose at all, and must be dropped as well

    Short one.
    """
'''
    got = list(corpus.paragraphs(source))
    assert got == ["Module text that is long enough to count as a paragraph of real English prose, written for the test "
                   "here.", prose]
    assert list(corpus.paragraphs("def broken(:\n")) == []


def _settle_across_ranks_worker():
    import torch.distributed as dist

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.layers.fp8 import FP8State, settle

    initialize(MegatronLMPlugin())
    rank = dist.get_rank()
    states = [FP8State(FP8Recipe(recipe="delayed"), "cpu") for _ in range(2)]
    for i, st in enumerate(states):
        st.scale.fill_(2.0)  # every row set by a use...
        if rank == 1 and i == 0:
            st.scale[1] = 1.0  # ...but the weight row of rank 1's first linear
    left = settle(states)
    each = [st.settled for st in states]
    left_agreed = settle(states, group=dist.group.WORLD)
    return {"each": each, "left": len(left), "agreed": [st.settled for st in states], "left_agreed": len(left_agreed)}


def test_settle_agrees_across_ranks_when_asked():
    # under the full-iteration graph a settled state is new host state: every rank must see it in the same step,
    # or one captures (and waits in a barrier) while another replays
    out = run_on_ranks(_settle_across_ranks_worker, 2)
    assert out[0]["each"] == [True, True] and out[1]["each"] == [False, True]  # each rank alone
    assert [o["agreed"] for o in out] == [[False, True], [False, True]] and [o["left_agreed"] for o in out] == [1, 1]
