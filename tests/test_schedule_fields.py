"""The schedule and optimizer fields of accelerate's MegatronLMPlugin, with Megatron-LM's meaning: the
learning rate and weight decay of every param group at every step equal Megatron-LM's formula (written
here independently, in samples, as Megatron-LM steps its scheduler); train_iters, train_samples and the
dummy scheduler give the same run; scale_lr_cond/lr_mult and no_wd_decay_cond change exactly the
parameters they select; is_train_batch_min picks the micro-batch; bad values are refused, naming the
field, before any process group exists."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, expecter, refusal
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import LR, optimizer_for, token_dataset

STEPS, MICRO, NUM_MICRO = 6, 2, 2
GLOBAL = MICRO * NUM_MICRO  # one process
# tests.training.optimizer_for: learning rate LR, groups with weight decay 0.1 and 0.0


def megatron_reference(f: dict, global_batch: int, lr: float, own_wd: float, steps: int, total=None, warmup=0):
    """(lr, weight decay) of a param group (peak lr `lr`, weight decay `own_wd`) before each of `steps`
    optimizer steps and after the last, as Megatron-LM computes them: training.py's
    get_optimizer_param_scheduler (the dummy scheduler's steps standing for train_iters / lr_warmup_iters,
    as accelerate's set_scheduler_args passes them) and OptimizerParamScheduler, counted in samples."""
    train_iters = f.get("train_iters") or total
    if f.get("train_samples") is None:
        decay = (f.get("lr_decay_iters") or train_iters) * global_batch
        wd_steps = train_iters * global_batch
        warm = f["lr_warmup_fraction"] * decay if f.get("lr_warmup_fraction") is not None else (
            f.get("lr_warmup_iters") or warmup) * global_batch
    else:
        decay = f.get("lr_decay_samples") or f["train_samples"]
        wd_steps = f["train_samples"]
        warm = f["lr_warmup_fraction"] * decay if f.get("lr_warmup_fraction") is not None else (
            f.get("lr_warmup_samples") or 0)
    style, min_lr = f.get("lr_decay_style", "linear"), f.get("min_lr", 0.0)
    incr = f.get("weight_decay_incr_style", "constant")
    start = f.get("start_weight_decay", own_wd) if own_wd else 0.0
    end = f.get("end_weight_decay", own_wd) if own_wd else 0.0

    def lr_at(n):
        if warm > 0 and n <= warm:
            return lr * n / warm
        if style == "constant":
            return lr
        if n > decay:
            return min_lr
        ratio = (n - warm) / (decay - warm)
        coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (lr - min_lr)

    def wd_at(n):
        if n > wd_steps or incr == "constant":
            return end
        ratio = n / wd_steps
        coeff = ratio if incr == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start + coeff * (end - start)

    return [(lr_at(k * global_batch), wd_at(k * global_batch)) for k in range(steps + 1)]


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)


CASES = {
    "iters_cosine_wd_linear": (dict(train_iters=10, lr_warmup_iters=2, lr_decay_style="cosine", min_lr=1e-4,
                                    weight_decay_incr_style="linear", start_weight_decay=0.01,
                                    end_weight_decay=0.2), {}),
    "decay_iters_fraction": (dict(lr_decay_iters=8, lr_warmup_fraction=0.3, min_lr=2e-4), dict(total=10)),
    "samples_fractional_warmup": (dict(train_samples=80, lr_warmup_samples=12, lr_decay_samples=72,
                                       lr_decay_style="cosine", weight_decay_incr_style="cosine",
                                       start_weight_decay=0.0, end_weight_decay=0.1), {}),
    "samples_fraction": (dict(train_samples=84, lr_warmup_fraction=0.25), {}),  # 10.5 global batches
    "dummy_warmup_agrees": (dict(lr_warmup_iters=3, lr_decay_style="constant"), dict(total=10, warmup=3)),
    "dummy_only": (dict(min_lr=5e-4), dict(total=10, warmup=4)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lr_and_weight_decay_follow_megatron_lm(name):
    from megatron_plugin import MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.engine.scheduler import build_scheduler

    fields, dummy = CASES[name]
    plugin = copy.copy(MegatronLMPlugin(**fields))
    plugin.global_batch_size = 8  # what prepare's resolved plugin carries
    w = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    # the HF groups (decay, no decay) and a scale_lr_cond group as rebuild_optimizer makes it (lr x lr_mult)
    opt = torch.optim.AdamW([{"params": [w[0]], "weight_decay": 0.05}, {"params": [w[1]], "weight_decay": 0.0},
                             {"params": [w[2]], "weight_decay": 0.05, "lr": LR * 0.5, "lr_mult": 0.5}], lr=LR)
    sched = build_scheduler(MegatronLMDummyScheduler(opt, total_num_steps=dummy.get("total"),
                                                     warmup_num_steps=dummy.get("warmup", 0)), opt, plugin)
    steps = 12  # past the end of decay and of the weight-decay increase
    got = []
    for _ in range(steps + 1):
        got.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])
        sched.step(1)
    args = dict(global_batch=8, steps=steps, total=dummy.get("total"), warmup=dummy.get("warmup", 0))
    scaled = dict(fields, min_lr=fields.get("min_lr", 0.0) * 0.5)
    refs = [megatron_reference(fields, lr=LR, own_wd=0.05, **args), megatron_reference(fields, lr=LR, own_wd=0.0, **args),
            megatron_reference(scaled, lr=LR * 0.5, own_wd=0.05, **args)]
    for step in range(steps + 1):
        for gi, ref in enumerate(refs):
            (lr, wd), (ref_lr, ref_wd) = got[step][gi], ref[step]
            assert _close(lr, ref_lr) and _close(wd, ref_wd), (name, step, gi, got[step][gi], ref[step])
    lrs = [s[0][0] for s in got]
    assert lrs[0] == 0.0 and max(lrs) > 0.0, lrs  # every case warms up from 0
    assert len(set(lrs)) > 3 or fields.get("lr_decay_style") == "constant", lrs  # the schedule moves


def _bad(name, fields, total=10, warmup=0, global_batch=8):
    """The refusal of these plugin fields with this dummy scheduler, whether the plugin's own validation or
    the scheduler's check (which also sees the global batch) raises it; None when both accept them."""
    from megatron_plugin import MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.engine.scheduler import check_scheduler

    def check():
        plugin = copy.copy(MegatronLMPlugin(**fields))
        if global_batch is not None:
            plugin.global_batch_size = global_batch  # what prepare's resolved plugin carries
        check_scheduler(MegatronLMDummyScheduler(None, total_num_steps=total, warmup_num_steps=warmup), plugin)

    return refusal(check)


TOTAL, WARMUP = "MegatronLMDummyScheduler.total_num_steps", "MegatronLMDummyScheduler.warmup_num_steps"
# name: (plugin fields, dummy scheduler, the fields the error names, words of its message)
BAD = {
    # Megatron-LM's validate_args: a schedule in iterations or in samples
    "iters_and_samples": (dict(train_iters=10, train_samples=80), {}, ("train_iters", "train_samples"), "80"),
    "decay_iters_warmup_samples": (dict(lr_decay_iters=5, lr_warmup_samples=8), {}, ("lr_decay_iters", "lr_warmup_samples"),
                                   "one kind"),
    "two_warmups": (dict(lr_warmup_fraction=0.1, lr_warmup_iters=2), {}, ("lr_warmup_fraction", "lr_warmup_iters"),
                    "set one of"),
    "negative_fraction": (dict(lr_warmup_fraction=-0.1), {}, ("lr_warmup_fraction",), "-0.1"),
    "whole_fraction": (dict(lr_warmup_fraction=1.0), {}, ("lr_warmup_fraction",), "1.0"),
    "negative_warmup": (dict(lr_warmup_iters=-1), {}, ("lr_warmup_iters",), ">= 0"),
    "zero_train_iters": (dict(train_iters=0), dict(total=None), ("train_iters",), ">= 1"),
    "float_samples": (dict(train_samples=8.5), {}, ("train_samples",), "whole number"),
    "incr_style": (dict(weight_decay_incr_style="exponential"), {}, ("weight_decay_incr_style",), "'linear'"),
    "linear_without_end": (dict(weight_decay_incr_style="linear", start_weight_decay=0.0), {}, ("end_weight_decay",),
                           "set both"),
    "constant_with_start": (dict(start_weight_decay=0.1), {}, ("start_weight_decay",), "'linear'"),
    "decreasing_wd": (dict(weight_decay_incr_style="cosine", start_weight_decay=0.1, end_weight_decay=0.01), {},
                      ("end_weight_decay",), ">= start_weight_decay"),
    "negative_min_lr": (dict(min_lr=-1e-5), {}, ("min_lr",), ">= 0"),
    "negative_lr_mult": (dict(lr_mult=-1.0), {}, ("lr_mult",), "-1.0"),
    "cond_not_callable": (dict(scale_lr_cond="layers.0"), {}, ("scale_lr_cond",), "function"),
    # totals and warmups that disagree
    "total_vs_train_iters": (dict(train_iters=12), {}, (TOTAL, "train_iters"), "10 steps by the scheduler but 12"),
    "total_vs_train_samples": (dict(train_samples=64), {}, (TOTAL, "train_samples"), "8 steps of the global batch 8"),
    "warmup_vs_lr_warmup_iters": (dict(lr_warmup_iters=2), dict(warmup=3), (WARMUP, "lr_warmup_iters"),
                                  "3 steps by the scheduler"),
    "warmup_vs_lr_warmup_samples": (dict(train_samples=80, lr_warmup_samples=12), dict(total=None, warmup=1),
                                    (WARMUP, "lr_warmup_samples"), "1.5 by lr_warmup_samples"),
    "warmup_not_shorter": (dict(train_iters=4, lr_warmup_iters=4), dict(total=None), ("lr_warmup_iters",), "shorter"),
    "no_total": (dict(), dict(total=None), (TOTAL,), "train_iters"),
    "fewer_samples_than_a_batch": (dict(train_samples=6), dict(total=None), ("train_samples",), "one global batch"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_schedule_fields_are_refused(name):
    fields, dummy, settings, *words = BAD[name]
    got = _bad(name, fields, **dummy)
    for setting in settings:
        check_refusal(got, setting, *words, where=name)


def test_good_schedules_pass_and_samples_wait_for_the_batch():
    # a schedule given by the plugin alone, with the dummy scheduler's total_num_steps left to it
    assert _bad("iters", dict(train_iters=10, lr_warmup_iters=2), total=None) is None
    assert _bad("samples", dict(train_samples=80, lr_warmup_samples=8), total=None) is None
    assert _bad("agreeing", dict(train_samples=80), total=10) is None
    # the user's plugin before prepare has no global batch: sample counts are checked once it is known
    assert _bad("samples_unknown_batch", dict(train_samples=64), total=10, global_batch=None) is None


def _e2e_runs():
    """Tiny GPT-2, one CPU process, through prepare: one run per way of giving the schedule, and the
    parameter conditions."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    def run(fields, total=None, warmup=0, weight_decay=0.1):
        model = tiny_gpt2()
        opt = optimizer_for(model, weight_decay=weight_decay)
        data = token_dataset(STEPS * GLOBAL, model.config.vocab_size)
        acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=NUM_MICRO, **fields))
        engine, opt, sched, loader = acc.prepare(
            model, opt, MegatronLMDummyScheduler(opt, total_num_steps=total, warmup_num_steps=warmup),
            DataLoader(data, batch_size=MICRO))
        names = {id(p): n for n, p in engine.model.module.named_parameters()}
        groups = [dict(names=[names[id(p)] for p in g["params"]], lr=g["lr"], max_lr=g["max_lr"],
                       weight_decay=g["weight_decay"], dims=[p.dim() for p in g["params"]]) for g in opt.param_groups]
        before = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
        lrs, wds, losses = [[g["lr"] for g in opt.param_groups]], [[g["weight_decay"] for g in opt.param_groups]], []
        engine.train()
        for batch in loader:
            losses.append(engine(**batch).loss.item())
            lrs.append([g["lr"] for g in opt.param_groups])
            wds.append([g["weight_decay"] for g in opt.param_groups])
        after = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
        return dict(losses=losses, lrs=lrs, wds=wds, groups=groups, before=before, after=after)

    schedule = dict(lr_decay_style="cosine", min_lr=3e-4, weight_decay_incr_style="linear", start_weight_decay=0.02,
                    end_weight_decay=0.2)
    out = {
        "iters": run(dict(schedule, train_iters=STEPS, lr_warmup_iters=2)),
        "samples": run(dict(schedule, train_samples=STEPS * GLOBAL, lr_warmup_samples=2 * GLOBAL)),
        "dummy": run(schedule, total=STEPS, warmup=2),
        # layer 0 frozen by its learning rate; biases, norms and layer 1's MLP without weight decay
        "conds": run(dict(lr_mult=0.0, scale_lr_cond=lambda name, p: name.startswith("decoder.layers.0."),
                          no_wd_decay_cond=lambda name, p: p.dim() == 1 or "layers.1.mlp" in name),
                     total=STEPS, warmup=2),
        # a condition selecting every parameter is an optimizer without weight decay
        "no_wd_anywhere": run(dict(no_wd_decay_cond=lambda name, p: True), total=STEPS, warmup=2),
        "zero_wd": run({}, total=STEPS, warmup=2, weight_decay=0.0),
        "default": run({}, total=STEPS, warmup=2),
    }
    for v in out.values():
        if v is not out["conds"]:
            v.pop("before"), v.pop("after")
    return out


@pytest.fixture(scope="module")
def runs():
    (out,) = run_on_ranks(_e2e_runs, 1)
    return out


def test_train_iters_train_samples_and_dummy_scheduler_give_one_run(runs):
    iters, samples, dummy = runs["iters"], runs["samples"], runs["dummy"]
    assert iters["losses"] == samples["losses"] == dummy["losses"], (iters["losses"], samples["losses"])
    assert iters["lrs"] == samples["lrs"] == dummy["lrs"] and iters["wds"] == samples["wds"] == dummy["wds"]
    assert iters["losses"][-1] < iters["losses"][0]
    fields = dict(train_iters=STEPS, lr_warmup_iters=2, lr_decay_style="cosine", min_lr=3e-4,
                  weight_decay_incr_style="linear", start_weight_decay=0.02, end_weight_decay=0.2)
    for gi, group in enumerate(iters["groups"]):  # optimizer_for's groups: decay 0.1, then none
        ref = megatron_reference(fields, GLOBAL, LR, group["weight_decay"] and 0.1, STEPS)
        assert group["weight_decay"] == (0.02 if gi == 0 else 0.0), group
        for step, (lr, wd) in enumerate(ref):
            assert _close(iters["lrs"][step][gi], lr) and _close(iters["wds"][step][gi], wd), (gi, step)


def test_conditions_change_exactly_the_parameters_they_select(runs):
    conds = runs["conds"]
    seen = set()
    for g in conds["groups"]:
        for name, dim in zip(g["names"], g["dims"]):
            seen.add(name)
            scaled = name.startswith("decoder.layers.0.")
            assert g["max_lr"] == (0.0 if scaled else LR), (name, g["max_lr"])
            no_wd = dim == 1 or "layers.1.mlp" in name
            # no_wd_decay_cond decides for every parameter: the others get the optimizer's decay (0.1)
            assert g["weight_decay"] == (0.0 if no_wd else 0.1), (name, g["weight_decay"])
    assert seen == set(conds["before"])
    frozen = [n for n in conds["before"] if n.startswith("decoder.layers.0.")]
    assert frozen and all(torch.equal(conds["before"][n], conds["after"][n]) for n in frozen)
    moved = [n for n in conds["before"] if n not in frozen]
    assert moved and all(not torch.equal(conds["before"][n], conds["after"][n]) for n in moved)
    assert runs["no_wd_anywhere"]["losses"] == runs["zero_wd"]["losses"]
    assert runs["no_wd_anywhere"]["losses"] != runs["default"]["losses"]  # weight decay shows in the losses


def test_is_train_batch_min_picks_the_micro_batch():
    from megatron_plugin.engine.data import micro_batch_size

    train, evals = DataLoader(list(range(8)), batch_size=4), DataLoader(list(range(8)), batch_size=2)
    assert micro_batch_size([train, evals], [], SimpleNamespace(is_train_batch_min=True)) == 2
    # accelerate's rule: False takes the largest (the train loader's, when it is the larger)
    assert micro_batch_size([train, evals], [], SimpleNamespace(is_train_batch_min=False)) == 4
    assert micro_batch_size([train], [], SimpleNamespace(is_train_batch_min=True)) == 4
    assert micro_batch_size([], [SimpleNamespace(micro_batch_size=3)], SimpleNamespace(is_train_batch_min=True)) == 3


def _batch_min_run(batch_min):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2()
    opt = optimizer_for(model)
    data = token_dataset(16, model.config.vocab_size)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=NUM_MICRO, is_train_batch_min=batch_min))
    engine, opt, sched, train, evals = acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=4),
                                                   DataLoader(data, batch_size=4), DataLoader(data, batch_size=2))
    plugin = acc.state.megatron_lm_plugin
    return plugin.micro_batch_size, plugin.global_batch_size, len(next(iter(train))["input_ids"]), \
        len(next(iter(evals))["input_ids"])


def test_is_train_batch_min_through_prepare():
    # both loaders are cut into the chosen micro-batch, num_micro_batches of them per step (as accelerate does)
    assert run_on_ranks(_batch_min_run, 1, True) == [(2, 4, 4, 4)]
    assert run_on_ranks(_batch_min_run, 1, False) == [(4, 8, 8, 8)]


def _bad_inputs_worker():
    from megatron.core import parallel_state

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    errors = {}
    expect = expecter(errors, state=lambda name: parallel_state.model_parallel_is_initialized())
    model = tiny_gpt2()
    data = token_dataset(16, model.config.vocab_size)

    def attempt(name, total=8, **fields):
        opt = optimizer_for(model)
        expect(name, lambda: Accelerator(megatron_lm_plugin=MegatronLMPlugin(**fields)).prepare(
            model, opt, MegatronLMDummyScheduler(opt, total_num_steps=total), DataLoader(data, batch_size=2)))

    attempt("mixed", train_iters=8, lr_warmup_samples=4)
    attempt("incr_style", weight_decay_incr_style="exp")
    attempt("samples_disagree", train_samples=40)  # 20 global batches of 2, not the scheduler's 8 steps
    attempt("custom_fsdp", use_custom_fsdp=True)
    attempt("precision_aware_on_cpu", use_precision_aware_optimizer=True)
    attempt("overlap_without_offload", overlap_cpu_optimizer_d2h_h2d=True)
    attempt("consumed_with_torch_loader", consumed_samples=[8])
    # the CPU engine's optimizer already lives on the CPU: offload is accepted there
    attempt("cpu_offload_on_cpu", optimizer_cpu_offload=True)
    return errors


def test_bad_fields_are_refused_before_distributed_work():
    (errors,) = run_on_ranks(_bad_inputs_worker, 1)
    expected = {
        "mixed": ("train_iters and lr_warmup_samples", "not both"),
        "incr_style": ("weight_decay_incr_style", "exp"),
        "samples_disagree": ("MegatronLMDummyScheduler.total_num_steps and train_samples", "20 steps"),
        "custom_fsdp": ("use_custom_fsdp", "use_distributed_optimizer=True"),
        "precision_aware_on_cpu": ("use_precision_aware_optimizer", "CPU run"),
        "overlap_without_offload": ("overlap_cpu_optimizer_d2h_h2d", "optimizer_cpu_offload=True"),
        "consumed_with_torch_loader": ("consumed_samples", "skip_first_batches"),
    }
    for name, (setting, *words) in expected.items():
        check_refusal(errors[name], setting, *words, exact=True, where=name)
        assert errors[name][2] is False, f"{name}: raised after Megatron's groups were built"
    assert errors["cpu_offload_on_cpu"] is None


def test_optimizer_fields_on_cuda_are_checked_without_a_gpu():
    """What the CUDA engine cannot run, refused by the same pure check (megatron-core 0.16.1's rules)."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.optimizer import check_optimizer_fields

    w = [torch.nn.Parameter(torch.zeros(2))]
    adamw, adam, sgd = torch.optim.AdamW(w), torch.optim.Adam(w), torch.optim.SGD(w, lr=0.1)

    def check(opt, **fields):
        return refusal(check_optimizer_fields, MegatronLMPlugin(**fields), opt, "cuda")

    check_refusal(check(adam, optimizer_cpu_offload=True, use_distributed_optimizer=True), "optimizer_cpu_offload",
                  "AdamW", exact=True)
    check_refusal(check(sgd, use_precision_aware_optimizer=True, use_distributed_optimizer=True),
                  "use_precision_aware_optimizer", "SGD", exact=True)
    check_refusal(check(adamw, optimizer_cpu_offload=True), "optimizer_cpu_offload", "use_distributed_optimizer=True",
                  exact=True)
    check_refusal(check(adamw, optimizer_cpu_offload=True, use_distributed_optimizer=True), "optimizer_cpu_offload",
                  "no_save_optim=True", exact=True)
    assert check(adamw, optimizer_cpu_offload=True, use_distributed_optimizer=True, no_save_optim=True,
                 overlap_cpu_optimizer_d2h_h2d=True) is None
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        check_refusal(check(adamw, use_precision_aware_optimizer=True, use_distributed_optimizer=True),
                      "use_precision_aware_optimizer", "Transformer Engine", exact=True)
