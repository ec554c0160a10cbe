"""Every field of accelerate's installed MegatronLMPlugin is honoured (the place FIELD_STATUS names reads it)
or refused by name; accelerate's plugin converts into ours with its filled-in defaults read as unset; the
`accelerate config` keys are all read; the README's migration table is FIELD_STATUS's."""

import dataclasses
import importlib
import inspect
import os
import re

import pytest
from accelerate.utils import MegatronLMPlugin as AcceleratePlugin

from megatron_plugin import MegatronLMPlugin, MegatronPluginConfigError
from megatron_plugin.plugin import ENV_FIELDS, FIELD_STATUS, config_key, field_status, migration_table
from tests.test_plugin import clean_env  # noqa: F401  (the fixture: no MEGATRON_LM_* variables)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE_FIELDS = [f.name for f in dataclasses.fields(AcceleratePlugin)]

# a value each refused field is refused at (one accelerate's defaults would not give, so conversion keeps it)
REFUSED_VALUES = {
    "pipeline_model_parallel_split_rank": 1,
    "use_custom_fsdp": True,
}


def _resolve(path: str):
    """The object an import path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_every_accelerate_field_is_honoured_or_refused():
    missing = [n for n in ACCELERATE_FIELDS if n not in FIELD_STATUS]
    assert not missing, f"accelerate fields neither honoured nor refused (add them to FIELD_STATUS): {missing}"
    assert sorted(FIELD_STATUS) == sorted(ACCELERATE_FIELDS), set(FIELD_STATUS) ^ set(ACCELERATE_FIELDS)
    ours = {f.name for f in dataclasses.fields(MegatronLMPlugin)}
    assert set(ACCELERATE_FIELDS) <= ours  # so conversion can carry every one
    for name in ACCELERATE_FIELDS:
        assert field_status(name)[0] in ("honoured", "refused"), (name, FIELD_STATUS[name])


@pytest.mark.parametrize("name", [n for n in FIELD_STATUS if field_status(n)[0] == "honoured"])
def test_an_honoured_field_is_read_where_the_table_says(name):
    _, where, what = field_status(name)
    assert what, name
    source = inspect.getsource(_resolve(where))
    assert re.search(rf"\b{name}\b", source), f"{name}: {where} does not read it"


@pytest.mark.parametrize("name", [n for n in FIELD_STATUS if field_status(n)[0] == "refused"])
def test_a_refused_field_raises_naming_it(clean_env, name):
    assert name in REFUSED_VALUES, f"{name} is refused: give REFUSED_VALUES a value it is refused at"
    value = REFUSED_VALUES[name]
    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin(**{name: value})
    assert err.value.setting == name and err.value.value == value, err.value
    plugin = MegatronLMPlugin()  # and when set after construction, at validate()
    setattr(plugin, name, value)
    with pytest.raises(MegatronPluginConfigError) as err:
        plugin.validate()
    assert err.value.setting == name
    with pytest.raises(MegatronPluginConfigError) as err:  # and from accelerate's plugin
        MegatronLMPlugin.from_accelerate(AcceleratePlugin(**{name: value}))
    assert err.value.setting == name


def test_what_refusals_leave_allowed(clean_env):
    p = MegatronLMPlugin(tp_degree=2, context_parallel_size=1, expert_model_parallel_size=1,
                         expert_tensor_parallel_size=2, use_custom_fsdp=False)
    assert (p.context_parallel_size, p.expert_tensor_parallel_size) == (1, 2)
    assert MegatronLMPlugin(expert_tensor_parallel_size=1).expert_tensor_parallel_size == 1


BAD_VALUES = [
    ("train_iters", -1, "whole number >= 1"), ("train_iters", 2.5, "whole number"), ("lr_warmup_iters", -3, ">= 0"),
    ("lr_decay_samples", 0, ">= 1"), ("decoder_last_pipeline_num_layers", 0, ">= 1"), ("encoder_seq_length", True, "whole"),
    ("eval_interval", 0, ">= 1"), ("lr_warmup_fraction", 1.0, "[0, 1)"), ("attention_dropout", -0.1, "[0, 1)"),
    ("hidden_dropout", 1.5, "[0, 1)"), ("start_weight_decay", -0.01, ">= 0"), ("min_lr", float("nan"), ">= 0"),
    ("lr_mult", -1.0, ">= 0"), ("weight_decay_incr_style", "exponential", "'constant', 'linear' or 'cosine'"),
    ("ckpt_format", "zarr", "torch_dist"), ("attention_backend", "fastest", "flash"), ("no_save_optim", "yes", "True or False"),
    ("calculate_per_token_loss", 1, "True or False"), ("use_rotary_position_embeddings", "no", "True, False, or None"),
    ("consumed_samples", [1, 2, 3, 4], "up to 3"), ("consumed_samples", [-1], "up to 3"),
    ("scale_lr_cond", "bias", "function"), ("custom_loss_function", 3, "function"), ("tensorboard_dir", 5, "folder"),
    ("recompute_num_layers", 0, ">= 1"),
]


@pytest.mark.parametrize("name,value,words", BAD_VALUES)
def test_bad_values_are_refused_naming_the_field(clean_env, name, value, words):
    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin(**{name: value})
    assert err.value.setting == name and words in err.value.fix, err.value


@pytest.mark.parametrize("kwargs,setting", [
    (dict(train_iters=10, train_samples=100), "train_iters and train_samples"),
    (dict(lr_warmup_iters=2, lr_warmup_samples=8), "lr_warmup_iters and lr_warmup_samples"),
    (dict(lr_warmup_fraction=0.1, lr_warmup_iters=2), "lr_warmup_fraction and lr_warmup_iters"),
    (dict(custom_prepare_model_function=lambda provider: [provider()]), "custom_prepare_model_function"),
])
def test_megatron_lm_exclusions(clean_env, kwargs, setting):
    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin(**kwargs)
    assert err.value.setting == setting


def test_world_size_must_fit_the_model_parallel_grid(clean_env):
    with pytest.raises(MegatronPluginConfigError, match="world size 6 must be a multiple of it"):
        MegatronLMPlugin(tp_degree=4).validate(world_size=6)
    MegatronLMPlugin(tp_degree=2).validate(world_size=6)


def test_a_default_accelerate_plugin_converts_to_our_defaults(clean_env):
    theirs = AcceleratePlugin()
    # what accelerate filled in is not Megatron's: read as unset
    assert (theirs.context_parallel_size, theirs.recompute_granularity, theirs.calculate_per_token_loss) == (2, "full", True)
    got, default = MegatronLMPlugin.from_accelerate(theirs), MegatronLMPlugin()
    assert dataclasses.asdict(got) == dataclasses.asdict(default)
    assert (got.context_parallel_size, got.recompute_granularity, got.calculate_per_token_loss, got.attention_dropout,
            got.attention_backend, got.use_rotary_position_embeddings) == (1, None, False, None, "auto", None)


def test_accelerate_plugin_values_carry_over(clean_env):
    def scale(name, param):
        return name.endswith("bias")

    theirs = AcceleratePlugin(tp_degree=2, train_iters=10, calculate_per_token_loss=False, lr_mult=0.5,
                              scale_lr_cond=scale, num_micro_batches=4, recompute_activations=True,
                              attention_dropout=0.1, other_megatron_args={"init_method_std": 0.01},
                              custom_train_step_kwargs={"alpha": 0.25}, consumed_samples=[8],
                              weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1)
    got = MegatronLMPlugin.from_accelerate(theirs)
    assert (got.tp_degree, got.train_iters, got.lr_mult, got.num_micro_batches) == (2, 10, 0.5, 4)
    assert got.calculate_per_token_loss is False and got.scale_lr_cond is scale
    # recompute_activations means selective recompute in Megatron-LM, whatever accelerate's granularity default says
    assert got.recompute_activations is True and got.recompute_granularity == "selective"
    assert got.attention_dropout == 0.1 and got.hidden_dropout is None  # accelerate's 0.0 default: the HF config's
    assert got.other_megatron_args == {"init_method_std": 0.01} and got.custom_train_step_kwargs == {"alpha": 0.25}
    assert got.consumed_samples == [8, 0, 0]  # as accelerate completes it
    assert (got.weight_decay_incr_style, got.start_weight_decay, got.end_weight_decay) == ("linear", 0.0, 0.1)
    assert got.context_parallel_size == 1 and got.pp_degree == 1
    theirs.other_megatron_args["init_method_std"] = 1.0  # a copy, not the same dict
    assert got.other_megatron_args == {"init_method_std": 0.01}


def test_conversion_reads_the_environment_like_accelerate(clean_env):
    # accelerate launch wrote these: accelerate's plugin filled them in, ours reads them the same way
    clean_env.setenv("MEGATRON_LM_TP_DEGREE", "2")
    clean_env.setenv("MEGATRON_LM_NUM_MICRO_BATCHES", "4")
    clean_env.setenv("MEGATRON_LM_CALCULATE_PER_TOKEN_LOSS", "true")
    got = MegatronLMPlugin.from_accelerate(AcceleratePlugin())
    assert (got.tp_degree, got.num_micro_batches, got.calculate_per_token_loss) == (2, 4, True)
    assert MegatronLMPlugin.from_accelerate(AcceleratePlugin(tp_degree=1)).tp_degree == 1  # code wins
    # accelerate's own default is 2 (read as unset); from the environment both read the launch's value
    clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "2")
    assert MegatronLMPlugin.from_accelerate(AcceleratePlugin()).context_parallel_size == 2
    clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "4")
    assert MegatronLMPlugin.from_accelerate(AcceleratePlugin()).context_parallel_size == 4
    assert MegatronLMPlugin.from_accelerate(AcceleratePlugin(context_parallel_size=1)).context_parallel_size == 1
    clean_env.setenv("MEGATRON_LM_CONTEXT_PARALLEL_SIZE", "0")  # refused by name, from the environment too
    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin.from_accelerate(AcceleratePlugin(tp_degree=2))
    assert err.value.setting == "context_parallel_size"


def test_accelerate_train_step_subclass_is_refused_with_the_import_to_use(clean_env):
    from accelerate.utils.megatron_lm import GPTTrainStep

    class Mine(GPTTrainStep):
        pass

    with pytest.raises(MegatronPluginConfigError, match="from megatron_plugin import GPTTrainStep"):
        MegatronLMPlugin(custom_train_step_class=Mine)


def test_every_accelerate_config_key_is_read():
    """`accelerate launch` writes each megatron_lm_* key of the config into MEGATRON_LM_*; the plugin reads them all."""
    from megatron_plugin.launch_config import known_megatron_keys

    ours = {config_key(name) for name in ENV_FIELDS} | {config_key("recompute_granularity")}
    assert ours == known_megatron_keys()


def test_readme_migration_table_is_field_status():
    text = open(os.path.join(ROOT, "README.md")).read()
    begin = "<!-- migration table: generated from megatron_plugin.plugin.FIELD_STATUS by migration_table() -->\n"
    end = "<!-- end of migration table -->"
    assert begin in text and end in text
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert block == migration_table(), "regenerate the README table with megatron_plugin.plugin.migration_table()"
    for name in ACCELERATE_FIELDS:
        assert f"| `{name}` |" in block
