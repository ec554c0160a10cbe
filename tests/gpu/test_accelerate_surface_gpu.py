"""The accelerate surface on the CUDA engine: a model provider's modules under megatron-core's DDP and
optimizer (bf16), TensorBoard with fp16's loss scale and CUDA memory, save_pretrained from TP=2.

    python -m pytest -q tests/gpu/test_accelerate_surface_gpu.py
"""

import math

import pytest
import torch
from torch.utils.data import DataLoader

from tests.gpu.workers import MICRO, NUM_MICRO, dataset, gpu_model
from tests.spawn import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.two_gpus
STEPS = 8


def _train(plugin_kwargs, precision="bf16", steps=STEPS, model=None):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=NUM_MICRO, **plugin_kwargs),
                      mixed_precision=precision)
    hf = model if model is not None else gpu_model()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=min(2, steps - 1))
    tp = plugin_kwargs.get("tp_degree", 1)
    dp = int(__import__("os").environ["WORLD_SIZE"]) // tp
    loader = DataLoader(dataset(steps * MICRO * NUM_MICRO), batch_size=MICRO // dp, drop_last=True)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)
    engine.train()
    losses, lrs = [], []
    for batch in loader:
        losses.append(engine(**batch).loss.item())
        lrs.append(sched.get_last_lr()[0])
        if len(losses) == steps:
            break
    return acc, engine, losses, lrs


def _provider_run(kind, tp=1):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.modeling import MegatronModel

    # the fused weight gradient off in both runs: the provider's module is built with the user's plugin
    kwargs = dict(tp_degree=tp, gradient_accumulation_fusion=False)
    if kind == "provided":
        def provider(pre_process=True, post_process=True):
            build = MegatronLMPlugin(**kwargs)
            module = MegatronModel(gpu_model().config, build, params_dtype=torch.bfloat16).module
            module.load_state_dict(MegatronModel.from_hf(gpu_model(), build, params_dtype=torch.bfloat16).module.state_dict())
            return module

        kwargs["custom_model_provider_function"] = provider
    _, engine, losses, _ = _train(kwargs)
    return losses, [c.provided for c in engine.chunks]


@pytest.mark.parametrize("world,tp", [(1, 1), pytest.param(2, 2, marks=two_gpus)])
def test_provider_module_trains_like_the_converted_model_gpu(world, tp):
    converted = run_on_ranks(_provider_run, world, "converted", tp)
    provided = run_on_ranks(_provider_run, world, "provided", tp)
    for (ref, ref_provided), (got, was_provided) in zip(converted, provided):
        assert ref_provided == [False] and was_provided == [True]
        assert sum(got[-3:]) < sum(got[:3])  # it learns
        for a, b in zip(got, ref):  # the same weights and math; bf16 kernels may sum in another order
            assert abs(a - b) <= 2e-2 * abs(b), (got, ref)


def _provider_precision_run():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.modeling import MegatronModel

    def provider(pre_process=True, post_process=True):  # an fp32 config under bf16 mixed precision
        return MegatronModel(gpu_model().config, MegatronLMPlugin()).module

    try:
        _train(dict(custom_model_provider_function=provider), steps=1)
    except Exception as err:  # noqa: BLE001 - the test reads which
        return getattr(err, "setting", type(err).__name__), str(err)


def test_provider_config_must_match_mixed_precision_gpu():
    ((setting, message),) = run_on_ranks(_provider_precision_run, 1)
    assert setting == "custom_model_provider_function" and "bf16=True" in message, message


def _tensorboard_run(log_dir):
    acc, engine, losses, lrs = _train(dict(tensorboard_dir=log_dir, set_all_logging_options=True), precision="fp16",
                                      steps=4)
    scales = engine.optimizer.get_loss_scale().item()
    engine.tensorboard.close()
    return losses, lrs, scales


def test_tensorboard_fp16_gpu(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ((losses, lrs, scale),) = run_on_ranks(_tensorboard_run, 1, str(tmp_path))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(losses, rel=1e-6)
    assert [e.value for e in events.Scalars("learning-rate")] == pytest.approx(lrs, rel=1e-6)
    assert events.Scalars("loss-scale")[-1].value == scale
    assert {"grad-norm", "params-norm", "mem-allocated-bytes", "mem-max-allocated-bytes"} <= set(tags), tags
    assert all(math.isfinite(e.value) and e.value > 0 for e in events.Scalars("params-norm"))


def _save_pretrained_run(folder):
    acc, engine, losses, _ = _train(dict(tp_degree=2, return_logits=True), precision="no", steps=3)
    acc.unwrap_model(engine).save_pretrained(folder, is_main_process=acc.is_main_process, save_function=acc.save)
    batch = {k: torch.stack([d[k] for d in dataset(4)]).cuda() for k in ("input_ids", "attention_mask", "labels")}
    engine.eval()
    with torch.no_grad():
        return engine(**batch).logits.float().cpu()


@two_gpus
def test_save_pretrained_from_tp2_gpu(tmp_path):
    from transformers import AutoModelForCausalLM

    results = run_on_ranks(_save_pretrained_run, 2, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).cuda().eval()
    batch = {k: torch.stack([d[k] for d in dataset(4)]).cuda() for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        ref = loaded(**batch).logits.float().cpu()
    for logits in results:
        assert (logits - ref).abs().max().item() < 1e-3
