"""FP8 training (layers/fp8.py) through prepare on a GPU of compute capability >= 8.9: every recipe, eager and
compiled, tracks the bf16 run's losses, and the first and last layers stay bf16.

    python -m pytest -q tests/gpu/test_fp8_gpu.py
"""

import pytest
import torch

from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8 GEMMs)")

STEPS = 20


def _train(family, fp8, recipe, compiled, cpp_wrapper=None, output_layer=False):
    """`cpp_wrapper`: None, as the engine chooses in a fresh process (Inductor's C++ wrapper for bf16 layers
    without collectives, the Python wrapper for FP8 layers); False, the Python wrapper; True, the C++ wrapper.
    The engine sets the C++ wrapper for the whole process, and the test workers are kept between tasks: each run
    starts from Inductor's default, or a bf16 reference run before would leave FP8 layers on the C++ wrapper."""
    import torch._inductor.config as inductor_config

    from megatron_plugin.engine import gpu as gpu_engine

    before, choose = inductor_config.cpp_wrapper, gpu_engine.use_cpp_wrapper
    torch._dynamo.reset()  # this worker may have compiled the same layer code with the other wrapper
    inductor_config.cpp_wrapper = bool(cpp_wrapper)
    if cpp_wrapper is not None:
        gpu_engine.use_cpp_wrapper = lambda: None
    try:
        return _train_in(family, fp8, recipe, compiled, output_layer)
    finally:
        inductor_config.cpp_wrapper, gpu_engine.use_cpp_wrapper = before, choose
        torch._dynamo.reset()


def _train_in(family, fp8, recipe, compiled, output_layer=False):
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.layers.fp8 import state_of
    from tests.gpu.workers import MICRO, NUM_MICRO, dataset, gpu_model

    plugin = MegatronLMPlugin(num_micro_batches=NUM_MICRO, torch_compile=compiled, fp8=fp8, fp8_recipe=recipe,
                              fp8_output_layer=output_layer)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    hf = gpu_model(family)
    loader = DataLoader(dataset(STEPS * MICRO * NUM_MICRO, family=family), batch_size=MICRO, shuffle=False,
                        drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=5)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)
    fp8_linears = sorted(n for n, m in engine.chunks.named_modules() if state_of(m) is not None)
    engine.train()
    losses = [engine(**batch).loss.item() for batch in loader][:STEPS]
    states = [state_of(m) for m in engine.chunks.modules() if state_of(m) is not None]
    # delayed scaling: the engine settles every state after the first step (its casts skip the first-use rule)
    settled = [st.settled for st in states if st.scale is not None]
    # each step's quantized weights are dropped after it; the weight gradients went into main_grad in the backward
    cached = [st.cached is not None for st in states]
    fused = [bool(getattr(st.weight, "grad_added_to_main_grad", False)) for st in states]
    return {"losses": losses, "fp8_linears": fp8_linears, "settled": settled, "cached": cached, "fused": fused}


_BF16 = {}


def _bf16(family, compiled):
    if (family, compiled) not in _BF16:
        (_BF16[(family, compiled)],) = run_on_ranks(_train, 1, family, None, "delayed", compiled)
    return _BF16[(family, compiled)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fp8_tracks_bf16(family, recipe, compiled):
    ref = _bf16(family, compiled)
    (got,) = run_on_ranks(_train, 1, family, "hybrid", recipe, compiled)
    assert ref["fp8_linears"] == []
    # 4 layers: the first and the last stay bf16; layers 1 and 2 run their 4 linears in FP8
    layers = {n.split("decoder.layers.")[1].split(".")[0] for n in got["fp8_linears"]}
    assert layers == {"1", "2"} and len(got["fp8_linears"]) == 8, got["fp8_linears"]
    a, b = got["losses"], ref["losses"]
    assert len(a) == len(b) == STEPS
    assert all(x == x for x in a), a  # no NaN
    # 20 steps of a tiny model on the arithmetic sequences: bf16 drops ~1 nat (GPT-2) / ~0.7 (Llama)
    assert b[-1] < b[0] - 0.5 and a[-1] < a[0] - 0.5, (a, b)  # both train
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) / y < 0.05, (i, x, y)
    assert a != b  # FP8 GEMMs ran (bf16 would give the reference's losses)
    assert got["settled"] == ([True] * 8 if recipe == "delayed" else []), got["settled"]
    assert got["cached"] == [False] * 8 and got["fused"] == [True] * 8, got


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])  # the output layer tied to the embedding / its own
def test_fp8_output_layer_tracks_bf16(family, recipe):
    """fp8_output_layer: the vocabulary projection in FP8 too (its weight gradient into main_grad: the shared
    embedding's first, the lookup's rows added after), compiled layers; the losses track bf16's."""
    ref = _bf16(family, True)
    (got,) = run_on_ranks(_train, 1, family, "hybrid", recipe, True, None, True)
    assert any(n.endswith("output_layer") for n in got["fp8_linears"]) and len(got["fp8_linears"]) == 9, got
    a, b = got["losses"], ref["losses"]
    assert all(x == x for x in a) and a[-1] < a[0] - 0.5, a
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) / y < 0.05, (i, x, y)
    assert got["cached"] == [False] * 9 and got["fused"] == [True] * 9, got


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_layers_with_the_cpp_wrapper_track_the_python_wrapper(recipe):
    """Compiled FP8 layers under Inductor's C++ wrapper (which the engine gives bf16 layers; FP8 ones keep the
    Python wrapper: engine/gpu.wants_cpp_wrapper), the losses of the Python wrapper's run within 1% step by step (the same kernels; autotuning may pick other
    configurations), the delayed states settled once, the weights' step copies dropped, the weight gradients
    through main_grad. tests/test_fp8.py shows the two wrappers equal bit for bit on CPU."""
    (python_wrapper,) = run_on_ranks(_train, 1, "llama", "hybrid", recipe, True, False)
    (cpp_wrapper,) = run_on_ranks(_train, 1, "llama", "hybrid", recipe, True, True)
    a, b = cpp_wrapper["losses"], python_wrapper["losses"]
    assert len(a) == len(b) == STEPS and all(x == x for x in a), a
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) / y < 0.01, (i, x, y)
    assert cpp_wrapper["settled"] == ([True] * 8 if recipe == "delayed" else []), cpp_wrapper["settled"]
    assert cpp_wrapper["cached"] == [False] * 8 and cpp_wrapper["fused"] == [True] * 8, cpp_wrapper
