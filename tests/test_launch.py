"""The product as a user runs it: `accelerate launch` of the example on CPU, resume, questionnaire."""
import json
import os
import subprocess
import sys

import pytest

from tests.launch import CONFIGS, EXAMPLE, ROOT, accelerate_launch, step_losses


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    # built once from the shipped corpus; every run below reads it so they tokenize alike
    from examples.megatron_lm_gpt_pretraining import build_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(os.path.join(ROOT, "examples", "data", "corpus.txt"), 2048, path)
    return path


@pytest.mark.parametrize("config", ["cpu_tp2.yaml", "cpu_dp2.yaml"])
def test_example_trains(config, tokenizer_dir, tmp_path):
    out = accelerate_launch(
        os.path.join(CONFIGS, config), EXAMPLE, "--output_dir", tmp_path, "--tokenizer_name", tokenizer_dir,
        "--max_train_steps", 80, "--log_every", 1, "--max_eval_batches", 10,
    )
    losses = [float(v) for _, v in sorted(step_losses(out).items())]
    assert len(losses) == 80
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, losses
    assert "perplexity" in out
    assert os.path.exists(os.path.join(tmp_path, "final", "latest_checkpointed_iteration.txt"))


def test_resume_is_bit_identical(tokenizer_dir, tmp_path):
    cfg = os.path.join(CONFIGS, "cpu_tp2.yaml")
    common = ["--tokenizer_name", tokenizer_dir, "--max_train_steps", 20, "--log_every", 1, "--max_eval_batches", 2]
    straight = step_losses(accelerate_launch(cfg, EXAMPLE, "--output_dir", tmp_path / "a", *common))
    first = step_losses(accelerate_launch(
        cfg, EXAMPLE, "--output_dir", tmp_path / "b", "--stop_after_steps", 10, "--checkpointing_steps", 10, *common))
    second = step_losses(accelerate_launch(
        cfg, EXAMPLE, "--output_dir", tmp_path / "b", "--resume_from_checkpoint", tmp_path / "b" / "step_10", *common))
    assert sorted(straight) == list(range(1, 21))
    assert sorted(first) == list(range(1, 11)) and sorted(second) == list(range(11, 21))
    assert {**first, **second} == straight


def test_indexed_data_example_learns_and_resumes_bit_identical(tokenizer_dir, tmp_path):
    """The guide's Megatron indexed-dataset loop (examples/megatron_lm_gpt_indexed_pretraining.py) under DP=2:
    the loss falls, evaluation runs, and a run stopped and resumed reads on where it stopped (same losses)."""
    cfg, script = os.path.join(CONFIGS, "cpu_dp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_gpt_indexed_pretraining.py")
    common = ["--tokenizer_name", tokenizer_dir, "--max_train_steps", 60, "--log_every", 1, "--eval_interval", 30,
              "--eval_iters", 2]
    out = accelerate_launch(cfg, script, "--output_dir", tmp_path / "a", *common)
    straight = step_losses(out)
    losses = [float(straight[k]) for k in sorted(straight)]
    assert len(losses) == 60 and sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, losses
    assert out.count("eval_loss") == 2 and out.count("wrote ") == 1, out[-3000:]
    first = step_losses(accelerate_launch(cfg, script, "--output_dir", tmp_path / "b", "--stop_after_steps", 30, *common))
    second = step_losses(accelerate_launch(cfg, script, "--output_dir", tmp_path / "b", "--resume_from_checkpoint",
                                           tmp_path / "b" / "step_30", *common))
    assert sorted(first) == list(range(1, 31)) and sorted(second) == list(range(31, 61))
    assert {**first, **second} == straight


def test_questionnaire_yaml_launches(tmp_path):
    cfg = tmp_path / "megatron_gpt_config.yaml"
    # answers to the real prompts, in order: cpu, tp, micro-batches, clip, procs, precision (on CPU the
    # CUDA-only questions - sequence parallelism, pipeline, recompute, distributed optimizer - are not asked)
    answers = "yes\n2\n4\n0.5\n2\nbf16\n"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_plugin.cli", "config", "--config_file", str(cfg)],
        input=answers, capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Tensor Parallelism degree" in proc.stdout and "micro-batches" in proc.stdout
    out = accelerate_launch(str(cfg), os.path.join(ROOT, "tests", "scripts", "print_plugin.py"))
    line = next(l for l in out.splitlines() if l.startswith("PLUGIN "))
    got = json.loads(line[len("PLUGIN "):])
    assert got == {
        "tp": 2, "pp": 1, "sp": False, "num_micro_batches": 4, "recompute": False, "distributed_optimizer": False,
        "gradient_clipping": 0.5, "num_processes": 2, "mixed_precision": "bf16",
        "distributed_type": "DistributedType.MEGATRON_LM", "main_is_last": True,
    }


def test_questionnaire_flags_and_gpu_answers(tmp_path):
    from megatron_plugin.cli import main

    cfg = tmp_path / "gpu.yaml"
    assert main(["config", "--config_file", str(cfg), "--non_interactive", "--tp", "2", "--pp", "2",
                 "--num_micro_batches", "4", "--num_processes", "8", "--mixed_precision", "bf16"]) == 0
    import yaml

    data = yaml.safe_load(cfg.read_text())
    assert data["distributed_type"] == "MEGATRON_LM" and data["num_processes"] == 8 and data["use_cpu"] is False
    assert data["megatron_lm_config"] == {
        "megatron_lm_gradient_clipping": 1.0, "megatron_lm_num_micro_batches": 4, "megatron_lm_pp_degree": 2,
        "megatron_lm_recompute_activations": True, "megatron_lm_sequence_parallelism": True,
        "megatron_lm_tp_degree": 2, "megatron_lm_use_distributed_optimizer": True,
    }
    assert "dynamo_config" not in data
    compiled = tmp_path / "compiled.yaml"
    assert main(["config", "--config_file", str(compiled), "--non_interactive", "--pp", "2", "--num_processes", "4",
                 "--mixed_precision", "bf16", "--compile", "yes"]) == 0
    assert yaml.safe_load(compiled.read_text())["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}  # accelerate launch reads it
    # a layout that does not fit the processes is refused, naming the setting, and nothing is written
    bad = tmp_path / "bad.yaml"
    assert main(["config", "--config_file", str(bad), "--non_interactive", "--tp", "4", "--num_processes", "6"]) == 2
    assert not bad.exists()
    cpu_compile = tmp_path / "cpu_compile.yaml"
    assert main(["config", "--config_file", str(cpu_compile), "--non_interactive", "--cpu", "yes", "--compile", "yes"]) == 2
    assert not cpu_compile.exists()
    tp_compile = tmp_path / "tp_compile.yaml"  # compiled layers with TP > 1 (the TP linears stay eager)
    assert main(["config", "--config_file", str(tp_compile), "--non_interactive", "--tp", "2", "--num_processes", "2",
                 "--compile", "yes"]) == 0
    assert yaml.safe_load(tp_compile.read_text())["dynamo_config"] == {"dynamo_backend": "INDUCTOR"}


def test_questionnaire_takes_the_other_megatron_lm_keys_as_flags(tmp_path, capsys):
    """Every other megatron_lm_* key of accelerate's config: a flag of the plugin field's name, written to the YAML
    under accelerate's key (which `accelerate launch` turns into MEGATRON_LM_*), checked as the script checks it."""
    import yaml

    from megatron_plugin.cli import EXTRA_KEYS, main, plugin_from_yaml
    from megatron_plugin.launch_config import known_megatron_keys

    cfg = tmp_path / "more.yaml"
    assert main(["config", "--config_file", str(cfg), "--non_interactive", "--cpu", "--num_processes", "2",
                 "--tp", "2", "--attention_dropout", "0.1", "--no_save_optim", "yes", "--recompute_method", "block",
                 "--attention_backend", "auto", "--expert_tensor_parallel_size", "2",
                 "--calculate_per_token_loss", "true"]) == 0
    data = yaml.safe_load(cfg.read_text())
    got = data["megatron_lm_config"]
    assert {k: got[k] for k in ("megatron_lm_attention_dropout", "megatron_lm_no_save_optim", "megatron_lm_recompute_method",
                                "megatron_lm_attention_backend", "megatron_lm_expert_tensor_parallel_size",
                                "megatron_lm_calculate_per_token_loss")} == {
        "megatron_lm_attention_dropout": 0.1, "megatron_lm_no_save_optim": True, "megatron_lm_recompute_method": "block",
        "megatron_lm_attention_backend": "auto", "megatron_lm_expert_tensor_parallel_size": 2,
        "megatron_lm_calculate_per_token_loss": True}
    assert set(got) <= known_megatron_keys()  # accelerate launch takes every key written
    assert {key for key, _ in EXTRA_KEYS.values()} | {
        "megatron_lm_tp_degree", "megatron_lm_pp_degree", "megatron_lm_num_micro_batches", "megatron_lm_gradient_clipping",
        "megatron_lm_sequence_parallelism", "megatron_lm_recompute_activations",
        "megatron_lm_use_distributed_optimizer"} == known_megatron_keys()  # and every key accelerate knows is offered
    plugin = plugin_from_yaml(data, str(cfg))  # what the launched processes will build
    assert (plugin.attention_dropout, plugin.no_save_optim, plugin.recompute_method, plugin.attention_backend,
            plugin.calculate_per_token_loss) == (0.1, True, "block", "auto", True)
    # refused values are refused under the flag's name, and nothing is written
    for flags, setting in ((["--context_parallel_size", "2", "--num_processes", "3"], "--tp * --context_parallel_size * --pp"),
                           (["--context_parallel_size", "0"], "--context_parallel_size"),
                           (["--expert_model_parallel_size", "2"], "--expert_model_parallel_size"),
                           (["--use_custom_fsdp", "true"], "--use_custom_fsdp"),
                           (["--hidden_dropout", "lots"], "--hidden_dropout")):
        bad = tmp_path / f"{setting[2:]}.yaml"
        capsys.readouterr()
        assert main(["config", "--config_file", str(bad), "--non_interactive", "--cpu", *flags]) == 2, flags
        assert capsys.readouterr().err.startswith(f"error: {setting}="), flags
        assert not bad.exists()


# A config `accelerate launch` cannot take gave its raw traceback (a YAML error, a ValueError on an unknown key or
# value, an AttributeError on a bare `no`), or was ignored without a word; `megatron-plugin launch` refuses it
# first, naming the file, the setting and the fix. name: (file text, file suffix, what the error must hold)
CPU = "distributed_type: MEGATRON_LM\nuse_cpu: true\n"
BAD_CONFIGS = {
    "not_yaml": (CPU + "num_processes: [2\n", ".yaml", ["--config_file=", "not valid YAML at line 4", "megatron-plugin config"]),
    "not_json": ('{"distributed_type": "MEGATRON_LM",}', ".json", ["--config_file=", "not valid JSON at line 1"]),
    "not_utf8": (b"\xff\xfe distributed_type", ".yaml", ["--config_file=", "not UTF-8"]),
    "a_list": ("- distributed_type: MEGATRON_LM\n", ".yaml", ["--config_file=", "holds a list", "key: value"]),
    "empty": ("", ".yaml", ["--config_file=", "is empty", "megatron-plugin config"]),
    "unknown_key": (CPU + "num_process: 2\n", ".yaml", ["key in ", "'num_process'", "did you mean 'num_processes'"]),
    "distributed_type": ("distributed_type: MEGATRON\nnum_processes: 1\n", ".yaml",
                         ["distributed_type in ", "'MEGATRON'", "did you mean 'MEGATRON_LM'"]),
    "no_distributed_type": ("num_processes: 1\n", ".yaml", ["distributed_type in ", "add `distributed_type: MEGATRON_LM`"]),
    "megatron_keys_ignored": ("distributed_type: MULTI_CPU\nnum_processes: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n",
                              ".yaml", ["distributed_type in ", "'MULTI_CPU'", "only with `distributed_type: MEGATRON_LM`"]),
    "no_num_processes": (CPU, ".yaml", ["num_processes in ", "add `num_processes: N`"]),
    "mixed_precision": (CPU + "num_processes: 1\nmixed_precision: bf17\n", ".yaml",
                        ["mixed_precision in ", "'bf17'", "did you mean 'bf16'"]),
    "bare_no": (CPU + "num_processes: 1\nmixed_precision: no\n", ".yaml", ["mixed_precision in ", "=False", "quote the value"]),
    "compute_environment": (CPU + "num_processes: 1\ncompute_environment: LOCAL\n", ".yaml",
                            ["compute_environment in ", "'LOCAL'", "LOCAL_MACHINE"]),
    "dynamo_backend": (CPU + "num_processes: 1\ndynamo_config:\n  dynamo_backend: INDUCTR\n", ".yaml",
                       ["dynamo_config.dynamo_backend in ", "did you mean 'INDUCTOR'"]),
    # the Megatron settings, checked as the launched script checks them: against the processes and the device
    "layout": (CPU + "num_processes: 3\nmegatron_lm_config:\n  megatron_lm_tp_degree: 2\n", ".yaml",
               ["megatron_lm_tp_degree*megatron_lm_pp_degree in ", "world size 3", "multiple of 2"]),
    "not_a_number": (CPU + "num_processes: 2\nmegatron_lm_config:\n  megatron_lm_tp_degree: two\n", ".yaml",
                     ["megatron_lm_config.megatron_lm_tp_degree in ", "'two'", "whole number"]),
    "cuda_only_on_cpu": (CPU + "num_processes: 2\nmegatron_lm_config:\n  megatron_lm_pp_degree: 2\n", ".yaml",
                         ["megatron_lm_config.megatron_lm_pp_degree in ", "need CUDA", "pp_degree=1"]),
    "fp16_on_cpu": (CPU + "num_processes: 1\nmixed_precision: fp16\n", ".yaml", ["mixed_precision in ", "fp16 needs CUDA"]),
    # the keys accelerate's integration added, checked like the others
    "context_parallel": (CPU + "num_processes: 6\nmegatron_lm_config:\n  megatron_lm_context_parallel_size: 2\n"
                         "  megatron_lm_tp_degree: 2\n", ".yaml",
                         ["megatron_lm_tp_degree*megatron_lm_context_parallel_size*megatron_lm_pp_degree in ",
                          "'2*2*1=4'", "world size 6", "multiple of 4"]),
    "context_parallel_zero": (CPU + "num_processes: 2\nmegatron_lm_config:\n  megatron_lm_context_parallel_size: 0\n",
                              ".yaml", ["megatron_lm_config.megatron_lm_context_parallel_size in ", "=0", ">= 1"]),
    "custom_fsdp": (CPU + "num_processes: 1\nmegatron_lm_config:\n  megatron_lm_use_custom_fsdp: true\n", ".yaml",
                    ["megatron_lm_config.megatron_lm_use_custom_fsdp in ", "use_distributed_optimizer=True"]),
    "dropout": (CPU + "num_processes: 1\nmegatron_lm_config:\n  megatron_lm_attention_dropout: 1.5\n", ".yaml",
                ["megatron_lm_config.megatron_lm_attention_dropout in ", "[0, 1)"]),
    "recompute_method": (CPU + "num_processes: 1\nmegatron_lm_config:\n  megatron_lm_recompute_method: blocks\n", ".yaml",
                         ["megatron_lm_config.megatron_lm_recompute_method in ", "'blocks'", "uniform"]),
    "dynamo_mode": (CPU + "num_processes: 1\ndynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: reduce_overhead\n",
                    ".yaml", ["dynamo_config.dynamo_mode in ", "did you mean 'reduce-overhead'"]),
    "fp8_on_cpu": (CPU + "num_processes: 1\nmixed_precision: fp8\n", ".yaml", ["mixed_precision in ", "='fp8'", "unset on CPU"]),
}


def test_launch_refuses_bad_configs_before_starting_anything(tmp_path, monkeypatch, capsys):
    from megatron_plugin import cli

    def no_launch(*args):
        raise AssertionError(f"launched: {args}")

    monkeypatch.setattr(cli.os, "execv", no_launch)
    for name, (text, suffix, words) in BAD_CONFIGS.items():
        path = tmp_path / f"{name}{suffix}"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        assert cli.main(["launch", "--config_file", str(path), "train.py"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err, (name, err)
        for w in words:
            assert w in err, (name, w, err)


def test_launch_checks_the_compile_mode_as_the_launched_script_will(tmp_path, monkeypatch):
    """accelerate's dynamo_mode reaches torch.compile in the launched processes: a mode that replays CUDA graphs is
    refused with FP8 (mixed_precision fp8) before anything starts, naming the setting as written; the default mode
    and no compile pass. (On a CUDA machine: the launcher checks the device it will run on.)"""
    from megatron_plugin import cli
    from megatron_plugin.errors import MegatronPluginConfigError

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    base = "distributed_type: MEGATRON_LM\nnum_processes: 1\nmixed_precision: fp8\n"
    path = str(tmp_path / "cfg.yaml")
    graphs = {"dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "reduce-overhead"}}
    import yaml

    data = yaml.safe_load(base)
    with pytest.raises(MegatronPluginConfigError) as err:
        cli.plugin_from_yaml({**data, **graphs}, path)
    assert err.value.setting == f"mixed_precision in {path}" and err.value.value == "fp8", err.value
    assert "'reduce-overhead' replays CUDA graphs" in str(err.value), err.value
    for dynamo in ({"dynamo_backend": "INDUCTOR"}, {"dynamo_backend": "INDUCTOR", "dynamo_mode": "default"}, {}):
        assert cli.plugin_from_yaml({**data, "dynamo_config": dynamo}, path).fp8 == "hybrid"
    # bf16 under CUDA graphs: the fused weight gradient resolves to off there, nothing to refuse
    assert cli.plugin_from_yaml({**data, **graphs, "mixed_precision": "bf16"}, path).fp8 is None


def test_launch_starts_a_good_config_and_refuses_a_bad_one_without_traceback(tmp_path):
    """`megatron-plugin launch` end to end: a good config runs the script; a bad one exits 2 with one line."""
    script = tmp_path / "train.py"
    script.write_text("import os\nprint('LAUNCHED', os.environ['ACCELERATE_USE_MEGATRON_LM'], os.environ['MEGATRON_LM_TP_DEGREE'])\n")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(CPU + "num_processes: 1\nmixed_precision: 'no'\nmegatron_lm_config:\n  megatron_lm_tp_degree: 1\n")
    bad.write_text(CPU + "num_processes: 1\nmixed_precision: no\n")
    cmd = [sys.executable, "-m", "megatron_plugin.cli", "launch", "--config_file"]
    proc = subprocess.run([*cmd, str(good), str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "LAUNCHED true 1" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([*cmd, str(bad), str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "LAUNCHED" not in proc.stdout, proc.stderr
    assert f"mixed_precision in {bad}=False: YAML reads a bare no as False: quote the value" in proc.stderr, proc.stderr


def test_llama_sft_example_learns(tmp_path):
    """The SFT example (loss on responses only) under DP=2: response loss falls and greedy answers improve."""
    out = accelerate_launch(os.path.join(CONFIGS, "cpu_dp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_llama_sft.py"),
                            "--output_dir", tmp_path, "--num_train_epochs", 2)
    import re

    before = float(re.search(r"accuracy before fine-tuning: ([\d.]+)%", out).group(1))
    after = float(re.search(r"accuracy after fine-tuning: ([\d.]+)%", out).group(1))
    evals = [float(x) for x in re.findall(r"eval response loss ([\d.]+)", out)]
    assert len(evals) == 2 and evals[1] < evals[0] < 1.0, out[-2000:]
    assert after >= before + 25.0, (before, after)
    assert os.path.exists(os.path.join(tmp_path, "final", "latest_checkpointed_iteration.txt"))


def test_moe_sft_example_learns(tmp_path):
    """The MoE SFT example: a tiny Qwen2-MoE with expert_model_parallel_size=2 on two CPU processes (each rank
    holds 4 of the 8 experts of each MoE layer): eval loss falls, greedy answers improve, the load-balancing loss
    and the per-layer expert loads are printed, and the HF weights it writes load with from_pretrained."""
    import re

    from transformers import AutoModelForCausalLM

    out = accelerate_launch(os.path.join(CONFIGS, "cpu_ep2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_moe_sft.py"),
                            "--output_dir", tmp_path)
    before = float(re.search(r"accuracy before fine-tuning: ([\d.]+)%", out).group(1))
    after = float(re.search(r"accuracy after fine-tuning: ([\d.]+)%", out).group(1))
    evals = [float(x) for x in re.findall(r"eval loss ([\d.]+)", out)]
    assert len(evals) == 3 and evals[2] < evals[1] < evals[0], out[-2000:]
    assert after >= before + 25.0, (before, after)
    assert re.search(r"lm loss [\d.]+ load-balancing loss [\d.]+", out), out[-2000:]
    loads = re.findall(r"layer (\d+):((?: +\d+){8})", out)
    assert [n for n, _ in loads] == ["1", "2"], out[-2000:]  # the dense third layer has no router
    for _, row in loads:  # every expert of a layer: top-2 of each of the step's valid tokens
        assert sum(int(x) for x in row.split()) > 0
    model = AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "hf"))
    assert model.config.model_type == "qwen2_moe" and model.config.num_experts == 8
    assert os.path.exists(os.path.join(tmp_path, "final", "latest_checkpointed_iteration.txt"))


def test_generation_example_prints_continuations(tmp_path):
    out = accelerate_launch(os.path.join(CONFIGS, "cpu_tp2.yaml"), os.path.join(ROOT, "examples", "megatron_gpt2_generation.py"),
                            "--train_steps", 30, "--max_new_tokens", 8)
    for title in ("top-p sampling", "top-k sampling", "greedy, with a BOS token in front", "beam search (4 beams)"):
        assert f"== {title}" in out, out[-3000:]
    assert out.count("'This module provides") >= 4  # each continuation starts with its prompt


def test_t5_seq2seq_example_learns(tmp_path):
    """The T5 example (T5TrainStep, generation at the end) under DP=2: held-out answers improve."""
    import re

    out = accelerate_launch(os.path.join(CONFIGS, "cpu_dp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_t5_seq2seq.py"),
                            "--output_dir", tmp_path)
    m = re.search(r"exact-match on 64 held-out sources: ([\d.]+)% \(before training: ([\d.]+)%\)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) >= float(m.group(2)) + 25.0, m.group(0)


def test_bert_mlm_example_trains(tmp_path):
    import re

    out = accelerate_launch(os.path.join(CONFIGS, "cpu_dp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_bert_mlm.py"),
                            "--output_dir", tmp_path, "--next_sentence", "--model_type", "megatron-bert",
                            "--max_train_steps", 120, "--log_every", 10, "--num_train_epochs", 1)
    losses = [float(x) for x in re.findall(r"step \d+ loss ([\d.]+)", out)]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]), losses
    assert "eval loss" in out and os.path.exists(os.path.join(tmp_path, "final", "latest_checkpointed_iteration.txt"))


def test_grpo_example_reward_rises(tmp_path):
    """GRPO sampling with megatron_generate under TP=2: the mean reward rises; the model is saved in HF format."""
    import re

    out = accelerate_launch(os.path.join(CONFIGS, "cpu_tp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_grpo.py"),
                            "--output_dir", tmp_path, "--iterations", 40)
    m = re.search(r"mean reward: first \d+ iterations ([\d.]+), last \d+ iterations ([\d.]+)", out)
    assert m, out[-3000:]
    assert float(m.group(2)) >= float(m.group(1)) + 0.2, m.group(0)
    assert os.path.exists(os.path.join(tmp_path, "model", "config.json"))


def test_grpo_example_with_hf_rollout_and_offload(tmp_path):
    """The verl pattern under DP=2: an HF model samples while the Megatron model is offloaded, and gets the
    trained weights streamed in after each update; a KL term to the initial weights, swapped in from host
    memory."""
    import re

    out = accelerate_launch(os.path.join(CONFIGS, "cpu_dp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_grpo.py"),
                            "--output_dir", tmp_path, "--rollout", "hf", "--iterations", 30, "--kl_coef", 0.02)
    m = re.search(r"mean reward: first \d+ iterations ([\d.]+), last \d+ iterations ([\d.]+)", out)
    assert m, out[-3000:]
    assert float(m.group(2)) >= float(m.group(1)) + 0.2, m.group(0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_example_preference_accuracy_rises(tmp_path, lora):
    """lora: `--lora_r 8` trains peft adapters only, the reference log-probs from the base (disable_adapter())."""
    import re

    args = ("--lora_r", 8) if lora else ()
    out = accelerate_launch(os.path.join(CONFIGS, "cpu_tp2.yaml"), os.path.join(ROOT, "examples", "megatron_lm_dpo.py"),
                            "--output_dir", tmp_path, "--num_train_epochs", 1, *args)
    m = re.search(r"held-out preference accuracy: ([\d.]+)% before, ([\d.]+)% after", out)
    assert m, out[-3000:]
    assert float(m.group(2)) >= 90.0 and float(m.group(2)) >= float(m.group(1)) + 15.0, m.group(0)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert losses and losses[-1] < 0.69, losses  # below log 2, where it starts
    # LoRA: the PEFT adapter folder; else the HF checkpoint
    assert os.path.exists(os.path.join(tmp_path, "model", "adapter_config.json" if lora else "config.json"))


def test_launch_passes_machine_flags_to_the_launched_processes(tmp_path):
    """`megatron-plugin launch --main_process_port P` (a machine flag over the YAML's key) reaches torchrun, and
    the launched process's own check reads the same flag from its launcher's command line."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text(
        "import os\nfrom megatron_plugin.launch_config import _launcher_argv, check_launch, launcher_overrides\n"
        "given = launcher_overrides(_launcher_argv(os.getppid())[0])\n"
        "print('LAUNCHED', os.environ['MASTER_PORT'], given['main_process_port'], given['rdzv_backend'], "
        "check_launch() is not None)\n")
    cfg = tmp_path / "one.yaml"
    cfg.write_text(CPU + "num_processes: 1\nmixed_precision: 'no'\nnum_machines: 1\nmain_process_port: 1\n"
                   "rdzv_backend: static\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megatron_plugin.cli", "launch", "--config_file", str(cfg),
                           "--main_process_port", str(port), str(script)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"LAUNCHED {port} {port} static True" in proc.stdout, proc.stdout + proc.stderr
