"""benchmarks/moe_throughput.py counts Qwen3-MoE's (active) parameters as the HF model holds them, and its
HF and plugin modes train the same model on the same tokens (a CPU smoke run of the GPU benchmark)."""

import json
import os
import subprocess
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)

from moe_throughput import flops_per_token, model_config, param_counts  # noqa: E402


@pytest.mark.parametrize("extra", [{}, {"mlp_only_layers": [0], "attention_bias": True},
                                   {"decoder_sparse_step": 2, "tie_word_embeddings": True}])
def test_parameter_counts_are_the_hf_models(extra):
    from transformers import AutoModelForCausalLM

    cfg = model_config("qwen3-moe-tiny", 64)
    for key, value in extra.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg)
    total, active = param_counts(cfg)
    assert total == sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert expert_params > 0
    unused = expert_params * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    assert active == total - unused


def test_flops_count_reproduces_the_issues_baseline_mfu():
    # issue 26 measured HF + compile at 13,545 tok/s = 5.8% MFU on one H100 (989 TFLOP/s bf16 dense)
    # at this shape; the same count of active parameters gives the same figure
    cfg = model_config("qwen3-moe-small", 2048)
    total, active = param_counts(cfg)
    assert 2.18e9 < total < 2.19e9 and 0.60e9 < active < 0.61e9
    assert round(13545 * flops_per_token(cfg, 2048) / 989e12, 3) == 0.058


def test_hf_and_plugin_modes_train_alike_on_cpu(tmp_path):
    rows = tmp_path / "rows.jsonl"
    cmd = [sys.executable, os.path.join(BENCH, "moe_throughput.py"), "--size", "qwen3-moe-tiny", "--device", "cpu",
           "--modes", "hf_eager,megatron", "--seq", "64", "--global_batch", "4", "--num_micro", "2", "--steps", "3",
           "--warmup", "1", "--aux_loss", "--rows", str(rows),
           "--profile", str(tmp_path / "prof"), "--profile_steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["mode"]: r for r in map(json.loads, rows.read_text().splitlines())}
    assert set(got) == {"hf_eager +aux loss", "megatron +aux loss"}, proc.stdout[-3000:]
    hf, ours = got["hf_eager +aux loss"]["losses"], got["megatron +aux loss"]["losses"]
    # the plugin runs fp32 on CPU, HF under bf16 autocast: equal to bf16's rounding, and both learn
    assert torch.allclose(torch.tensor(ours), torch.tensor(hf), rtol=2e-3), (hf, ours)
    assert hf[-1] < hf[0] and ours[-1] < ours[0]
    assert all(r["tok_s"] > 0 and len(r["steps_ms"]) == 3 for r in got.values())
    for mode in ("hf_eager", "megatron"):  # without CUDA the profile lists host ops
        summary = (tmp_path / "prof" / f"qwen3-moe-tiny_{mode}_summary.txt").read_text()
        assert "no CUDA kernels recorded" in summary and "aten::" in summary, summary
        assert (tmp_path / "prof" / f"qwen3-moe-tiny_{mode}_trace.json.gz").stat().st_size > 1000


def test_step_watch_names_what_happened_in_which_step(monkeypatch):
    """bench_steps.StepWatch (train_throughput's and moe_throughput's per-step events): a full collection and a
    new compile are charged to the steps they happened in, the host time of each step is kept, so is its time
    waiting in CUDA event syncs (the engine's one sync a step), and timed_steps hands the report over."""
    import gc
    import time

    from bench_steps import timed_steps

    # a stand-in for the CUDA event wait (no GPU here): 30 ms, which the watch must charge to step 2 only
    def slow_wait(event):
        time.sleep(0.03)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", slow_wait)

    double = torch.compile(lambda x: x * 2, backend="eager")
    seen = []

    def step():
        i = len(seen)
        seen.append(i)
        if i == 1:
            double(torch.ones(3))  # a first compile
        if i == 3:
            gc.collect()  # a full collection
        if i == 2:
            torch.cuda.Event.synchronize(None)  # the step waits for the GPU
        if i == 4:
            time.sleep(0.05)  # a host stall
        return torch.tensor(float(i))

    events = {}
    dt, step_ms, peak, losses = timed_steps(step, 6, torch.device("cpu"), events=events)
    assert torch.cuda.Event.synchronize is slow_wait  # put back after the window
    assert losses == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and peak is None
    got = events["step_events"]
    assert [i for i, what in got if what == "1 Dynamo frame(s) compiled"] == [1], got
    assert 3 in [i for i, what in got if what.startswith("gc gen2 ")], got
    assert not any(i in (0, 2, 5) for i, _ in got), got
    assert events["gc_full"] >= 1 and events["gc_ms"] > 0
    host = events["host_ms"]
    assert len(host) == 6 and host[4] >= 50 and max(host[0], host[2], host[5]) < 50, host
    wait = events["sync_wait_ms"]
    assert len(wait) == 6 and wait[2] >= 30 and max(wait[:2] + wait[3:]) == 0.0, wait
    assert "allocator" not in events  # CUDA only


def test_host_report_says_where_the_run_ran(monkeypatch):
    """bench_steps.host_report (the benchmarks' JSON `host`): the CPU the process last ran on is one it may run on,
    the CPU count and load are this machine's, and the GPU's clock, power and throttle reasons are read from
    nvidia-smi's CSV (None without it, as on this CPU machine)."""
    import types

    import bench_steps

    got = bench_steps.host_report(12.34)
    assert got["setup_s"] == 12.3 and got["cpus"] == len(os.sched_getaffinity(0)) >= 1
    assert got["cpu"] in range(os.cpu_count()) and got["load1"] >= 0
    monkeypatch.setattr(bench_steps.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError()))
    assert bench_steps.host_report(0)["sm_mhz"] is None
    seen = []

    def fake_smi(cmd, **kwargs):  # a driver that knows only the older name of the reasons' field
        seen.append(cmd)
        if "clocks_event_reasons" in cmd[1]:
            return types.SimpleNamespace(returncode=2, stdout='Field "clocks_event_reasons.active" is not valid')
        return types.SimpleNamespace(returncode=0, stdout="1980, 612.31, 0x0000000000000000\n")

    monkeypatch.setattr(bench_steps.subprocess, "run", fake_smi)
    monkeypatch.setenv("LOCAL_RANK", "1")
    got = bench_steps.host_report(0)
    assert (got["sm_mhz"], got["power_w"], got["throttle"]) == ("1980", "612.31", "0x0000000000000000")
    assert len(seen) == 2 and seen[1][0] == "nvidia-smi" and seen[1][-2:] == ["-i", "1"]


def test_cpp_wrapper_switch_overrides_the_engines_choice(monkeypatch):
    """train_throughput/profile_step --cpp_wrapper: "on" and "off" decide the wrapper of every compiled layer in the
    process (so one run can time FP8 layers under the C++ wrapper the engine does not give them); "auto" leaves the
    engine's own rule in place."""
    from train_throughput import choose_cpp_wrapper, parser

    from megatron_plugin.engine import gpu

    engine_rule = gpu.wants_cpp_wrapper
    monkeypatch.setattr(gpu, "wants_cpp_wrapper", engine_rule)  # restored after the test
    assert parser("x").parse_args([]).cpp_wrapper == "auto"
    choose_cpp_wrapper("auto")
    assert gpu.wants_cpp_wrapper is engine_rule
    for choice, want in (("on", True), ("off", False)):
        choose_cpp_wrapper(choice)
        assert gpu.wants_cpp_wrapper(torch.nn.Linear(2, 2), {}) is want
    with pytest.raises(SystemExit):
        parser("x").parse_args(["--cpp_wrapper", "yes"])
    choose_cpp_wrapper("auto")  # no refusal where nothing is forced
    with pytest.raises(SystemExit, match="--cpp_wrapper on with --cp 2: .* use --cpp_wrapper auto"):
        choose_cpp_wrapper("on", 1, 2)
    choose_cpp_wrapper("on", 2, 1)  # TP's ops skip the wrapper's tuning run (compiled_linear)
    assert gpu.wants_cpp_wrapper(torch.nn.Linear(2, 2), {}) is True
    choose_cpp_wrapper("off", 2, 1)  # the Python wrapper runs anywhere
    assert gpu.wants_cpp_wrapper(torch.nn.Linear(2, 2), {}) is False


def test_profile_counts_each_nccl_kernel_once(capsys):
    """c10d records an "nccl:all_gather"-style range on the GPU around each NCCL kernel: profile_step's kernel
    time counts the kernel, not the range too (a TP = 2 profile read 176 ms of communication for 88)."""
    from types import SimpleNamespace

    from profile_step import summarize

    cuda = torch.autograd.DeviceType.CUDA

    def event(name, us, annotation=False):
        return SimpleNamespace(name=name, device_type=cuda, device_time=us, is_user_annotation=annotation)

    events = [event("ncclDevKernel_AllGather_RING_LL", 3000.0), event("nccl:_all_gather_base", 3000.0, True),
              event("nvjet_sm90_tst_320x128", 1000.0), event("Optimizer.step#AdamW.step", 500.0, True)]
    summarize(SimpleNamespace(events=lambda: events), 1, 0.005, "t")
    out = capsys.readouterr().out
    assert "kernels 4.0 ms (80% busy), 2 kernels/step" in out, out
    assert "3.00 ms   75.0%  communication" in out, out


def test_full_graph_flag_captures_in_the_last_warm_up_step():
    """train_throughput/profile_step --full_graph: Megatron's names in other_megatron_args, and a warm-up one step
    shorter than the script's, so that the capture (seconds) happens in a warm-up step, never in a timed one; the
    plugin takes the result."""
    from train_throughput import megatron_args, parser

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.plugin import full_iteration_graph

    assert megatron_args(parser("x").parse_args([])) == {}
    args = megatron_args(parser("x").parse_args(["--full_graph", "--warmup", "3"]))
    assert args == {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration", "cuda_graph_warmup_steps": 2}
    assert full_iteration_graph(MegatronLMPlugin(other_megatron_args=args)) == 2
    assert megatron_args(parser("x").parse_args(["--full_graph", "--warmup", "1"]))["cuda_graph_warmup_steps"] == 1
