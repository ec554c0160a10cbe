"""megatron_plugin.Accelerator: bad input is refused before any process group exists; eval mode
returns HF's loss and logits; main_process_first and wait_for_everyone order the ranks."""

import copy

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
                         any(m.config.gradient_accumulation_fusion for m in engine.modules() if hasattr(m, "config"))),
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
