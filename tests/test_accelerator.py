"""megatron_plugin.Accelerator: bad input is refused before any process group exists; eval mode
returns HF's loss and logits; main_process_first and wait_for_everyone order the ranks; accelerate's own
plugin is taken; TensorBoard gets each step's scalars; unwrap_model(model).save_pretrained writes HF."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, expecter
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import LR, optimizer_for, token_dataset


def _bad_inputs_worker():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    def started(name):
        # accelerate's Accelerator() itself opens the process group; what must not have started by
        # then is Megatron: no model-parallel groups, no collectives
        return dist.is_initialized() if name == "grad_accum" else parallel_state.model_parallel_is_initialized()

    errors = {}
    expect = expecter(errors, state=started)

    expect("grad_accum", lambda: Accelerator(megatron_lm_plugin=MegatronLMPlugin(), gradient_accumulation_steps=2))
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=2))
    model = tiny_gpt2()
    data = token_dataset(10, model.config.vocab_size)
    opt = optimizer_for(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=10, warmup_num_steps=1)
    loader = DataLoader(data, batch_size=2, drop_last=True)
    expect("micro_split", lambda: acc.prepare(model, opt, sched, DataLoader(data, batch_size=3)))
    expect("custom_scheduler", lambda: acc.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), loader))
    expect("optimizer", lambda: acc.prepare(model, torch.optim.RMSprop(model.parameters(), lr=LR), sched, loader))
    expect("two_models", lambda: acc.prepare(model, tiny_gpt2(seed=1), opt, sched, loader))
    expect("no_dataloader", lambda: acc.prepare(model, opt, sched))
    expect("no_total_steps", lambda: acc.prepare(model, opt, MegatronLMDummyScheduler(opt), loader))
    cpu_acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(recompute_activations=True))
    expect("cpu_recompute", lambda: cpu_acc.prepare(model, opt, sched, loader))
    compile_acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(torch_compile=True))
    expect("cpu_compile", lambda: compile_acc.prepare(model, opt, sched, loader))
    return errors


def test_bad_input_is_refused_before_distributed_work():
    (errors,) = run_on_ranks(_bad_inputs_worker, 1)
    expected = {
        "grad_accum": ("gradient_accumulation_steps", "num_micro_batches"),
        "micro_split": ("num_micro_batches", "drop_last=True"),
        "custom_scheduler": ("lr_scheduler", "MegatronLMDummyScheduler"),
        "optimizer": ("optimizer", "RMSprop"),
        "two_models": ("prepare(models)", "single model"),
        "no_dataloader": ("prepare(dataloaders)", "DataLoader"),
        "no_total_steps": ("MegatronLMDummyScheduler.total_num_steps", "max_train_steps"),
        "cpu_recompute": ("recompute_activations", "need CUDA"),
        "cpu_compile": ("torch_compile", "CUDA engine only"),
    }
    for name, (setting, words) in expected.items():
        check_refusal(errors[name], setting, words, exact=True, where=name)
        assert errors[name][2] is False, f"{name}: raised after distributed work had started"


def _eval_worker():
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    hf = tiny_gpt2()
    data = token_dataset(8, hf.config.vocab_size)
    for d in data[:4]:  # some padding, which must stay out of the loss
        d["attention_mask"][-3:] = 0
        d["labels"][-3:] = -100
    batch = {k: torch.stack([d[k] for d in data[:4]]) for k in data[0]}
    with torch.no_grad():
        ref = hf(**batch)
    model = tiny_gpt2()
    opt = optimizer_for(model)
    plugin = MegatronLMPlugin(tp_degree=2, return_logits=True)
    before = copy.deepcopy(vars(plugin))
    acc = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=5), DataLoader(data, batch_size=4)
    )
    engine.eval()
    with torch.no_grad():
        out = engine(**batch)
    return {
        "loss_err": abs(out.loss.item() - ref.loss.item()),
        # positions that are tokens (a padding position's logits mean nothing)
        "logits_err": (out.logits - ref.logits).abs()[batch["attention_mask"].bool()].max().item(),
        "shape": tuple(out.logits.shape) == tuple(ref.logits.shape),
        "main_is_last": acc.is_main_process == (acc.process_index == acc.num_processes - 1),
        # prepare decides on a copy: the user's plugin is as it was (a second Accelerator gets it unchanged)
        "plugin_untouched": vars(plugin) == before and acc.state.megatron_lm_plugin is not plugin,
        # the default (None) resolves at prepare, into the accelerator's copy of the plugin (the user's stays
        # as it was); the fused weight-gradient GEMM is CUDA-only
        "wgrad_fusion": (plugin.gradient_accumulation_fusion, acc.state.megatron_lm_plugin.gradient_accumulation_fusion,
                         any(getattr(m.config, "gradient_accumulation_fusion", False)  # engine.config is the HF one
                             for m in engine.modules() if hasattr(m, "config"))),
    }


def test_eval_returns_hf_loss_and_logits_under_tp2():
    for res in run_on_ranks(_eval_worker, 2):
        assert res["shape"] and res["main_is_last"] and res["plugin_untouched"]
        assert res["loss_err"] < 1e-5 and res["logits_err"] < 1e-4, res
        assert res["wgrad_fusion"] == (None, False, False), res


def test_compile_settings_follow_accelerate_dynamo_plugin():
    from accelerate.utils import TorchDynamoPlugin

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.resolve import layer_compile_kwargs

    assert layer_compile_kwargs(MegatronLMPlugin(), TorchDynamoPlugin(backend="no")) is None
    assert layer_compile_kwargs(MegatronLMPlugin(torch_compile=True), TorchDynamoPlugin(backend="no")) == {}
    got = layer_compile_kwargs(MegatronLMPlugin(), TorchDynamoPlugin(backend="inductor", mode="max-autotune"))
    assert got["backend"] == "inductor" and got["mode"] == "max-autotune", got


def _ordering_worker(folder):
    """Each rank notes what it finds on entering a main-process-first block and after a barrier, while the
    main (last) rank writes a file late."""
    import os
    import time

    from megatron_plugin import Accelerator, MegatronLMPlugin

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin())
    first, after = os.path.join(folder, "first"), os.path.join(folder, "after")
    with acc.main_process_first():
        seen_first = os.path.exists(first)
        if acc.is_main_process:
            time.sleep(1.0)
            open(first, "w").close()
    if acc.is_main_process:
        time.sleep(1.0)
        open(after, "w").close()
    acc.wait_for_everyone()
    return acc.is_main_process, seen_first, os.path.exists(after)


def test_main_process_first_and_wait_for_everyone_order_the_ranks(tmp_path):
    """accelerate's wait_for_everyone does nothing under DistributedType.MEGATRON_LM (not in its list), so
    main_process_first let every rank in at once; ours barriers."""
    results = run_on_ranks(_ordering_worker, 2, str(tmp_path))
    assert [r[0] for r in results] == [False, True]  # the last rank is the main one under Megatron
    main, other = results[1], results[0]
    assert main[1] is False and other[1] is True  # the other rank entered after the main one left
    assert other[2] and main[2]  # nobody left the barrier before the main rank wrote


def _accelerate_plugin_worker(which):
    """Train 3 steps with accelerate's own MegatronLMPlugin, or ours with the same settings."""
    from accelerate.utils import MegatronLMDummyScheduler as AccelerateScheduler
    from accelerate.utils import MegatronLMPlugin as AcceleratePlugin

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    kwargs = dict(tp_degree=2, num_micro_batches=2, gradient_clipping=0.5)
    plugin = AcceleratePlugin(**kwargs) if which == "accelerate" else MegatronLMPlugin(**kwargs)
    scheduler = AccelerateScheduler if which == "accelerate" else MegatronLMDummyScheduler
    model = tiny_gpt2()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = acc.prepare(model, opt, scheduler(opt, total_num_steps=3, warmup_num_steps=1),
                                             DataLoader(token_dataset(12, model.config.vocab_size), batch_size=2))
    resolved = acc.state.megatron_lm_plugin
    engine.train()
    losses, lrs = [], []
    for batch, _ in zip(loader, range(3)):
        losses.append(engine(**batch).loss.item())
        lrs.append(sched.get_last_lr()[0])
    return losses + lrs, type(resolved).__module__, {k: getattr(resolved, k) for k in (
        "tp_degree", "num_micro_batches", "gradient_clipping", "context_parallel_size", "recompute_granularity",
        "data_parallel_size", "micro_batch_size", "global_batch_size")}


def test_accelerate_plugin_is_taken_and_trains_like_ours():
    """`Accelerator(megatron_lm_plugin=accelerate.utils.MegatronLMPlugin(...))` converts it (and accelerate's
    MegatronLMDummyScheduler): the same run, losses and learning rates, as with ours; after prepare the resolved
    plugin has accelerate's data_parallel_size / micro_batch_size / global_batch_size, as ints."""
    theirs = run_on_ranks(_accelerate_plugin_worker, 2, "accelerate")
    ours = run_on_ranks(_accelerate_plugin_worker, 2, "ours")
    for (a_losses, a_module, a_plugin), (o_losses, o_module, o_plugin) in zip(theirs, ours):
        assert a_module == o_module == "megatron_plugin.plugin"
        assert a_losses == o_losses and len(a_losses) == 6
        assert a_plugin == o_plugin == {"tp_degree": 2, "num_micro_batches": 2, "gradient_clipping": 0.5,
                                        "context_parallel_size": 1, "recompute_granularity": None,
                                        "data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": 4}
        assert all(type(a_plugin[k]) is int for k in ("data_parallel_size", "micro_batch_size", "global_batch_size"))


def _tensorboard_worker(log_dir):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, tensorboard_dir=log_dir,
                                                          set_all_logging_options=True))
    engine, opt, sched, loader = acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=6, warmup_num_steps=2),
                                             DataLoader(token_dataset(12, model.config.vocab_size), batch_size=4))
    engine.train()
    losses, lrs, norms = [], [], []
    for batch, _ in zip(loader, range(3)):
        losses.append(engine(**batch).loss.item())
        lrs.append(sched.get_last_lr()[0])
        norms.append(acc.clip_grad_norm_(engine.parameters(), 1.0).item())
    # a full-iteration graph's stand-in (CUDA only): end_training drops it before the groups go (NCCL waits for it)
    from megatron_plugin.engine.full_graph import Captured, FullIterationGraph

    graph = FullIterationGraph(1, torch.device("cpu"), places=lambda: [], generators=lambda: [])
    resets = []
    graph._captured["layout"] = Captured(type("G", (), {"reset": lambda self: resets.append(1)})(), [], None, 1, [])
    acc.end_training()  # the HF idiom: closes the writer (its scalars flushed) and every process group
    from megatron.core import parallel_state

    assert not torch.distributed.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert resets == [1] and not graph._captured
    return losses, lrs, norms


def test_tensorboard_dir_gets_the_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_on_ranks(_tensorboard_worker, 2, str(tmp_path))
    losses, lrs, norms = results[0]
    files = [f for f in tmp_path.iterdir() if f.name.startswith("events.out.tfevents")]
    assert len(files) == 1  # global rank 0 writes
    events = EventAccumulator(str(tmp_path))
    events.Reload()

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("lm loss") == [(i + 1, pytest.approx(x, rel=1e-6)) for i, x in enumerate(losses)]
    assert scalars("learning-rate") == [(i + 1, pytest.approx(x, rel=1e-6)) for i, x in enumerate(lrs)]
    assert lrs[0] != lrs[1]  # warmup: the logged rate moves
    assert scalars("grad-norm") == [(i + 1, pytest.approx(x, rel=1e-6)) for i, x in enumerate(norms)]
    assert [v for _, v in scalars("skipped-train-steps")] == [0.0, 0.0, 0.0]
    assert [v for _, v in scalars("batch-size")] == [4.0, 4.0, 4.0]
    params_norm = [v for _, v in scalars("params-norm")]
    assert len(params_norm) == 3 and all(v > 0 for v in params_norm) and params_norm[0] != params_norm[2]
    assert "mem-max-rss-bytes" in events.Tags()["scalars"]


def test_tensorboard_dir_without_the_package_is_refused(tmp_path, monkeypatch):
    import importlib.util

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.tensorboard import check_tensorboard
    from tests.errors import refusal

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    got = refusal(check_tensorboard, MegatronLMPlugin(tensorboard_dir=str(tmp_path)))
    check_refusal(got, "tensorboard_dir", "pip install tensorboard", exact=True)


def _save_pretrained_worker(folder):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2()
    data = token_dataset(12, model.config.vocab_size)
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, return_logits=True))
    engine, opt, sched, loader = acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4),
                                             DataLoader(data, batch_size=4))
    engine.train()
    for batch, _ in zip(loader, range(2)):
        engine(**batch)
    unwrapped = acc.unwrap_model(engine)
    config_ok = unwrapped.config is model.config
    unwrapped.save_pretrained(folder, is_main_process=acc.is_main_process, save_function=acc.save,
                              max_shard_size="100KB", safe_serialization=True)
    engine.eval()
    batch = {k: torch.stack([d[k] for d in data[:4]]) for k in data[0]}
    with torch.no_grad():
        logits = engine(**batch).logits
    refused = None
    try:
        unwrapped.save_pretrained(folder, state_dict={})
    except Exception as err:  # noqa: BLE001 - the test reads which
        refused = (getattr(err, "setting", type(err).__name__), str(err))
    return config_ok, logits, batch, refused


def test_unwrap_model_save_pretrained_writes_what_from_pretrained_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    results = run_on_ranks(_save_pretrained_worker, 2, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded as asked
    for config_ok, logits, batch, refused in results:
        assert config_ok
        with torch.no_grad():
            ref = loaded(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits
        assert (logits - ref).abs().max().item() < 1e-4
        check_refusal(refused, "save_pretrained(state_dict)", "leave state_dict out", exact=True)
