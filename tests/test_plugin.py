"""MegatronLMPlugin: environment defaults as `accelerate launch` writes them, and clear bad-input errors."""

import pytest

from megatron_plugin import MegatronLMPlugin, MegatronPluginConfigError
from megatron_plugin.engine.distributed import initialize
from tests.models import gpt2_config


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("MEGATRON_LM_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_defaults_without_environment(clean_env):
    p = MegatronLMPlugin()
    assert (p.tp_degree, p.pp_degree, p.num_micro_batches) == (1, 1, 1)
    assert p.gradient_clipping == 1.0
    assert p.sequence_parallelism is False and p.recompute_activations is False
    assert p.use_distributed_optimizer is False and p.recompute_granularity is None


def test_environment_as_accelerate_launch_writes_it(clean_env):
    env = {
        "MEGATRON_LM_TP_DEGREE": "2", "MEGATRON_LM_PP_DEGREE": "1", "MEGATRON_LM_NUM_MICRO_BATCHES": "4",
        "MEGATRON_LM_GRADIENT_CLIPPING": "0.5", "MEGATRON_LM_SEQUENCE_PARALLELISM": "True",
        "MEGATRON_LM_RECOMPUTE_ACTIVATIONS": "true", "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER": "False",
    }
    for k, v in env.items():
        clean_env.setenv(k, v)
    p = MegatronLMPlugin()
    assert (p.tp_degree, p.pp_degree, p.num_micro_batches) == (2, 1, 4)
    assert p.gradient_clipping == 0.5
    assert p.sequence_parallelism is True and p.recompute_activations is True
    assert p.use_distributed_optimizer is False
    assert p.recompute_granularity == "selective"


def test_code_wins_over_environment(clean_env):
    clean_env.setenv("MEGATRON_LM_TP_DEGREE", "4")
    assert MegatronLMPlugin(tp_degree=2).tp_degree == 2


def test_float_looking_integers_are_accepted(clean_env):
    clean_env.setenv("MEGATRON_LM_TP_DEGREE", "2.0")
    assert MegatronLMPlugin().tp_degree == 2


@pytest.mark.parametrize(
    "var,value,setting",
    [
        ("MEGATRON_LM_TP_DEGREE", "two", "MEGATRON_LM_TP_DEGREE"),
        ("MEGATRON_LM_TP_DEGREE", "1.5", "MEGATRON_LM_TP_DEGREE"),
        ("MEGATRON_LM_SEQUENCE_PARALLELISM", "maybe", "MEGATRON_LM_SEQUENCE_PARALLELISM"),
        ("MEGATRON_LM_GRADIENT_CLIPPING", "high", "MEGATRON_LM_GRADIENT_CLIPPING"),
    ],
)
def test_unparsable_environment_names_the_variable(clean_env, var, value, setting):
    clean_env.setenv(var, value)
    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin()
    assert err.value.setting == setting and err.value.value == value
    assert setting in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("field", ["tp_degree", "pp_degree", "num_micro_batches"])
@pytest.mark.parametrize("value", [0, -1])
def test_degrees_below_one(clean_env, field, value):
    with pytest.raises(MegatronPluginConfigError, match=f"{field}={value}"):
        MegatronLMPlugin(**{field: value})


@pytest.mark.parametrize("value", ["no", 1, "True"])
def test_gradient_accumulation_fusion_takes_bools_only(clean_env, value):
    # a string from a config file would otherwise read as True
    with pytest.raises(MegatronPluginConfigError, match=f"gradient_accumulation_fusion={value!r}"):
        MegatronLMPlugin(gradient_accumulation_fusion=value)


@pytest.mark.parametrize("kwargs", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                    {"options": {"triton.cudagraphs": True}}])
def test_fused_weight_gradient_refused_under_cuda_graphs(clean_env, kwargs):
    # a graph replay skips the Python flag that keeps DDP's hook from adding the placeholder gradient
    from megatron_plugin.plugin import check_compile, uses_cuda_graphs

    assert uses_cuda_graphs(dict(backend="inductor", **kwargs))
    with pytest.raises(MegatronPluginConfigError, match="gradient_accumulation_fusion=True.*CUDA graphs"):
        check_compile(MegatronLMPlugin(gradient_accumulation_fusion=True), dict(backend="inductor", **kwargs), "cuda")
    for fusion in (None, False):  # unset resolves to off under CUDA graphs
        check_compile(MegatronLMPlugin(gradient_accumulation_fusion=fusion), dict(backend="inductor", **kwargs), "cuda")
    assert not uses_cuda_graphs({"backend": "inductor", "mode": "max-autotune-no-cudagraphs"})
    check_compile(MegatronLMPlugin(gradient_accumulation_fusion=True), {"backend": "inductor"}, "cuda")


@pytest.mark.parametrize("kwargs", [{"mode": "reduce-overhead"}, {"options": {"triton.cudagraphs": True}}])
def test_fp8_refused_under_cuda_graphs(clean_env, kwargs):
    # untested under graph replays, and 3.6x slower where timed (Llama-1B on an H200)
    from megatron_plugin.plugin import check_compile

    with pytest.raises(MegatronPluginConfigError, match="fp8='hybrid'.*CUDA graphs.*default compile mode"):
        check_compile(MegatronLMPlugin(fp8="hybrid"), dict(backend="inductor", **kwargs), "cuda")
    check_compile(MegatronLMPlugin(fp8="hybrid"), {"backend": "inductor"}, "cuda")
    check_compile(MegatronLMPlugin(), dict(backend="inductor", **kwargs), "cuda")


def test_tp_comm_overlap_runs_where_the_linears_are_ops_else_refused(clean_env):
    """Megatron's tp_comm_overlap (other_megatron_args) runs in compiled layers with the fused weight gradient, under
    TP + SP on CUDA (layers/compiled_linear.py); anywhere else it would do nothing, so prepare refuses it, naming it."""
    from megatron_plugin.plugin import check_tp_comm_overlap

    def plugin(**kw):
        return MegatronLMPlugin(**{"tp_degree": 2, "sequence_parallelism": True,
                                   "other_megatron_args": {"tp_comm_overlap": True}, **kw})

    compiled = {"backend": "inductor"}
    check_tp_comm_overlap(plugin(), "cuda", compiled, True)  # where it runs
    check_tp_comm_overlap(MegatronLMPlugin(other_megatron_args={"tp_comm_overlap": False}), "cpu", None, False)
    refusals = [
        ((plugin(), "cpu", compiled, True), "remove it for a CPU run"),
        ((plugin(sequence_parallelism=False), "cuda", compiled, True), "sequence_parallelism=False.*set tp_degree >= 2"),
        ((plugin(), "cuda", None, True), "compiled layers with the fused weight gradient"),
        ((plugin(), "cuda", compiled, False), "gradient_accumulation_fusion unset or True"),
        ((plugin(fp8="hybrid"), "cuda", compiled, True), "leave fp8 unset"),
        ((plugin(other_megatron_args={"tp_comm_overlap": "yes"}), "cuda", compiled, True), "True or False"),
    ]
    for args, words in refusals:
        with pytest.raises(MegatronPluginConfigError, match=r"other_megatron_args\['tp_comm_overlap'\].*" + words):
            check_tp_comm_overlap(*args)
    # TE's userbuffers knobs: read by nothing here, so refused away from their defaults, taken at them
    knob = plugin(other_megatron_args={"tp_comm_overlap": True, "tp_comm_overlap_ag": False})
    with pytest.raises(MegatronPluginConfigError,
                       match=r"other_megatron_args\['tp_comm_overlap_ag'\]=False: a Transformer Engine .*default is True"):
        check_tp_comm_overlap(knob, "cuda", compiled, True)
    check_tp_comm_overlap(plugin(other_megatron_args={"tp_comm_overlap": True, "tp_comm_split_ag": True}), "cuda",
                          compiled, True)


def test_sequence_parallel_needs_tp(clean_env):
    with pytest.raises(MegatronPluginConfigError, match="tp_degree > 1"):
        MegatronLMPlugin(sequence_parallelism=True)


def test_world_size_not_divisible_before_any_process_group(clean_env):
    import torch.distributed as dist

    clean_env.setenv("WORLD_SIZE", "3")
    with pytest.raises(MegatronPluginConfigError, match="multiple of 2"):
        initialize(MegatronLMPlugin(tp_degree=2), gpt2_config())
    assert not dist.is_initialized()


def test_context_parallel_from_code_and_environment(clean_env):
    """context_parallel_size > 1 is taken, from code or from MEGATRON_LM_CONTEXT_PARALLEL_SIZE (what
    `accelerate launch` writes for megatron_lm_context_parallel_size), and counted in the model-parallel grid."""
    import torch.distributed as dist

    assert MegatronLMPlugin(context_parallel_size=4).context_parallel_size == 4
    clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "2")
    p = MegatronLMPlugin(tp_degree=2)
    assert p.context_parallel_size == 2
    p.validate(world_size=8)
    clean_env.setenv("WORLD_SIZE", "6")  # TP2 x CP2 = 4 does not divide 6: refused before any process group
    with pytest.raises(MegatronPluginConfigError) as err:
        initialize(p, gpt2_config())
    assert err.value.setting == "tp_degree*context_parallel_size*pp_degree" and err.value.value == "2*2*1=4"
    assert "world size 6" in err.value.fix and "multiple of 4" in err.value.fix
    assert not dist.is_initialized()
    for bad in ("0", "two"):
        clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", bad)
        with pytest.raises(MegatronPluginConfigError):
            MegatronLMPlugin()


def _context_parallel_groups():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_plugin.engine.distributed import destroy, initialize

    initialize(MegatronLMPlugin(tp_degree=2, context_parallel_size=2))
    try:
        return (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank(),
                parallel_state.get_context_parallel_global_ranks(), parallel_state.get_data_parallel_world_size(),
                dist.get_process_group_ranks(parallel_state.get_data_parallel_group(with_context_parallel=True)))
    finally:
        destroy()


def test_context_parallel_groups_are_megatrons_layout():
    """TP2 x CP2 on four processes: megatron-core's order tp-cp-dp-pp (a CP group's ranks are TP-size apart),
    as placement.rank_groups reports it; gradients are reduced over DP x CP."""
    from megatron_plugin.placement import rank_groups
    from tests.spawn import run_on_ranks

    got = run_on_ranks(_context_parallel_groups, 4)
    groups = rank_groups(4, 2, 1, 2)
    for rank, (cp, cp_rank, cp_ranks, dp, dp_cp_ranks) in enumerate(got):
        mine = next(list(g) for g in groups["cp"] if rank in g)
        assert (cp, dp, cp_ranks, cp_rank) == (2, 1, mine, mine.index(rank)), (rank, got[rank])
        assert cp_ranks == [rank % 2, rank % 2 + 2] and list(dp_cp_ranks) == cp_ranks, (rank, got[rank])


def test_heads_not_divisible_by_tp(clean_env):
    import torch.distributed as dist

    clean_env.setenv("WORLD_SIZE", "3")
    with pytest.raises(MegatronPluginConfigError, match="4 attention heads") as err:
        initialize(MegatronLMPlugin(tp_degree=3), gpt2_config())
    assert err.value.setting == "tp_degree" and err.value.value == 3
    assert not dist.is_initialized()


def test_unsupported_model_type_lists_supported(clean_env):
    from transformers import GPTNeoXConfig

    with pytest.raises(MegatronPluginConfigError, match=r"model_type='gpt_neox'.*'bert', 'gpt2', 'llama', 'megatron-bert', 'mistral', 'mixtral', 'mt5', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe', 't5'"):
        initialize(MegatronLMPlugin(), GPTNeoXConfig())


def test_pipeline_must_split_layers(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")
    with pytest.raises(MegatronPluginConfigError, match="2 layers must split evenly over 4"):
        initialize(MegatronLMPlugin(pp_degree=4), gpt2_config())


def test_unknown_other_megatron_args():
    from megatron_plugin.models.gpt import transformer_config_overrides

    assert transformer_config_overrides({"attention_dropout": 0.0, "vocab_file": "v"}) == {"attention_dropout": 0.0}
    with pytest.raises(MegatronPluginConfigError, match="other_megatron_args"):
        transformer_config_overrides({"no_such_field": 1})


def test_unsupported_activation(clean_env):
    with pytest.raises(MegatronPluginConfigError, match="activation_function='silu'"):
        initialize(MegatronLMPlugin(), gpt2_config(activation_function="silu"))


def test_unsupported_features_are_refused(clean_env):
    from megatron_plugin.layers.spec import block_spec

    with pytest.raises(MegatronPluginConfigError, match="backend='te'"):
        block_spec(None, 2, backend="te")


def test_cpu_refusal_of_recompute_names_the_setting_that_was_set():
    from megatron_plugin.plugin import check_cpu_support

    for kwargs, setting in ((dict(recompute_granularity="full"), "recompute_granularity"),
                            (dict(recompute_activations=True), "recompute_activations")):
        with pytest.raises(MegatronPluginConfigError) as err:
            check_cpu_support(MegatronLMPlugin(**kwargs))
        assert err.value.setting == setting and "recompute_granularity=None" in err.value.fix


def test_uneven_last_stage_needs_the_torch_dist_format(clean_env):
    """The megatron_plugin format names stages by an even split: refused at construction, not at the first save."""
    with pytest.raises(MegatronPluginConfigError, match="ckpt_format='megatron_plugin': a run with "
                                                         "decoder_last_pipeline_num_layers=1 saves with ckpt_format='torch_dist'"):
        MegatronLMPlugin(pp_degree=2, decoder_last_pipeline_num_layers=1, ckpt_format="megatron_plugin")
    assert MegatronLMPlugin(pp_degree=2, decoder_last_pipeline_num_layers=1).ckpt_format == "torch_dist"


def test_questionnaire_asks_the_context_parallel_degree_for_long_sequences(tmp_path, clean_env):
    """`--long_context yes` asks the context-parallel degree (accelerate's questions stay as they are); the
    answer, or the --context_parallel_size flag, is written as megatron_lm_context_parallel_size, which the
    launched processes read back, checked against the process count like the other degrees."""
    import yaml

    from megatron_plugin.cli import build_parser, main, plugin_from_yaml, run_config

    answers = iter(["yes", "2", "2", "", "", "8", ""])  # cpu, tp, CP, micro-batches, clip, procs, precision
    printed = []
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "cp.yaml"), "--long_context", "yes"])
    run_config(args, input_fn=lambda prompt: (printed.append(prompt), next(answers))[1], print_fn=printed.append)
    assert next(answers, "done") == "done"
    assert sum("Context Parallelism" in str(p) for p in printed) == 1
    data = yaml.safe_load((tmp_path / "cp.yaml").read_text())
    assert data["megatron_lm_config"]["megatron_lm_context_parallel_size"] == 2
    plugin = plugin_from_yaml(data, str(tmp_path / "cp.yaml"))
    assert (plugin.tp_degree, plugin.context_parallel_size) == (2, 2)
    clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "2")  # as accelerate launch hands the key over
    assert MegatronLMPlugin().context_parallel_size == 2
    # not asked without --long_context, and no key written
    answers = iter(["yes", "1", "", "", "2", ""])
    printed.clear()
    args = build_parser().parse_args(["config", "--config_file", str(tmp_path / "short.yaml")])
    run_config(args, input_fn=lambda prompt: (printed.append(prompt), next(answers))[1], print_fn=printed.append)
    assert not any("Context Parallelism" in str(p) for p in printed)
    assert "megatron_lm_context_parallel_size" not in yaml.safe_load((tmp_path / "short.yaml").read_text())[
        "megatron_lm_config"]
    # the flag alone, and a layout the processes cannot fill, refused under the flags' names before writing
    assert main(["config", "--config_file", str(tmp_path / "flag.yaml"), "--non_interactive", "--cpu",
                 "--context_parallel_size", "2", "--num_processes", "2"]) == 0
    assert yaml.safe_load((tmp_path / "flag.yaml").read_text())["megatron_lm_config"][
        "megatron_lm_context_parallel_size"] == 2
    bad = tmp_path / "bad.yaml"
    assert main(["config", "--config_file", str(bad), "--non_interactive", "--cpu", "--tp", "2",
                 "--context_parallel_size", "2", "--num_processes", "6"]) == 2
    assert not bad.exists()


def _resolved_batch_geometry():
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler
    from tests.models import tiny_llama
    from tests.training import optimizer_for, token_dataset

    model = tiny_llama()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(context_parallel_size=2, num_micro_batches=2))
    acc.prepare(model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2),
                DataLoader(token_dataset(8, model.config.vocab_size), batch_size=2))
    p = acc.state.megatron_lm_plugin
    return p.data_parallel_size, p.micro_batch_size, p.global_batch_size


def test_context_parallel_ranks_are_not_data_parallel_replicas():
    """Two processes at CP=2 are one model replica reading one batch: data_parallel_size 1, and the global batch
    (which sample-based schedules and indexed datasets count) is the micro-batch times the micro-batches."""
    from tests.spawn import run_on_ranks

    assert run_on_ranks(_resolved_batch_geometry, 2) == [(1, 2, 4)] * 2
