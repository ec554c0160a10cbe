"""`MegatronLMPlugin`: the user's Megatron settings, in accelerate's plugin style.

Unset fields read the `MEGATRON_LM_*` environment variables that `accelerate launch` writes, in
`__post_init__` and nowhere else, so a script gets the same plugin whether the values came from code,
from a YAML through `accelerate launch`, or from our own questionnaire.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import MegatronPluginConfigError
from .quiet import QUIET_IMPORT, quiet

ENV_PREFIX = "MEGATRON_LM_"

_TRUE = {"1", "true", "yes", "y", "on"}
_FALSE = {"0", "false", "no", "n", "off", "none", ""}


def parse_bool(setting: str, raw: str) -> bool:
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise MegatronPluginConfigError(setting, raw, "use one of True/False, 1/0, yes/no")


def parse_int(setting: str, raw: str) -> int:
    try:
        as_float = float(str(raw).strip())
    except ValueError:
        raise MegatronPluginConfigError(setting, raw, "use a whole number such as 1, 2 or 4") from None
    if not as_float.is_integer():
        raise MegatronPluginConfigError(setting, raw, "use a whole number such as 1, 2 or 4")
    return int(as_float)


def parse_float(setting: str, raw: str) -> float:
    try:
        return float(str(raw).strip())
    except ValueError:
        raise MegatronPluginConfigError(setting, raw, "use a number such as 1.0 (0 disables it)") from None


# the base class of train steps, by import path: the plugin sits below the train_steps package
TRAIN_STEP_BASE = "train_steps.base.AbstractTrainStep"


def resolve_train_step_class(value):
    """A train step class, or an import path to one ('pkg.module.Class' or 'pkg.module:Class')."""
    if value is None:
        return None
    if isinstance(value, str):
        module, _, name = value.replace(":", ".").rpartition(".")
        try:
            with quiet(QUIET_IMPORT):
                value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise MegatronPluginConfigError(
                "custom_train_step_class", value,
                f"cannot import it ({err}): pass the class itself, or an import path such as 'my_steps.MyTrainStep'",
            ) from None
    if not (isinstance(value, type) and any(f"{c.__module__}.{c.__qualname__}" == TRAIN_STEP_BASE for c in value.__mro__)):
        if isinstance(value, type) and any(c.__module__ == "accelerate.utils.megatron_lm" for c in value.__mro__):
            raise MegatronPluginConfigError(
                "custom_train_step_class", value,
                "it subclasses accelerate's train step, which runs on Megatron-LM: import its base from megatron_plugin "
                "instead (from megatron_plugin import GPTTrainStep): the guide's custom steps then run unchanged",
            )
        raise MegatronPluginConfigError(
            "custom_train_step_class", value,
            "pass a subclass of megatron_plugin.AbstractTrainStep (usually of GPTTrainStep), not an instance",
        )
    return value


def parse_str(setting: str, raw: str) -> str:
    return str(raw).strip().lower()


def parse_bool_or_str(setting: str, raw: str):
    """accelerate's attention_backend is a bool; Megatron-LM's --attention-backend a name ('auto', ...)."""
    text = str(raw).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else text


_PARSERS = {bool: parse_bool, int: parse_int, float: parse_float, str: parse_str, "bool|str": parse_bool_or_str}
PARSERS = _PARSERS  # the text parser of each ENV_FIELDS kind, for what reads the same settings from a YAML or flags

# field name -> (environment variable, type, default when neither code nor environment sets it): every
# `megatron_lm_*` key `accelerate launch` writes into the environment (accelerate's launch.py) is read here
ENV_FIELDS = {
    "tp_degree": ("TP_DEGREE", int, 1),
    "pp_degree": ("PP_DEGREE", int, 1),
    "num_micro_batches": ("NUM_MICRO_BATCHES", int, 1),
    "gradient_clipping": ("GRADIENT_CLIPPING", float, 1.0),
    "sequence_parallelism": ("SEQUENCE_PARALLELISM", bool, False),
    "recompute_activations": ("RECOMPUTE_ACTIVATIONS", bool, False),
    "use_distributed_optimizer": ("USE_DISTRIBUTED_OPTIMIZER", bool, False),
    "recompute_method": ("RECOMPUTE_METHOD", str, "uniform"),
    "recompute_num_layers": ("RECOMPUTE_NUM_LAYERS", int, 1),
    "use_custom_fsdp": ("USE_CUSTOM_FSDP", bool, False),
    "no_load_optim": ("NO_LOAD_OPTIM", bool, False),
    "no_save_optim": ("NO_SAVE_OPTIM", bool, False),
    "eod_mask_loss": ("EOD_MASK_LOSS", bool, False),
    "optimizer_cpu_offload": ("OPTIMIZER_CPU_OFFLOAD", bool, False),
    "overlap_cpu_optimizer_d2h_h2d": ("OVERLAP_CPU_OPTIMIZER_D2H_H2D", bool, False),
    "use_precision_aware_optimizer": ("USE_PRECISION_AWARE_OPTIMIZER", bool, False),
    "decoder_last_pipeline_num_layers": ("DECODER_LAST_PIPELINE_NUM_LAYERS", int, None),
    "attention_backend": ("ATTENTION_BACKEND", "bool|str", "auto"),
    "expert_model_parallel_size": ("EXPERT_MODEL_PARALLEL_SIZE", int, 1),
    "expert_tensor_parallel_size": ("EXPERT_TENSOR_PARALLEL_SIZE", int, None),
    "context_parallel_size": ("CONTEXT_PARALLEL_SIZE", int, 1),
    "attention_dropout": ("ATTENTION_DROPOUT", float, None),
    "hidden_dropout": ("HIDDEN_DROPOUT", float, None),
    "attention_softmax_in_fp32": ("ATTENTION_SOFTMAX_IN_FP32", bool, True),
    "calculate_per_token_loss": ("CALCULATE_PER_TOKEN_LOSS", bool, False),
    "use_rotary_position_embeddings": ("USE_ROTARY_POSITION_EMBEDDINGS", bool, None),
}

# Every field of accelerate's MegatronLMPlugin and what it does here: "honoured: <where> - <what>" (where: the
# module, class or function that reads it, as an import path) or "refused: <why and what instead>". Refused
# values raise MegatronPluginConfigError naming the field when the plugin is built (validate). A field of a
# newer accelerate that is missing here fails tests/test_accelerate_fields.py; the README's migration table is
# generated from this (`migration_table`).
FIELD_STATUS = {
    # parallel layout
    "tp_degree": "honoured: megatron_plugin.engine.distributed.start - tensor parallel degree",
    "pp_degree": "honoured: megatron_plugin.engine.distributed.start - pipeline parallel degree (CUDA engine)",
    "num_micro_batches": "honoured: megatron_plugin.engine.base.MegatronEngine._micro_count - micro-batches per "
                         "step; the DataLoader's batch is cut into them (they replace gradient_accumulation_steps)",
    "sequence_parallelism": "honoured: megatron_plugin.models.gpt.build_transformer_config - sequence parallelism "
                            "(tp_degree > 1; on CPU too, through layers/sp_comm.py); the sequence length must be a "
                            "multiple of tp_degree",
    "num_layers_per_virtual_pipeline_stage": "honoured: megatron_plugin.plugin.MegatronLMPlugin.virtual_pipeline_stages"
                                             " - interleaved 1F1B schedule",
    "decoder_last_pipeline_num_layers": "honoured: megatron_plugin.models.mapping - layers of the last pipeline "
                                        "stage; the others split the rest evenly",
    "context_parallel_size": "honoured: megatron_plugin.engine.distributed.start - context parallel degree: each "
                             "sequence is split over this many ranks in 2 x CP load-balanced chunks (GPT-2 and the "
                             "Llama family; sequence lengths a multiple of 2 x context_parallel_size)",
    "expert_model_parallel_size": "honoured: megatron_plugin.engine.distributed.start - expert parallel degree of "
                                  "MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE); it must divide the number of experts",
    "expert_tensor_parallel_size": "honoured: megatron_plugin.engine.distributed.start - tensor parallel degree "
                                   "inside the experts (unset: tp_degree, as in Megatron-LM)",
    "pipeline_model_parallel_split_rank": "refused: any value; Megatron-Core removed it (encoder and decoder share "
                                          "pipeline stages) - leave it unset, pp_degree splits T5 like any model",
    "use_custom_fsdp": "refused: True; Megatron-Core's FSDP is not supported - use use_distributed_optimizer=True",
    "use_distributed_optimizer": "honoured: megatron_plugin.engine.gpu.optimizer_config - Megatron-Core's "
                                 "distributed optimizer (CUDA engine)",
    # activation recomputation
    "recompute_activations": "honoured: megatron_plugin.plugin.MegatronLMPlugin.__post_init__ - selective "
                             "recomputation (recompute_granularity='selective'; CUDA engine)",
    "recompute_granularity": "honoured: megatron_plugin.models.gpt.build_transformer_config - 'selective' or 'full' "
                             "(accelerate's 'full' default applies only when set, as in Megatron-LM)",
    "recompute_method": "honoured: megatron_plugin.models.gpt.build_transformer_config - 'uniform' or 'block' (full)",
    "recompute_num_layers": "honoured: megatron_plugin.models.gpt.build_transformer_config - layers per recompute "
                            "unit (full)",
    # model
    "seq_length": "honoured: megatron_plugin.build.megatron_args - megatron_args.seq_length for train steps; "
                  "batches carry their own length",
    "encoder_seq_length": "honoured: megatron_plugin.build.megatron_args - megatron_args.encoder_seq_length (T5); "
                          "the sequence length of decoder-only models",
    "decoder_seq_length": "honoured: megatron_plugin.build.megatron_args - megatron_args.decoder_seq_length (T5)",
    "attention_dropout": "honoured: megatron_plugin.models.fields - default: the HF config's",
    "hidden_dropout": "honoured: megatron_plugin.models.fields - default: the HF config's",
    "attention_softmax_in_fp32": "honoured: megatron_plugin.models.fields - softmax in fp32",
    "attention_backend": "honoured: megatron_plugin.models.fields - Megatron-Core's attention "
                         "backend names; True means 'auto'",
    "use_rotary_position_embeddings": "honoured: megatron_plugin.models.fields - must match the HF model's positions "
                                      "(default: what the model uses)",
    "other_megatron_args": "honoured: megatron_plugin.models.gpt.build_transformer_config - TransformerConfig "
                           "fields; architecture fields must match the HF config; cuda_graph_impl='local' with "
                           "cuda_graph_scope='full_iteration': engine/full_graph.py",
    # loss
    "calculate_per_token_loss": "honoured: megatron_plugin.engine.base - every token weighs the same over "
                                "micro-batches and data-parallel ranks (default False, Megatron's)",
    "eod_mask_loss": "honoured: train_steps.gpt - no loss on end-of-document tokens",
    "return_logits": "honoured: train_steps.gpt.GPTTrainStep.__init__ - logits in eval outputs",
    # learning rate, weight decay, optimizer
    "train_iters": "honoured: megatron_plugin.engine.scheduler - steps of the run (else the dummy scheduler's "
                   "total_num_steps)",
    "train_samples": "honoured: megatron_plugin.engine.scheduler - samples of the run, over the global batch",
    "lr_decay_style": "honoured: megatron_plugin.engine.scheduler - 'constant', 'linear', 'cosine'",
    "lr_decay_iters": "honoured: megatron_plugin.engine.scheduler - decay steps",
    "lr_decay_samples": "honoured: megatron_plugin.engine.scheduler - decay samples",
    "lr_warmup_iters": "honoured: megatron_plugin.engine.scheduler - warmup steps",
    "lr_warmup_samples": "honoured: megatron_plugin.engine.scheduler - warmup samples",
    "lr_warmup_fraction": "honoured: megatron_plugin.engine.scheduler - warmup as a fraction of decay",
    "min_lr": "honoured: megatron_plugin.engine.scheduler - the learning rate after decay",
    "weight_decay_incr_style": "honoured: megatron_plugin.engine.scheduler - 'constant', 'linear', 'cosine'",
    "start_weight_decay": "honoured: megatron_plugin.engine.scheduler - weight decay at the start",
    "end_weight_decay": "honoured: megatron_plugin.engine.scheduler - weight decay at the end",
    "lr_mult": "honoured: megatron_plugin.engine.optimizer - learning-rate multiplier of scale_lr_cond's parameters",
    "scale_lr_cond": "honoured: megatron_plugin.engine.optimizer - scale_lr_cond(name, param) picks them",
    "no_wd_decay_cond": "honoured: megatron_plugin.engine.optimizer - no_wd_decay_cond(name, param): no weight decay",
    "optimizer_cpu_offload": "honoured: megatron_plugin.engine.gpu - optimizer on the CPU (CUDA engine; with no_save_optim=True: its state does not load back yet)",
    "overlap_cpu_optimizer_d2h_h2d": "honoured: megatron_plugin.engine.gpu - with optimizer_cpu_offload",
    "use_precision_aware_optimizer": "honoured: megatron_plugin.engine.gpu - Megatron-Core's precision-aware "
                                     "optimizer (CUDA engine)",
    "gradient_clipping": "honoured: megatron_plugin.engine.cpu.CPUEngine.clip_gradients - global L2 norm "
                         "(engine.gpu.optimizer_config on CUDA); 0 disables",
    # checkpoints
    "no_load_optim": "honoured: megatron_plugin.engine.checkpointing.state - load_state skips the optimizer state",
    "no_save_optim": "honoured: megatron_plugin.engine.checkpointing.state - save_state writes no optimizer state",
    # data
    "megatron_dataset_flag": "honoured: megatron_plugin.resolve.resolve - set for you when a "
                             "MegatronLMDummyDataLoader is passed to prepare",
    "is_train_batch_min": "honoured: megatron_plugin.engine.data.micro_batch_size - the micro-batch of train plus eval loaders",
    "consumed_samples": "honoured: megatron_plugin.data.indexed - samples already read, for indexed datasets",
    "eval_iters": "honoured: megatron_plugin.data.indexed.MegatronLMDummyDataLoader.check_for - evaluation batches",
    "eval_interval": "honoured: megatron_plugin.data.indexed.MegatronLMDummyDataLoader.check_for - steps between "
                     "evaluations",
    # logging
    "tensorboard_dir": "honoured: megatron_plugin.engine.tensorboard.TensorBoardLogger - scalars per step (needs "
                       "pip install tensorboard)",
    "set_all_logging_options": "honoured: megatron_plugin.engine.tensorboard.TensorBoardLogger - also parameter "
                               "norm and memory",
    # Megatron-LM's hooks
    "custom_train_step_class": "honoured: megatron_plugin.resolve.resolve_step - subclass megatron_plugin's "
                               "GPTTrainStep (the guide's steps run unchanged)",
    "custom_train_step_kwargs": "honoured: megatron_plugin.resolve.resolve_step - keyword arguments of the class",
    "custom_get_batch_function": "honoured: megatron_plugin.resolve.with_custom_functions - the train step's "
                                 "get_batch(data_iterator)",
    "custom_loss_function": "honoured: megatron_plugin.resolve.with_custom_functions - the train step's "
                            "loss_func(loss_mask, output_tensor) -> (loss, logs)",
    "custom_model_provider_function": "honoured: megatron_plugin.models.modeling.MegatronModel.chunks_from_provider - "
                                      "model_provider(pre_process, post_process) builds the module instead of the HF "
                                      "weights; HF export needs our family's module",
    "custom_prepare_model_function": "honoured: megatron_plugin.models.modeling.MegatronModel.chunks_from_provider - "
                                     "prepare_model(model_provider) -> the model chunks",
    "custom_megatron_datasets_provider_function": "honoured: megatron_plugin.build.indexed_iterators - "
                                                  "provider(train_val_test_num_samples) -> train, valid, test "
                                                  "datasets for MegatronLMDummyDataLoader",
}


def field_status(name: str):
    """(kind, where, what) of a FIELD_STATUS entry: kind 'honoured' or 'refused'; where the import path of
    what reads the field (None when refused)."""
    kind, _, rest = FIELD_STATUS[name].partition(": ")
    if kind == "honoured":
        where, _, what = rest.partition(" - ")
        return kind, where, what
    return kind, None, rest


def config_key(name: str) -> Optional[str]:
    """The accelerate config key (megatron_lm_config in the YAML) that sets the field, if there is one."""
    if name == "recompute_granularity":
        return "megatron_lm_recompute_granularity"
    return f"megatron_lm_{ENV_FIELDS[name][0].lower()}" if name in ENV_FIELDS else None


def migration_table() -> str:
    """The README's migration table (markdown), one row per field of accelerate's MegatronLMPlugin."""
    rows = ["| accelerate field | config key | here |", "| --- | --- | --- |"]
    for name in FIELD_STATUS:
        kind, where, what = field_status(name)
        key = config_key(name)
        here = f"same meaning: {what}" if kind == "honoured" else f"**refused** {what}"
        rows.append(f"| `{name}` | {f'`{key}`' if key else ''} | {here} |")
    return "\n".join(rows) + "\n"


# layers/fp8.py's formats and recipes (Megatron's names); its other recipes need Transformer Engine's kernels
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "rowwise")
FP8_TE_ONLY_RECIPES = ("mxfp8", "blockwise", "custom")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FP8_MIN_CAPABILITY = (8, 9)
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
DECAY_STYLES = ("constant", "linear", "cosine")
CKPT_FORMATS = ("torch_dist", "megatron_plugin")
# Megatron-Core's AttnBackend names (megatron/core/transformer/enums.py); accelerate's bool means 'auto' or not
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")

# whole-number settings: (lowest value, what it counts); None means unset
_COUNTS = {
    "recompute_num_layers": 1, "num_layers_per_virtual_pipeline_stage": 1, "seq_length": 1,
    "encoder_seq_length": 1, "decoder_seq_length": 1, "decoder_last_pipeline_num_layers": 1,
    "context_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
    "train_iters": 1, "train_samples": 1, "lr_decay_iters": 1, "lr_decay_samples": 1,
    "lr_warmup_iters": 0, "lr_warmup_samples": 0, "eval_iters": 0, "eval_interval": 1,
    "seed": 0,
}
# probabilities in [0, 1): None means "the HF config's" (dropouts) or unset
_FRACTIONS = ("lr_warmup_fraction", "attention_dropout", "hidden_dropout")
# non-negative numbers
_NON_NEGATIVE = ("min_lr", "start_weight_decay", "end_weight_decay")
_SWITCHES = (
    "sequence_parallelism", "recompute_activations", "use_distributed_optimizer", "use_custom_fsdp", "no_load_optim",
    "no_save_optim", "eod_mask_loss", "optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d",
    "use_precision_aware_optimizer", "attention_softmax_in_fp32", "calculate_per_token_loss", "is_train_batch_min",
    "set_all_logging_options", "megatron_dataset_flag", "return_logits", "fused_kernels", "torch_compile",
)
_OPTIONAL_SWITCHES = ("use_rotary_position_embeddings",)
_CALLABLES = ("scale_lr_cond", "no_wd_decay_cond", "custom_model_provider_function", "custom_prepare_model_function",
              "custom_megatron_datasets_provider_function", "custom_get_batch_function", "custom_loss_function")


def _same_value(a, b) -> bool:
    """Equal as settings: 0 and 0.0 are, True and 1 are not."""
    if a is b:
        return True
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers.Number) and isinstance(b, numbers.Number):
        return a == b
    if callable(a) or callable(b):
        return False
    return type(a) is type(b) and a == b


def _splits_sequences_knowingly(step_class: type) -> bool:
    """Whether a custom train step can run under context parallelism: a GPT step (by class name along its
    MRO: train_steps sits above this module), or one that defines `before_sequence_split` itself."""
    if any(c.__name__ in ("GPTTrainStep", "PolicyGradientTrainStep", "DPOTrainStep") for c in step_class.__mro__):
        return True
    return any("before_sequence_split" in vars(c) for c in step_class.__mro__
               if c.__name__ != "AbstractTrainStep")


@dataclass
class MegatronLMPlugin:
    """Megatron-Core parallelism for an accelerate script. Fields left as None are read from the
    environment (`MEGATRON_LM_<NAME>`, as `accelerate launch` writes them), else take their default."""

    tp_degree: Optional[int] = field(default=None, metadata={"help": "tensor parallel degree"})
    pp_degree: Optional[int] = field(default=None, metadata={"help": "pipeline parallel degree"})
    num_micro_batches: Optional[int] = field(
        default=None, metadata={"help": "micro-batches per step; they play the role of gradient accumulation"}
    )
    gradient_clipping: Optional[float] = field(
        default=None, metadata={"help": "clip gradients to this global L2 norm; 0 disables clipping"}
    )
    sequence_parallelism: Optional[bool] = field(
        default=None, metadata={"help": "shard activations outside attention/MLP along the sequence (needs tp_degree > 1)"}
    )
    recompute_activations: Optional[bool] = field(
        default=None, metadata={"help": "selective activation recomputation (core attention is recomputed)"}
    )
    recompute_granularity: Optional[str] = field(
        default=None, metadata={"help": "'selective' or 'full'; overrides recompute_activations when set"}
    )
    recompute_method: Optional[str] = field(default=None, metadata={"help": "'uniform' (default) or 'block' for full recompute"})
    recompute_num_layers: Optional[int] = field(default=None, metadata={"help": "layers per recompute unit for full recompute (default 1)"})
    use_distributed_optimizer: Optional[bool] = field(
        default=None, metadata={"help": "shard optimizer state and gradients across data-parallel ranks"}
    )
    num_layers_per_virtual_pipeline_stage: Optional[int] = field(
        default=None, metadata={"help": "layers per virtual stage; setting it turns on the interleaved schedule"}
    )
    seq_length: Optional[int] = field(default=None, metadata={"help": "sequence length; default: the model's positions"})
    make_vocab_size_divisible_by: int = field(
        default=128, metadata={"help": "pad the vocabulary to a multiple of this times tp_degree"}
    )
    return_logits: bool = field(default=False, metadata={"help": "return logits as well as the loss in eval"})
    fused_kernels: bool = field(
        default=False,
        metadata={"help": "on CUDA, Megatron-Core's fused bias-GELU kernel"},
    )
    gradient_accumulation_fusion: Optional[bool] = field(
        default=None,
        metadata={"help": "on CUDA with bf16/fp16, compute each linear's weight gradient straight into the fp32 "
                          "main-gradient buffer (Megatron's --gradient-accumulation-fusion, here without apex); "
                          "default: on for CUDA (compiled layers then run their linears' weight gradients, and under TP "
                          "their reductions, as ops inside the graphs; see BENCHMARKS.md), off with compile modes "
                          "that replay CUDA graphs (reduce-overhead), which it does not support"},
    )
    torch_compile: bool = field(
        default=False,
        metadata={"help": "on CUDA, compile each transformer layer with torch.compile (Inductor); accelerate's "
                          "dynamo_backend / TorchDynamoPlugin does the same with its backend and mode"},
    )
    # FP8 training without Transformer Engine (layers/fp8.py): Megatron-LM's names and meanings (megatron-core's
    # TransformerConfig) and defaults, except the first and last layers kept in bf16 unless asked
    fp8: Optional[str] = field(
        default=None,
        metadata={"help": "train the transformer layers' linears with FP8 GEMMs (torch._scaled_mm; CUDA GPUs of "
                          "compute capability >= 8.9, with mixed_precision='bf16'): 'e4m3' for every tensor, or "
                          "'hybrid' (e4m3 forward, e5m2 gradients). The embedding and output layer stay bf16; "
                          "None (default): bf16 GEMMs"},
    )
    fp8_recipe: str = field(
        default="delayed",
        metadata={"help": "how FP8 scales are chosen: 'delayed' (one per tensor, from the amax history of earlier "
                          "steps, TE's DelayedScaling), 'tensorwise' (one per tensor from its amax now) or "
                          "'rowwise' (one per row: per token and per weight row; weight gradient in bf16)"},
    )
    fp8_margin: int = field(default=0, metadata={"help": "scale = fp8_max / amax / 2^fp8_margin"})
    fp8_amax_history_len: int = field(
        default=1, metadata={"help": "'delayed': how many uses of amaxes each tensor's scale looks back over "
                                     "(Megatron-LM's default 1; accelerate's FP8 recipe and TE's own: 1024)"})
    fp8_amax_compute_algo: str = field(
        default="most_recent", metadata={"help": "'delayed': the amax of the history window ('max') or the latest "
                                                 "one ('most_recent', Megatron-LM's and accelerate's default)"})
    fp8_wgrad: bool = field(
        default=True, metadata={"help": "the weight-gradient GEMM in FP8 too; False: in bf16 (Megatron's "
                                        "--no-fp8-wgrad)"})
    first_last_layers_bf16: bool = field(
        default=True, metadata={"help": "with fp8: keep the first num_layers_at_start_in_bf16 and the last "
                                        "num_layers_at_end_in_bf16 transformer layers in bf16 (on by default here, "
                                        "off in Megatron-LM: the layers most sensitive to FP8's range)"})
    num_layers_at_start_in_bf16: int = field(default=1, metadata={"help": "see first_last_layers_bf16"})
    num_layers_at_end_in_bf16: int = field(default=1, metadata={"help": "see first_last_layers_bf16"})
    fp8_output_layer: bool = field(
        default=False, metadata={"help": "with fp8: the output layer's GEMM (the projection onto the vocabulary, "
                                         "tied to the embedding or not) in FP8 too; off: bf16, as Megatron-LM keeps "
                                         "it (the logits' range is the widest in the model)"})
    # Megatron-LM's manual garbage collection (engine/manual_gc.py)
    manual_gc: bool = field(
        default=False, metadata={"help": "turn off Python's threshold-based garbage collector for the run and collect "
                                         "at chosen points instead, the same step on every rank, so that no rank "
                                         "stalls a step with a collection the others wait for (Megatron-LM's "
                                         "--manual-gc)"})
    manual_gc_interval: int = field(
        default=0, metadata={"help": "with manual_gc: collect every this many training steps; 0: never between "
                                     "steps (Megatron-LM's --manual-gc-interval)"})
    manual_gc_eval: bool = field(
        default=True, metadata={"help": "with manual_gc: also collect where evaluation starts and ends (the model "
                                        "switching between eval() and train()); False is Megatron-LM's "
                                        "--no-manual-gc-eval"})
    hf_checkpoint: Optional[str] = field(
        default=None,
        metadata={"help": "a local HF model folder (safetensors, sharded or not) to read the weights from when the "
                          "model given to prepare has none (meta device, e.g. built under accelerate's "
                          "init_empty_weights); each rank reads only its slices. Default: the model config's "
                          "_name_or_path. When set, it wins over _name_or_path"},
    )
    seed: int = field(default=1234, metadata={"help": "seed of torch and of Megatron's parallel RNG tracker"})
    lr_decay_style: str = field(default="linear", metadata={"help": "'constant', 'linear' or 'cosine'"})
    min_lr: float = field(default=0.0, metadata={"help": "the learning rate at the end of decay"})
    lr_decay_iters: Optional[int] = field(default=None, metadata={"help": "decay steps; default: total_num_steps"})
    # read by training scripts (the guide's indexed-dataset loop), not by the plugin
    eval_iters: int = field(default=100, metadata={"help": "eval batches, for scripts that loop on it"})
    eval_interval: int = field(default=1000, metadata={"help": "steps between evals, for scripts that loop on it"})
    custom_train_step_class: Optional[type] = field(
        default=None, metadata={"help": "an AbstractTrainStep subclass to use instead of the model's default"}
    )
    custom_train_step_kwargs: dict = field(
        default_factory=dict, metadata={"help": "keyword arguments passed to custom_train_step_class"}
    )
    megatron_dataset_flag: bool = field(
        default=False, metadata={"help": "the dataloaders are Megatron indexed datasets: pass a MegatronLMDummyDataLoader "
                                          "to prepare (set for you when you do)"}
    )
    # --- the rest of accelerate's MegatronLMPlugin, by its names and with Megatron-LM's meaning ---
    # parallel layout
    context_parallel_size: Optional[int] = field(default=None, metadata={"help": "context parallel degree: each sequence is cut into 2 x CP chunks and every CP rank holds two of them (Megatron's load-balanced layout), for GPT-2 and the Llama family; sequence lengths must be multiples of 2 x context_parallel_size (default 1)"})
    expert_model_parallel_size: Optional[int] = field(default=None, metadata={"help": "expert parallel degree of MoE layers: each rank of an expert-parallel group holds 1/EP of the experts (default 1)"})
    expert_tensor_parallel_size: Optional[int] = field(default=None, metadata={"help": "tensor parallel degree inside the experts (default: tp_degree)"})
    decoder_last_pipeline_num_layers: Optional[int] = field(default=None, metadata={"help": "layers on the last pipeline stage; the others split the rest evenly (default: an even split)"})
    pipeline_model_parallel_split_rank: Optional[int] = field(default=None, metadata={"help": "Megatron-LM's encoder/decoder pipeline split: refused, Megatron-Core removed it"})
    use_custom_fsdp: Optional[bool] = field(default=None, metadata={"help": "Megatron-Core's FSDP: refused (not supported); use use_distributed_optimizer=True"})
    # model
    attention_dropout: Optional[float] = field(default=None, metadata={"help": "dropout of attention probabilities (default: the HF config's)"})
    hidden_dropout: Optional[float] = field(default=None, metadata={"help": "dropout after attention and MLP (default: the HF config's)"})
    attention_softmax_in_fp32: Optional[bool] = field(default=None, metadata={"help": "compute the attention softmax in fp32 (default True)"})
    attention_backend: Optional[object] = field(default=None, metadata={"help": "Megatron-LM's --attention-backend for our SDPA attention: 'auto' (default; True/False too) lets torch pick the kernel, 'flash' torch's flash kernel, 'fused' cuDNN else memory-efficient (CUDA), 'unfused'/'local' the math path"})
    use_rotary_position_embeddings: Optional[bool] = field(default=None, metadata={"help": "rotary position embeddings; default: what the HF model uses"})
    encoder_seq_length: Optional[int] = field(default=None, metadata={"help": "encoder sequence length (T5); for decoder-only models, the sequence length"})
    decoder_seq_length: Optional[int] = field(default=None, metadata={"help": "decoder sequence length (T5)"})
    # loss
    calculate_per_token_loss: Optional[bool] = field(default=None, metadata={"help": "weight each token equally over micro-batches and data-parallel ranks: the loss over the global batch, as HF computes it (default False: the mean of micro-batch means)"})
    eod_mask_loss: Optional[bool] = field(default=None, metadata={"help": "no loss for the token predicted at an end-of-document (eos) input token (Megatron's loss_mask[tokens == eod] = 0)"})
    # schedule and optimizer
    train_iters: Optional[int] = field(default=None, metadata={"help": "optimizer steps of the whole run (or train_samples)"})
    train_samples: Optional[int] = field(default=None, metadata={"help": "samples of the whole run; steps = train_samples / global batch"})
    lr_warmup_iters: Optional[int] = field(default=None, metadata={"help": "steps of linear warmup"})
    lr_warmup_samples: Optional[int] = field(default=None, metadata={"help": "samples of linear warmup"})
    lr_warmup_fraction: Optional[float] = field(default=None, metadata={"help": "warmup as a fraction of the decay steps"})
    lr_decay_samples: Optional[int] = field(default=None, metadata={"help": "samples of learning-rate decay (default: train_samples)"})
    start_weight_decay: Optional[float] = field(default=None, metadata={"help": "weight decay at the start (default: the optimizer's)"})
    end_weight_decay: Optional[float] = field(default=None, metadata={"help": "weight decay at the end (default: the optimizer's)"})
    weight_decay_incr_style: str = field(default="constant", metadata={"help": "'constant', 'linear' or 'cosine' from start_ to end_weight_decay"})
    lr_mult: float = field(default=1.0, metadata={"help": "learning-rate multiplier for the parameters scale_lr_cond selects"})
    scale_lr_cond: Optional[Callable] = field(default=None, metadata={"help": "scale_lr_cond(name, param) -> bool, with Megatron-Core parameter names (decoder.layers.0.mlp.linear_fc1.weight): these parameters get lr * lr_mult"})
    no_wd_decay_cond: Optional[Callable] = field(default=None, metadata={"help": "no_wd_decay_cond(name, param) -> bool, with Megatron-Core parameter names: when given it decides for every parameter (True: no weight decay; False: the optimizer's)"})
    optimizer_cpu_offload: Optional[bool] = field(default=None, metadata={"help": "keep optimizer states and step on the CPU (Megatron-Core's hybrid optimizer; CUDA needs AdamW, use_distributed_optimizer=True and no_save_optim=True: its state does not load back yet; the CPU engine's optimizer is there already)"})
    overlap_cpu_optimizer_d2h_h2d: Optional[bool] = field(default=None, metadata={"help": "with optimizer_cpu_offload: overlap the gradient and parameter copies with the step"})
    use_precision_aware_optimizer: Optional[bool] = field(default=None, metadata={"help": "Megatron-Core's precision-aware optimizer (needs Transformer Engine, AdamW and use_distributed_optimizer=True)"})
    # checkpoints
    no_load_optim: Optional[bool] = field(default=None, metadata={"help": "load_state reads the weights (and schedule) but not the optimizer state"})
    no_save_optim: Optional[bool] = field(default=None, metadata={"help": "save_state writes no optimizer state"})
    ckpt_format: str = field(default="torch_dist", metadata={"help": "save_state's format: 'torch_dist' (Megatron-LM's layout and megatron-core's dist_checkpointing) or 'megatron_plugin' (safetensors per rank)"})
    # data
    is_train_batch_min: bool = field(default=True, metadata={"help": "the micro-batch is the smallest of the loaders' batch sizes (False: the largest), and every loader is re-batched to it, as accelerate does"})
    consumed_samples: Optional[list] = field(default=None, metadata={"help": "[train, valid, test] samples already consumed, for Megatron indexed datasets"})
    # logging
    tensorboard_dir: Optional[str] = field(default=None, metadata={"help": "write TensorBoard scalars (loss, learning rate, grad norm, ...) here"})
    set_all_logging_options: bool = field(default=False, metadata={"help": "with tensorboard_dir: also log timers, memory and parameter norms"})
    # Megatron-LM's hooks
    custom_model_provider_function: Optional[Callable] = field(default=None, metadata={"help": "model_provider(pre_process, post_process) -> a Megatron-Core module, instead of converting the HF model"})
    custom_prepare_model_function: Optional[Callable] = field(default=None, metadata={"help": "prepare_model(model_provider) -> model chunks"})
    custom_megatron_datasets_provider_function: Optional[Callable] = field(default=None, metadata={"help": "train_valid_test_datasets_provider(train_val_test_num_samples) for indexed data"})
    custom_get_batch_function: Optional[Callable] = field(default=None, metadata={"help": "get_batch(data_iterator) for the train step"})
    custom_loss_function: Optional[Callable] = field(default=None, metadata={"help": "loss_func(..., output_tensor) for the train step"})
    other_megatron_args: dict = field(
        default_factory=dict, metadata={"help": "extra TransformerConfig fields, e.g. {'attention_dropout': 0.0}; "
                                        "{'cuda_graph_impl': 'local', 'cuda_graph_scope': 'full_iteration'} replays "
                                        "each training step's forward and backward as one CUDA graph"}
    )

    def __post_init__(self):
        for name, (env, kind, default) in ENV_FIELDS.items():
            if getattr(self, name) is None:
                raw = os.environ.get(ENV_PREFIX + env)
                setattr(self, name, default if raw is None else _PARSERS[kind](ENV_PREFIX + env, raw))
        if self.recompute_granularity is None:
            raw = os.environ.get(ENV_PREFIX + "RECOMPUTE_GRANULARITY")
            if raw:
                self.recompute_granularity = raw.strip().lower()
            elif self.recompute_activations:
                self.recompute_granularity = "selective"
        # an import path becomes the class here, once; validate() only checks (prepare never writes the plugin)
        self.custom_train_step_class = resolve_train_step_class(self.custom_train_step_class)
        self.validate()

    def validate(self, world_size: Optional[int] = None, num_layers: Optional[int] = None):
        """Check the settings on their own and, when given, against the launch and the model."""
        for name in ("tp_degree", "pp_degree", "num_micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MegatronPluginConfigError(name, value, f"{name} must be a whole number >= 1")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
            raise MegatronPluginConfigError("gradient_clipping", clip, "use a finite norm > 0, or 0 to disable clipping")
        resolve_train_step_class(self.custom_train_step_class)
        if not isinstance(self.custom_train_step_kwargs, dict):
            raise MegatronPluginConfigError(
                "custom_train_step_kwargs", self.custom_train_step_kwargs, "pass a dict of keyword arguments"
            )
        fusion = self.gradient_accumulation_fusion
        if not (fusion is None or isinstance(fusion, bool)):
            raise MegatronPluginConfigError(
                "gradient_accumulation_fusion", fusion,
                "use True, False, or None (the default: on for CUDA with eager layers)",
            )
        if self.sequence_parallelism and self.tp_degree == 1:
            raise MegatronPluginConfigError(
                "sequence_parallelism", True, "sequence parallelism shards over TP ranks: set tp_degree > 1 or turn it off"
            )
        if self.recompute_granularity not in (None, *RECOMPUTE_GRANULARITIES):
            raise MegatronPluginConfigError(
                "recompute_granularity", self.recompute_granularity, f"use one of {RECOMPUTE_GRANULARITIES}"
            )
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise MegatronPluginConfigError("recompute_method", self.recompute_method, f"use one of {RECOMPUTE_METHODS}")
        if self.make_vocab_size_divisible_by < 1:
            raise MegatronPluginConfigError(
                "make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, "use a whole number >= 1, e.g. 128"
            )
        if self.lr_decay_style not in DECAY_STYLES:
            raise MegatronPluginConfigError("lr_decay_style", self.lr_decay_style, "use 'constant', 'linear' or 'cosine'")
        self._validate_accelerate_fields()
        self._validate_fp8()
        full_iteration_graph(self)
        self._require_switches("manual_gc", "manual_gc_eval")
        self._require_whole("manual_gc_interval", 0, " (steps between collections; 0: none between steps)")
        if world_size is not None and world_size < 1:
            raise MegatronPluginConfigError("num_processes", world_size, "launch at least one process")
        if world_size is not None:
            # Megatron's grid: TP x CP x PP ranks hold one model replica, DP replicas fill the world
            model_parallel = self.tp_degree * self.pp_degree * self.context_parallel_size
            if world_size % model_parallel:
                if self.context_parallel_size > 1:
                    raise MegatronPluginConfigError(
                        "tp_degree*context_parallel_size*pp_degree",
                        f"{self.tp_degree}*{self.context_parallel_size}*{self.pp_degree}={model_parallel}",
                        f"the world size {world_size} must be a multiple of it: launch a multiple of "
                        f"{model_parallel} processes, or lower tp_degree/context_parallel_size/pp_degree",
                    )
                raise MegatronPluginConfigError(
                    "tp_degree*pp_degree",
                    f"{self.tp_degree}*{self.pp_degree}={model_parallel}",
                    f"the world size {world_size} must be a multiple of it: launch a multiple of "
                    f"{model_parallel} processes, or lower tp_degree/pp_degree",
                )
            # Megatron's expert grid: ETP x EP x PP ranks hold one copy of the experts (parallel_state)
            etp = self.expert_tensor_parallel_size or self.tp_degree
            expert_parallel = etp * self.expert_model_parallel_size * self.pp_degree
            if world_size % expert_parallel:
                setting = "expert_model_parallel_size" if self.expert_model_parallel_size > 1 else "expert_tensor_parallel_size"
                raise MegatronPluginConfigError(
                    setting, getattr(self, setting),
                    f"the world size {world_size} must be a multiple of expert_tensor_parallel_size x "
                    f"expert_model_parallel_size x pp_degree = {etp} x {self.expert_model_parallel_size} x "
                    f"{self.pp_degree} = {expert_parallel} (Megatron's expert layout): launch a multiple of "
                    f"{expert_parallel} processes, or lower {setting}",
                )
        if num_layers is not None and self.fp8 and self.first_last_layers_bf16:
            bf16 = self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16
            if bf16 >= num_layers:
                raise MegatronPluginConfigError(
                    "num_layers_at_start_in_bf16+num_layers_at_end_in_bf16",
                    f"{self.num_layers_at_start_in_bf16}+{self.num_layers_at_end_in_bf16}",
                    f"the model has {num_layers} layers, so none would run in FP8: keep fewer layers in bf16, "
                    "set first_last_layers_bf16=False, or leave fp8 unset",
                )
        if num_layers is not None:
            stages = self.pp_degree * (self.virtual_pipeline_stages(num_layers) or 1)
            if self.pp_degree > num_layers or num_layers % stages:
                raise MegatronPluginConfigError(
                    "pp_degree", self.pp_degree,
                    f"the model's {num_layers} layers must split evenly over {stages} pipeline stages: "
                    "choose a pp_degree (times virtual stages) that divides the number of layers",
                )
        return self

    def _require_switches(self, *names: str):
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise MegatronPluginConfigError(name, getattr(self, name), "use True or False")

    def _require_whole(self, name: str, low: int, meaning: str = ""):
        value = getattr(self, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise MegatronPluginConfigError(name, value, f"use a whole number >= {low}{meaning}")

    def _validate_accelerate_fields(self):
        """Types and ranges of the settings accelerate's plugin has, and the refusals of what cannot run here
        (FIELD_STATUS says why, and what to use instead)."""
        for name, low in _COUNTS.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low):
                raise MegatronPluginConfigError(name, value, f"use a whole number >= {low}, or leave it unset (None)")
        for name in _FRACTIONS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not 0 <= value < 1):
                raise MegatronPluginConfigError(name, value, "use a fraction in [0, 1), or leave it unset (None)")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not math.isfinite(value) or value < 0):
                raise MegatronPluginConfigError(name, value, "use a finite number >= 0")
        lr_mult = self.lr_mult
        if isinstance(lr_mult, bool) or not isinstance(lr_mult, numbers.Real) or not math.isfinite(lr_mult) or lr_mult < 0:
            raise MegatronPluginConfigError("lr_mult", lr_mult, "use a finite number >= 0 (1.0 leaves the learning rate as it is; 0 freezes scale_lr_cond's parameters)")
        self._require_switches(*_SWITCHES)
        for name in _OPTIONAL_SWITCHES:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise MegatronPluginConfigError(name, getattr(self, name), "use True, False, or None (what the HF model does)")
        for name in _CALLABLES:
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise MegatronPluginConfigError(name, getattr(self, name), "pass a function (or leave it None)")
        if self.weight_decay_incr_style not in DECAY_STYLES:
            raise MegatronPluginConfigError("weight_decay_incr_style", self.weight_decay_incr_style,
                                            "use 'constant', 'linear' or 'cosine'")
        if self.ckpt_format not in CKPT_FORMATS:
            raise MegatronPluginConfigError("ckpt_format", self.ckpt_format, f"use one of {CKPT_FORMATS}")
        if self.ckpt_format == "megatron_plugin" and self.decoder_last_pipeline_num_layers is not None:
            # its files name stages by an even split of the layers; torch_dist records each layer's index
            raise MegatronPluginConfigError(
                "ckpt_format", "megatron_plugin",
                f"a run with decoder_last_pipeline_num_layers={self.decoder_last_pipeline_num_layers} saves with "
                "ckpt_format='torch_dist' (the megatron_plugin format assumes evenly split pipeline stages)")
        expert_layout = (self.expert_model_parallel_size or 1) > 1 or self.expert_tensor_parallel_size not in (None, self.tp_degree)
        if (self.ckpt_format == "megatron_plugin" and self.use_distributed_optimizer and expert_layout
                and not self.no_save_optim):
            # megatron-core chains a second distributed optimizer for the experts, sharded over the expert
            # data-parallel group: one file per rank cannot hold it; torch_dist's sharded state can
            raise MegatronPluginConfigError(
                "ckpt_format", "megatron_plugin",
                "with use_distributed_optimizer and expert parallelism (expert_model_parallel_size > 1 or "
                "expert_tensor_parallel_size != tp_degree) save with ckpt_format='torch_dist' (or set no_save_optim=True)")
        backend = self.attention_backend
        if not (isinstance(backend, bool) or backend in ATTENTION_BACKENDS):
            raise MegatronPluginConfigError("attention_backend", backend,
                                            f"use True/False (accelerate's) or one of {ATTENTION_BACKENDS}")
        if self.tensorboard_dir is not None and not isinstance(self.tensorboard_dir, (str, os.PathLike)):
            raise MegatronPluginConfigError("tensorboard_dir", self.tensorboard_dir, "pass a folder path (str)")
        consumed = self.consumed_samples
        if consumed is not None and (not isinstance(consumed, (list, tuple)) or not 1 <= len(consumed) <= 3 or any(
                isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0 for n in consumed)):
            raise MegatronPluginConfigError("consumed_samples", consumed,
                                            "pass [train, valid, test] samples already consumed: up to 3 whole numbers >= 0")
        # Megatron-LM's own exclusions (megatron/training/arguments.py validate_args)
        for a, b in (("train_iters", "train_samples"), ("lr_warmup_iters", "lr_warmup_samples"),
                     ("lr_warmup_fraction", "lr_warmup_iters"), ("lr_warmup_fraction", "lr_warmup_samples")):
            if getattr(self, a) and getattr(self, b):
                raise MegatronPluginConfigError(f"{a} and {b}", (getattr(self, a), getattr(self, b)),
                                                "they say the same thing in two ways: set one of them")
        if self.custom_prepare_model_function is not None and self.custom_model_provider_function is None:
            raise MegatronPluginConfigError(
                "custom_prepare_model_function", self.custom_prepare_model_function,
                "it builds the model chunks from custom_model_provider_function: set that too (as accelerate requires)",
            )
        self._refuse_unsupported()

    def _validate_fp8(self):
        """The fp8 settings on their own (check_fp8 checks them against the device and mixed precision)."""
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            fix = f"use one of {FP8_FORMATS} (Megatron's --fp8-format), or None for bf16"
            if isinstance(self.fp8, str) and self.fp8.lower() in FP8_FORMATS:
                fix = f"write it in lower case, as Megatron does: fp8={self.fp8.lower()!r}"
            raise MegatronPluginConfigError("fp8", self.fp8, fix)
        if self.fp8_recipe not in FP8_RECIPES:
            fix = f"use one of {FP8_RECIPES}"
            if self.fp8_recipe in FP8_TE_ONLY_RECIPES:
                fix = f"{self.fp8_recipe!r} needs Transformer Engine's kernels, which this plugin does not use: {fix}"
            raise MegatronPluginConfigError("fp8_recipe", self.fp8_recipe, fix)
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise MegatronPluginConfigError("fp8_amax_compute_algo", self.fp8_amax_compute_algo,
                                            f"use one of {AMAX_COMPUTE_ALGOS}")
        for name, low in (("fp8_margin", 0), ("fp8_amax_history_len", 1), ("num_layers_at_start_in_bf16", 0),
                          ("num_layers_at_end_in_bf16", 0)):
            self._require_whole(name, low)
        self._require_switches("fp8_wgrad", "first_last_layers_bf16", "fp8_output_layer")
        if self.fp8_output_layer and not self.fp8:
            raise MegatronPluginConfigError("fp8_output_layer", True, "it puts the output layer in FP8 alongside the "
                                            "layers' linears: set fp8 ('hybrid' or 'e4m3') too, or leave it False")

    def _refuse_unsupported(self):
        """Settings of accelerate's plugin whose feature does not run here (see FIELD_STATUS)."""
        if self.context_parallel_size > 1 and self.custom_model_provider_function is not None:
            # the engine splits each sequence for our attention (layers/context_parallel.py); a provider's
            # module has megatron-core's own, which without Transformer Engine refuses or ignores the split
            raise MegatronPluginConfigError(
                "context_parallel_size", self.context_parallel_size,
                "context parallelism runs the HF model's conversion, whose attention sees the whole sequence; a "
                "module from custom_model_provider_function has megatron-core's own attention: use "
                "context_parallel_size=1 with it, or leave custom_model_provider_function unset",
            )
        if self.context_parallel_size > 1 and self.custom_get_batch_function is not None:
            # it gets this rank's part of each sequence: masks and position ids built from that part alone
            # (as the guide's get_ltor_masks_and_position_ids does) would be those of a shorter sequence
            raise MegatronPluginConfigError(
                "custom_get_batch_function", self.custom_get_batch_function,
                f"with context_parallel_size={self.context_parallel_size} each rank holds two chunks of every "
                "sequence, and masks or position ids built from them alone are wrong: leave it unset (the train "
                "step's own get_batch builds them by global positions), or use context_parallel_size=1",
            )
        if (self.context_parallel_size > 1 and self.custom_loss_function is not None
                and not self.calculate_per_token_loss):
            # a mean over this rank's tokens, averaged over ranks, is not the mean over the whole sequence
            # when the ranks' loss tokens differ; (sum, count) is weighed over DP x CP by the engine
            raise MegatronPluginConfigError(
                "custom_loss_function", self.custom_loss_function,
                f"with context_parallel_size={self.context_parallel_size} it sees one rank's part of each "
                "sequence, and a mean over those tokens is not the whole sequence's: set "
                "calculate_per_token_loss=True and return (loss sum, token count, logs), which the engine "
                "weighs over the context-parallel ranks; or leave it unset, or use context_parallel_size=1",
            )
        step = self.custom_train_step_class
        if self.context_parallel_size > 1 and isinstance(step, type) and not _splits_sequences_knowingly(step):
            # a step that shifts labels itself would shift them inside each rank's two chunks (wrong at their edges)
            raise MegatronPluginConfigError(
                "custom_train_step_class", step.__name__,
                f"with context_parallel_size={self.context_parallel_size} each rank holds two chunks of every "
                "sequence: subclass GPTTrainStep (which shifts labels over the whole sequence first), or define "
                "before_sequence_split(micro_batch) to compute what needs the whole sequence, or use "
                "context_parallel_size=1",
            )
        if self.pipeline_model_parallel_split_rank is not None:
            raise MegatronPluginConfigError(
                "pipeline_model_parallel_split_rank", self.pipeline_model_parallel_split_rank,
                "Megatron-Core removed it (encoder and decoder share pipeline stages now): leave it unset; pp_degree "
                "splits T5's layers as it does any model's",
            )
        if self.use_custom_fsdp:
            raise MegatronPluginConfigError(
                "use_custom_fsdp", True,
                "Megatron-Core's FSDP is not supported: set use_custom_fsdp=False and shard the optimizer state and "
                "gradients with use_distributed_optimizer=True",
            )

    def virtual_pipeline_stages(self, num_layers: int) -> Optional[int]:
        n = self.num_layers_per_virtual_pipeline_stage
        if n is None:
            return None
        per_stage = num_layers // self.pp_degree
        if n < 1 or per_stage % n:
            raise MegatronPluginConfigError(
                "num_layers_per_virtual_pipeline_stage", n,
                f"it must divide the {per_stage} layers of each pipeline stage",
            )
        return per_stage // n

    @classmethod
    def from_accelerate(cls, plugin) -> "MegatronLMPlugin":
        """Ours, from an `accelerate.utils.MegatronLMPlugin`, field by field (every accelerate field has our
        name and Megatron-LM's meaning; `FIELD_STATUS` says what each does here).

        accelerate's `__post_init__` fills what was not given with defaults that are not Megatron's
        (context_parallel_size=2, recompute_granularity='full' without recompute_activations,
        calculate_per_token_loss=True, attention_backend=True, use_rotary_position_embeddings=True,
        attention_dropout=hidden_dropout=0.0, ...), and afterwards a filled value cannot be told from a given
        one. So a field whose value equals what a no-argument accelerate `MegatronLMPlugin()` holds under the
        same environment is taken as unset: ours then reads the environment (`MEGATRON_LM_*`) or takes its own
        default. A value given in code that happens to equal accelerate's default (say
        `context_parallel_size=2`) is therefore read as unset too: pass such values to our plugin directly."""
        from accelerate.utils import MegatronLMPlugin as AcceleratePlugin

        if not isinstance(plugin, AcceleratePlugin):
            raise MegatronPluginConfigError("megatron_lm_plugin", type(plugin).__name__,
                                            "pass an accelerate.utils.MegatronLMPlugin or a megatron_plugin.MegatronLMPlugin")
        untouched = AcceleratePlugin()
        ours = {f.name for f in dataclasses.fields(cls)}
        given = {}
        for f in dataclasses.fields(AcceleratePlugin):
            value = getattr(plugin, f.name)
            if _same_value(value, getattr(untouched, f.name)):
                continue
            if f.name not in ours:  # a field of a newer accelerate than this table was written for
                raise MegatronPluginConfigError(
                    f.name, value, "this accelerate field is unknown to megatron_plugin: leave it unset, or use "
                    "megatron_plugin.MegatronLMPlugin's own settings (see FIELD_STATUS / the README's migration table)",
                )
            given[f.name] = dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else value
        return cls(**given)


# Plugin settings the CPU engine cannot honour: each rests on a Megatron-Core piece that is CUDA-only.
_CUDA_ONLY = {
    "pp_degree": (lambda p: p.pp_degree > 1, "pipeline schedules and p2p buffers", "pp_degree=1"),
    "use_distributed_optimizer": (lambda p: p.use_distributed_optimizer, "DistributedOptimizer", "use_distributed_optimizer=False"),
    "recompute_activations": (lambda p: p.recompute_granularity is not None, "activation checkpointing (CUDA RNG states)",
                              "recompute_activations=False and recompute_granularity=None"),
}


def check_cpu_support(plugin: MegatronLMPlugin) -> None:
    check_fp8(plugin, "cpu", None)
    for setting, (used, piece, fix) in _CUDA_ONLY.items():
        if used(plugin):
            if setting == "recompute_activations" and not plugin.recompute_activations:
                setting = "recompute_granularity"  # set on its own (recompute_activations only implies 'selective')
            raise MegatronPluginConfigError(
                setting, getattr(plugin, setting),
                f"Megatron-Core's {piece} need CUDA; for a CPU run set {fix} (the GPU engine supports it)",
            )


def check_fp8(plugin: MegatronLMPlugin, device_type: str, mixed_precision,
              non_decoder_family: Optional[str] = None) -> None:
    """FP8 GEMMs (layers/fp8.py) need a decoder-only model (megatron-core's GPTModel: GPT-2, the Llama and MoE
    families), a CUDA GPU of compute capability >= 8.9 (Ada, Hopper and later) and bf16 mixed precision (bf16
    activations and weights around them, fp32 master weights in megatron-core's optimizer). `non_decoder_family`:
    the family name of a model that is not decoder-only (a family with its own builder: BERT, T5), None for one
    that is or when not known; `mixed_precision` None: not checked (a CPU run is refused before it matters)."""
    if not plugin.fp8:
        return
    if plugin.custom_model_provider_function is not None:
        raise MegatronPluginConfigError(
            "fp8", plugin.fp8, "FP8 runs in the linears prepare builds from the HF model (layers/fp8.py): leave "
            "custom_model_provider_function unset with fp8, or leave fp8 unset with a provider")
    if non_decoder_family is not None:
        raise MegatronPluginConfigError(
            "fp8", plugin.fp8, f"FP8 linears are for decoder-only models (GPT-2, Llama, Mistral, Qwen, the MoE "
            f"families), not {non_decoder_family}: leave fp8 unset for this model")
    if device_type != "cuda":
        raise MegatronPluginConfigError(
            "fp8", plugin.fp8, "FP8 needs a CUDA GPU with compute capability >= 8.9 (H100/L40/4090): leave fp8 "
            "unset on CPU")
    import torch

    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise MegatronPluginConfigError(
            "fp8", plugin.fp8,
            f"FP8 needs a CUDA GPU with compute capability >= 8.9 (H100/L40/4090); this one "
            f"({torch.cuda.get_device_name()}) has {capability[0]}.{capability[1]}: leave fp8 unset (bf16)")
    if mixed_precision is not None and mixed_precision != "bf16":
        raise MegatronPluginConfigError(
            "mixed_precision", mixed_precision,
            f"fp8={plugin.fp8!r} trains around bf16 activations and weights: use mixed_precision='bf16' "
            "(Accelerator(mixed_precision='bf16') or accelerate config), or leave fp8 unset")


# accelerate's FP8 recipe kwargs for Transformer Engine (TERecipeKwargs, and the deprecated FP8RecipeKwargs with
# backend "TE"), read by name: they cannot be built without Transformer Engine installed, and a launch config
# writes them as ACCELERATE_FP8_* variables, read when no kwargs object is given
_TE_KWARGS = ("TERecipeKwargs", "FP8RecipeKwargs")
_OTHER_FP8_KWARGS = ("AORecipeKwargs", "MSAMPRecipeKwargs")
FP8_HANDLERS = _TE_KWARGS + _OTHER_FP8_KWARGS
_FP8_FORMAT_NAMES = {"HYBRID": "hybrid", "E4M3": "e4m3"}


def fp8_from_accelerate(plugin: MegatronLMPlugin, mixed_precision, handlers=()):
    """(plugin, mixed_precision) for accelerate's `mixed_precision='fp8'`: this plugin's FP8 (layers/fp8.py) around
    bf16, with TERecipeKwargs' fields where they mean what Megatron's do (fp8_format -> fp8, margin -> fp8_margin,
    amax_history_len, amax_compute_algo, override_linear_precision=(False, False, True) -> fp8_wgrad=False) and
    refused where they do not. Any other mixed precision: unchanged. The plugin is copied, never written; fp8 set
    on the plugin itself wins over accelerate's recipe. Eval forwards run the FP8 GEMMs too (as Megatron-LM's
    evaluation does; use_autocast_during_eval is not read)."""
    if mixed_precision != "fp8":
        return plugin, mixed_precision
    handler = None
    for h in handlers or ():
        name = type(h).__name__
        if name in _OTHER_FP8_KWARGS or (name == "FP8RecipeKwargs" and str(getattr(h, "backend", "TE")).upper() != "TE"):
            raise MegatronPluginConfigError(
                "kwargs_handlers", name,
                "Megatron runs FP8 with its own torch._scaled_mm linears, configured like Transformer Engine's recipe: "
                "pass TERecipeKwargs (or none), or set MegatronLMPlugin(fp8=...) and mixed_precision='bf16'")
        if name in _TE_KWARGS:
            handler = h
    backend = os.environ.get("ACCELERATE_FP8_BACKEND")  # a launch config's fp8_backend (AO, MSAMP, TE)
    if handler is None and backend is not None and backend.upper() != "TE":
        raise MegatronPluginConfigError(
            "fp8_backend", backend,
            "Megatron runs FP8 with its own torch._scaled_mm linears, configured like Transformer Engine's recipe: "
            "set fp8_backend: TE in the accelerate config, or MegatronLMPlugin(fp8=...) and mixed_precision bf16")

    def read(field, env, default, parse=str):
        value = getattr(handler, field, None) if handler is not None else None
        if value is None:
            raw = os.environ.get("ACCELERATE_FP8_" + env)
            value = default if raw is None else parse(raw)
        return value

    fmt = str(read("fp8_format", "FORMAT", "HYBRID")).upper()
    if fmt not in _FP8_FORMAT_NAMES:
        raise MegatronPluginConfigError(
            "TERecipeKwargs.fp8_format", fmt,
            "training takes 'HYBRID' (e4m3 forward, e5m2 gradients) or 'E4M3'; E5M2 forward GEMMs are not Megatron's")
    interval = int(read("interval", "INTERVAL", 1, int))
    if interval != 1:
        raise MegatronPluginConfigError(
            "TERecipeKwargs.interval", interval,
            "delayed scaling updates each tensor's scale at every use (TE ignores interval since 1.8): leave it 1")
    if read("use_mxfp8_block_scaling", "USE_MXFP8_BLOCK_SCALING", False, lambda r: parse_bool("use_mxfp8_block_scaling", r)):
        raise MegatronPluginConfigError(
            "TERecipeKwargs.use_mxfp8_block_scaling", True,
            "MXFP8 needs Transformer Engine on Blackwell GPUs: leave it False (tensor scales, Megatron's 'delayed')")
    override = getattr(handler, "override_linear_precision", None) if handler is not None else None
    if override is None:  # accelerate launch writes the three flags apart (accelerate/utils/launch.setup_fp8_env)
        from accelerate.utils import parse_flag_from_env

        override = tuple(parse_flag_from_env("ACCELERATE_FP8_OVERRIDE_" + k) for k in ("FPROP", "DGRAD", "WGRAD"))
    override = tuple(bool(v) for v in override)
    if override not in ((False, False, False), (False, False, True)):
        raise MegatronPluginConfigError(
            "TERecipeKwargs.override_linear_precision", override,
            "only the weight gradient can stay in higher precision (Megatron's fp8_wgrad=False): use "
            "(False, False, True) or (False, False, False)")
    out = dataclasses.replace(plugin) if plugin.fp8 is not None else dataclasses.replace(
        plugin, fp8=_FP8_FORMAT_NAMES[fmt], fp8_recipe="delayed",
        fp8_margin=int(read("margin", "MARGIN", 0, int)),
        fp8_amax_history_len=int(read("amax_history_len", "AMAX_HISTORY_LEN", 1024, int)),
        fp8_amax_compute_algo=str(read("amax_compute_algo", "AMAX_COMPUTE_ALGO", "most_recent")).lower(),
        fp8_wgrad=override != (False, False, True))
    return out, "bf16"


def check_mixed_precision(mixed_precision, device_type: str) -> None:
    """fp16 (dynamic loss scaling in mcore's optimizer) runs on the CUDA engine only."""
    if mixed_precision == "fp16" and device_type != "cuda":
        raise MegatronPluginConfigError("mixed_precision", "fp16", "fp16 needs CUDA; use 'bf16' or 'no' on CPU")


def check_compile(plugin: MegatronLMPlugin, compile_kwargs: Optional[dict], device_type: str) -> None:
    """Compiled layers run on the CUDA engine (with TP > 1 the tensor-parallel linears stay eager inside
    them: layers/linear.py)."""
    if compile_kwargs is None:
        return
    setting, value = ("torch_compile", True) if plugin.torch_compile else ("dynamo_backend", compile_kwargs.get("backend"))
    off = "set torch_compile=False and dynamo_backend 'no' (accelerate config / Accelerator(dynamo_backend=...))"
    if device_type != "cuda":
        raise MegatronPluginConfigError(setting, value, f"compiled layers are for the CUDA engine only; for a CPU run {off}")
    if uses_cuda_graphs(compile_kwargs) and plugin.fp8:
        # measured, not explained: Llama-1B FP8 tensorwise ran 14,210 tok/s against 51,846 in the default mode
        # (H200, 2026-11-29; ~1 s a step), and no test covers FP8 under graph replays
        raise MegatronPluginConfigError(
            "fp8", plugin.fp8,
            f"torch.compile mode {compile_kwargs.get('mode')!r} replays CUDA graphs, which the FP8 linears do not "
            "support (untested, and 3.6x slower where measured): use the default compile mode with fp8, or leave "
            "fp8 unset for CUDA graphs",
        )
    if uses_cuda_graphs(compile_kwargs) and plugin.gradient_accumulation_fusion:
        # the fused weight gradient tells DDP's hook "already in main_grad" from Python, which a graph replay
        # skips: the hook would then add the placeholder gradient too
        raise MegatronPluginConfigError(
            "gradient_accumulation_fusion", True,
            f"torch.compile mode {compile_kwargs.get('mode')!r} replays CUDA graphs, which the fused weight gradient "
            "does not support: set gradient_accumulation_fusion=False (or leave it unset), or use the default mode",
        )


def check_tp_comm_overlap(plugin: MegatronLMPlugin, device_type: str, compile_kwargs: Optional[dict],
                          fusion: bool) -> None:
    """Megatron's `tp_comm_overlap` (a TransformerConfig field, so it comes in other_megatron_args): sequence
    parallelism's all-gathers and reduce-scatters overlapped with the GEMMs next to them, through torch's
    symmetric-memory ops (layers/compiled_linear.py) where Megatron needs Transformer Engine's userbuffers. It runs
    where the linears are our ops: on CUDA, in compiled layers with the fused weight gradient. Anywhere else it
    would do nothing, so it is refused there. `fusion`: gradient_accumulation_fusion as resolved."""
    args = plugin.other_megatron_args
    value = args.get("tp_comm_overlap") if isinstance(args, dict) else None
    if not value:
        return
    setting = "other_megatron_args['tp_comm_overlap']"
    if value is not True:
        raise MegatronPluginConfigError(setting, value, "pass True or False")
    if device_type != "cuda":
        raise MegatronPluginConfigError(setting, True, "it overlaps NCCL collectives with GEMMs through CUDA's symmetric "
                                        "memory: remove it for a CPU run")
    if plugin.tp_degree < 2 or not plugin.sequence_parallelism:
        raise MegatronPluginConfigError(
            setting, True, f"it overlaps sequence parallelism's all-gathers and reduce-scatters (tp_degree="
            f"{plugin.tp_degree}, sequence_parallelism={plugin.sequence_parallelism}): set tp_degree >= 2 and "
            "sequence_parallelism=True, or remove it")
    if compile_kwargs is None or not fusion:
        raise MegatronPluginConfigError(
            setting, True, "it runs in compiled layers with the fused weight gradient: set torch_compile=True (or "
            "accelerate's dynamo_backend) in the default compile mode, with gradient_accumulation_fusion unset or "
            "True, or remove it")
    if plugin.fp8:
        raise MegatronPluginConfigError(setting, True, "the FP8 linears run their own GEMMs and collectives: leave fp8 "
                                        "unset with it, or remove it")
    # TE's userbuffers knobs (which GEMMs overlap, how they split, bulk overlaps): ours overlaps every SP gather and
    # reduce-scatter next to a GEMM and reads none of them, so one set away from its default would be ignored
    from megatron.core.model_parallel_config import ModelParallelConfig

    defaults = {f.name: f.default for f in dataclasses.fields(ModelParallelConfig)}
    for key in sorted(k for k in args if k.startswith("tp_comm_") and k != "tp_comm_overlap"):
        if key in defaults and args[key] != defaults[key]:
            raise MegatronPluginConfigError(
                f"other_megatron_args[{key!r}]", args[key],
                "a Transformer Engine userbuffers setting; tp_comm_overlap here overlaps every sequence-parallel "
                f"gather and reduce-scatter with its GEMM through torch's symmetric memory and reads no such "
                f"setting: remove it (its default is {defaults[key]!r})")


GRAPH_SETTING = "other_megatron_args['cuda_graph_scope']"  # how errors name the full-iteration graph
REMOVE_GRAPH = "remove cuda_graph_impl / cuda_graph_scope from other_megatron_args"


def full_iteration_graph(plugin: MegatronLMPlugin) -> Optional[int]:
    """The eager training steps before Megatron's full-iteration CUDA graph is captured (TransformerConfig's
    `cuda_graph_warmup_steps`, default 3), or None without the graph. Megatron-LM's names, in other_megatron_args:
    `cuda_graph_impl="local"` with `cuda_graph_scope="full_iteration"` (engine/full_graph.py). The other CUDA-graph
    scopes are megatron-core's per-layer graphs, made for its own layers: refused, with torch.compile's mode
    'reduce-overhead' named as ours."""
    args = plugin.other_megatron_args if isinstance(plugin.other_megatron_args, dict) else {}
    for old, new in (("enable_cuda_graph", "cuda_graph_impl='local'"), ("external_cuda_graph",
                                                                         "cuda_graph_impl='transformer_engine'")):
        if args.get(old):
            raise MegatronPluginConfigError(
                f"other_megatron_args[{old!r}]", args[old],
                f"deprecated in megatron-core (it means {new}): pass other_megatron_args={{'cuda_graph_impl': "
                "'local', 'cuda_graph_scope': 'full_iteration'}} for the whole training step as one CUDA graph")
    impl = args.get("cuda_graph_impl", "none")
    scope = args.get("cuda_graph_scope", "full")
    items = scope if isinstance(scope, (list, tuple)) else [scope]  # names, comma-joined names or CudaGraphScope
    scopes = [n for s in items for n in (s.name.split(",") if hasattr(s, "name") else str(s).split(","))]
    if impl in ("none", None):
        if "full_iteration" in scopes:  # megatron-core would ignore the scope: say so rather than train without
            raise MegatronPluginConfigError(
                "other_megatron_args['cuda_graph_scope']", scope,
                "takes effect with cuda_graph_impl='local': add other_megatron_args['cuda_graph_impl']='local' for "
                "the full-iteration CUDA graph, or remove cuda_graph_scope")
        return None
    per_layer = ("for CUDA graphs per layer use torch.compile's mode 'reduce-overhead' (accelerate's dynamo "
                 "config); for the whole training step pass cuda_graph_impl='local' with "
                 "cuda_graph_scope='full_iteration'")
    if impl != "local":
        raise MegatronPluginConfigError("other_megatron_args['cuda_graph_impl']", impl,
                                        f"'local' or 'none' here ('transformer_engine' graphs TE's layers): {per_layer}")
    if scopes != ["full_iteration"]:
        raise MegatronPluginConfigError(
            "other_megatron_args['cuda_graph_scope']", scope,
            f"with cuda_graph_impl='local' only 'full_iteration' runs here (megatron-core's per-layer graphs are "
            f"made for its own layers): {per_layer}")
    warmup = args.get("cuda_graph_warmup_steps", 3)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise MegatronPluginConfigError(
            "other_megatron_args['cuda_graph_warmup_steps']", warmup,
            "an int >= 1: the eager training steps before the capture (they compile the layers)")
    return warmup


def check_full_iteration_graph(plugin: MegatronLMPlugin, device_type: str, compile_kwargs: Optional[dict],
                               mixed_precision: str, moe: bool, encoder_family: Optional[str] = None) -> None:
    """Where the full-iteration CUDA graph runs: the CUDA engine without pipelining, context parallelism, MoE,
    fp16, recompute, BERT / T5 (`encoder_family`), per-token loss, tp_comm_overlap, the optimizer on the CPU or
    per-layer graphs (LoRA: engine/lora.check_lora_run; post-training steps: resolve.py). Each of those keeps state
    on the host that a replay would not update, or waits for the GPU inside the step, or is untested under a
    capture."""
    if full_iteration_graph(plugin) is None:
        return
    if device_type != "cuda":
        raise MegatronPluginConfigError(GRAPH_SETTING, "full_iteration",
                                        f"a CUDA graph needs the CUDA engine: {REMOVE_GRAPH} for a CPU run")
    refusals = [
        (plugin.pp_degree > 1, f"pp_degree={plugin.pp_degree}", "pipeline schedules' point-to-point sends are not "
         "tested under a capture: set pp_degree=1"),
        ((plugin.context_parallel_size or 1) > 1, f"context_parallel_size={plugin.context_parallel_size}",
         "context parallelism is not tested under a capture: set context_parallel_size=1"),
        (moe, "an MoE model", "the router's token counts are read by the host each step: train it without the graph"),
        (encoder_family is not None, f"the {encoder_family} family", "its train step is not tested under a capture "
         "(decoder-only models are): train it without the graph"),
        (mixed_precision == "fp16", "mixed_precision='fp16'", "fp16's loss scale is a new tensor after each change, "
         "which a replay would not read: use bf16"),
        (bool(plugin.calculate_per_token_loss), "calculate_per_token_loss=True", "megatron-core's finalize_model_grads "
         "reads the step's token count on the host: leave it off"),
        (bool((plugin.other_megatron_args or {}).get("tp_comm_overlap")), "other_megatron_args['tp_comm_overlap']",
         "its symmetric-memory workspace is not tested under a capture: remove it"),
        (plugin.recompute_granularity is not None, f"recompute_granularity={plugin.recompute_granularity!r}",
         "recomputation is not tested under a capture: turn it off"),
        (bool(plugin.optimizer_cpu_offload), "optimizer_cpu_offload=True", "the optimizer's copies to the CPU are not "
         "tested under a capture: keep the optimizer on the GPU"),
        (uses_cuda_graphs(compile_kwargs), f"torch.compile mode {(compile_kwargs or {}).get('mode')!r}",
         "that mode captures each layer's graph, which cannot run inside the step's: use the default mode"),
    ]
    for refused, what, fix in refusals:
        if refused:
            refuse_with_full_iteration_graph(plugin, what, fix)


def refuse_with_full_iteration_graph(plugin: MegatronLMPlugin, what: str, fix: str) -> None:
    """Raises, where the plugin asks for the full-iteration CUDA graph, that it does not run with `what`."""
    if full_iteration_graph(plugin) is not None:
        raise MegatronPluginConfigError(GRAPH_SETTING, "full_iteration", f"not with {what}: {fix}, or {REMOVE_GRAPH}")


def uses_cuda_graphs(compile_kwargs: Optional[dict]) -> bool:
    """Whether torch.compile with these arguments captures CUDA graphs (Inductor's cudagraph trees)."""
    if not compile_kwargs:
        return False
    options = compile_kwargs.get("options") or {}
    return compile_kwargs.get("mode") in ("reduce-overhead", "max-autotune") or bool(options.get("triton.cudagraphs"))
