"""The plugin's model settings (accelerate's and Megatron-LM's names), checked against the HF model and
turned into the TransformerConfig fields they set.

`check_model_fields` runs in `check_model`, at prepare, before any process group: a value the model
cannot honour is refused by name there. `config_fields` is what `build_transformer_config` applies.

- attention_dropout / hidden_dropout: None keeps the HF config's; a value replaces it in every layer
  (TransformerConfig's, which every slot reads: SDPA attention, residual and embedding dropout, T5's MLP).
- attention_softmax_in_fp32: every SDPA kernel (flash, memory-efficient, cuDNN, math) accumulates the
  softmax in fp32 whatever the input dtype, so True is what runs; False (a half-precision softmax, Megatron's
  unfused kernel) has no kernel here and is refused.
- attention_backend: Megatron-Core's names, each mapped to torch SDPA kernels (layers/attention.py's
  `SDPA_KERNELS`, read from the TransformerConfig): 'auto' lets torch pick; 'flash' its flash kernel;
  'fused' (TE's cuDNN fused attention) torch's cuDNN kernel, else its memory-efficient one; 'unfused' and
  'local' the math path. accelerate's True/False never picked a kernel (Megatron-LM read neither as a name):
  both are 'auto'.
- use_rotary_position_embeddings: fixed by the HF model's weights (rotary for the Llama family, learned for
  GPT-2 and BERT, relative for T5): None follows the model, a contradicting value is refused.
- seq_length / encoder_seq_length / decoder_seq_length: Megatron-LM's sequence lengths (`sequence_lengths`,
  given to train steps in megatron_args); batches still carry their own lengths.
- decoder_last_pipeline_num_layers: the last pipeline stage's layer count (mcore's
  num_layers_in_last_pipeline_stage); the other stages split the rest evenly (models/mapping.StagePlan).
- calculate_per_token_loss: mcore's flag of the same name (its DDP then sums gradients over data-parallel
  ranks and finalize_model_grads divides by the global token count); the train steps return
  (loss sum, token count, logs) as Megatron-LM's do.
- eod_mask_loss: causal LMs only, with an eos_token_id to find document ends by (train_steps/gpt.py).
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional

from megatron.core.transformer.enums import AttnBackend

from ..errors import MegatronPluginConfigError
from ..plugin import ATTENTION_BACKENDS

# TransformerConfig fields that lay out pipeline stages: only decoder_last_pipeline_num_layers has a mapping of
# HF layers to stages (StagePlan); the others, through other_megatron_args, would put weights on wrong stages
PIPELINE_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "pipeline_model_parallel_layout",
                         "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def attention_backend_name(value, setting: str = "attention_backend") -> str:
    """The mcore backend name of a plugin / other_megatron_args value (True and False are accelerate's bool)."""
    if value is None or isinstance(value, bool):
        return "auto"
    if isinstance(value, AttnBackend):
        return value.name
    name = str(value).strip().lower()
    if name.startswith("attnbackend."):
        name = name[len("attnbackend."):]
    if name not in ATTENTION_BACKENDS:
        raise MegatronPluginConfigError(
            setting, value,
            f"use one of {ATTENTION_BACKENDS} (Megatron-LM's --attention-backend), or True/False (accelerate's; "
            "both leave the kernel to torch, as 'auto')",
        )
    return name


def effective_attention_backend(plugin) -> str:
    """The plugin's backend, or other_megatron_args' when the plugin leaves it to torch."""
    name = attention_backend_name(getattr(plugin, "attention_backend", None))
    other = (getattr(plugin, "other_megatron_args", None) or {}).get("attention_backend")
    if name == "auto" and other is not None:
        return attention_backend_name(other, "other_megatron_args['attention_backend']")
    return name


def eod_token_ids(hf_config) -> List[int]:
    """The HF config's end-of-sequence ids (a config may list several, e.g. Llama 3's)."""
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _explicit(plugin, name):
    """The plugin's value of a TransformerConfig field, else other_megatron_args' (None: neither sets it)."""
    value = getattr(plugin, name, None)
    if value is None:
        value = (getattr(plugin, "other_megatron_args", None) or {}).get(name)
    return value


def config_fields(plugin) -> Dict[str, Any]:
    """The TransformerConfig fields the plugin's model and loss settings set (checked by `check_model_fields`)."""
    fields: Dict[str, Any] = dict(
        attention_backend=AttnBackend[effective_attention_backend(plugin)],
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=bool(getattr(plugin, "calculate_per_token_loss", False)),
    )
    for name in ("attention_dropout", "hidden_dropout"):
        value = _explicit(plugin, name)
        if value is not None:
            fields[name] = float(value)
    last = getattr(plugin, "decoder_last_pipeline_num_layers", None)
    if last is not None and plugin.pp_degree > 1:
        fields["num_layers_in_last_pipeline_stage"] = int(last)
    return fields


def check_model_fields(plugin, hf_config, family) -> None:
    """Refuse, by name, a model or loss setting the HF model cannot honour. No collectives."""
    architecture = family.transformer_config(hf_config)
    _check_against_other_args(plugin)
    if getattr(plugin, "attention_softmax_in_fp32", True) is False:
        raise MegatronPluginConfigError(
            "attention_softmax_in_fp32", False,
            "attention runs on torch's SDPA kernels, which all accumulate the softmax in fp32 whatever the input "
            "dtype; there is no half-precision softmax to switch to: leave it True (the default)",
        )
    _check_attention_backend(plugin, family, architecture)
    _check_rotary(plugin, hf_config, family)
    _check_eod_mask_loss(plugin, hf_config, family)
    sequence_lengths(plugin, family, hf_config)
    check_uneven_pipeline(plugin, architecture["num_layers"])


def _check_against_other_args(plugin) -> None:
    """A plugin field and an other_megatron_args key for the same TransformerConfig field must agree."""
    other = getattr(plugin, "other_megatron_args", None) or {}
    if not isinstance(other, dict):
        return  # transformer_config_overrides names that error
    for name in ("attention_dropout", "hidden_dropout"):
        if name in other and (isinstance(other[name], bool) or not isinstance(other[name], numbers.Real)
                              or not 0 <= other[name] < 1):
            raise MegatronPluginConfigError(f"other_megatron_args[{name!r}]", other[name], "use a fraction in [0, 1)")
        mine = getattr(plugin, name, None)
        if mine is not None and name in other and float(other[name]) != float(mine):
            raise MegatronPluginConfigError(
                f"other_megatron_args[{name!r}]", other[name],
                f"the plugin's {name}={mine} says otherwise: set it in one place",
            )
    if "attention_backend" in other:
        mine = attention_backend_name(getattr(plugin, "attention_backend", None))
        theirs = attention_backend_name(other["attention_backend"], "other_megatron_args['attention_backend']")
        if mine != "auto" and theirs != mine:
            raise MegatronPluginConfigError(
                "other_megatron_args['attention_backend']", other["attention_backend"],
                f"the plugin's attention_backend={mine!r} says otherwise: set it in one place",
            )
    if "attention_softmax_in_fp32" in other and other["attention_softmax_in_fp32"] is not True:
        raise MegatronPluginConfigError(
            "other_megatron_args['attention_softmax_in_fp32']", other["attention_softmax_in_fp32"],
            "SDPA's kernels compute the softmax in fp32 (see attention_softmax_in_fp32): remove the key",
        )
    if "calculate_per_token_loss" in other and bool(other["calculate_per_token_loss"]) != bool(
            getattr(plugin, "calculate_per_token_loss", False)):
        raise MegatronPluginConfigError(
            "other_megatron_args['calculate_per_token_loss']", other["calculate_per_token_loss"],
            "the train step's loss must agree with the gradient scaling: set "
            "MegatronLMPlugin(calculate_per_token_loss=...) instead, and remove the key",
        )
    last = getattr(plugin, "decoder_last_pipeline_num_layers", None)
    if "num_layers_in_last_pipeline_stage" in other and other["num_layers_in_last_pipeline_stage"] != last:
        raise MegatronPluginConfigError(
            "other_megatron_args['num_layers_in_last_pipeline_stage']", other["num_layers_in_last_pipeline_stage"],
            "the HF layers are placed on stages by the plugin's setting: use "
            "MegatronLMPlugin(decoder_last_pipeline_num_layers=...) instead, and remove the key",
        )
    for name in PIPELINE_SPLIT_FIELDS:
        if name in other and other[name] not in (None, False):
            raise MegatronPluginConfigError(
                f"other_megatron_args[{name!r}]", other[name],
                "only an even split, or a last stage of its own size (decoder_last_pipeline_num_layers), maps the HF "
                "layers onto pipeline stages: remove the key",
            )


def _check_attention_backend(plugin, family, architecture) -> None:
    import torch

    name = effective_attention_backend(plugin)
    if name == "auto":
        return
    if name == "fused" and not torch.cuda.is_available():
        raise MegatronPluginConfigError(
            "attention_backend", "fused",
            "TE's fused attention maps to torch's cuDNN / memory-efficient SDPA kernels, which run on CUDA only: on "
            "CPU use 'auto', 'flash' (torch's CPU flash kernel) or 'unfused'",
        )
    if name == "flash" and family.name in ("t5", "mt5"):
        raise MegatronPluginConfigError(
            "attention_backend", "flash",
            "T5 adds relative position biases to every attention's scores, which flash kernels cannot take: use "
            "'auto', 'fused' or 'unfused'",
        )
    dropout = _explicit(plugin, "attention_dropout")
    dropout = architecture.get("attention_dropout", 0.0) if dropout is None else dropout
    if name == "flash" and dropout and not torch.cuda.is_available():
        raise MegatronPluginConfigError(
            "attention_backend", "flash",
            f"torch's CPU flash kernel has no dropout, and attention dropout is {dropout}: on CPU use 'auto' or "
            "'unfused', or set attention_dropout=0.0",
        )


def _check_rotary(plugin, hf_config, family) -> None:
    wanted = getattr(plugin, "use_rotary_position_embeddings", None)
    if wanted is None or bool(wanted) == family.rotary:
        return
    has = "rotary" if family.rotary else ("relative position biases" if family.name in ("t5", "mt5")
                                          else "learned position embeddings")
    raise MegatronPluginConfigError(
        "use_rotary_position_embeddings", wanted,
        f"the {family.name} model uses {has}; the HF model's position embeddings are fixed by its weights: "
        "leave it unset (None)",
    )


def _check_eod_mask_loss(plugin, hf_config, family) -> None:
    if not getattr(plugin, "eod_mask_loss", False):
        return
    if family.train_step != "GPTTrainStep":
        raise MegatronPluginConfigError(
            "eod_mask_loss", True,
            f"it masks the loss of causal LMs (Megatron's GPT); a {family.name} model has no document ends in its "
            "loss: set it to False",
        )
    if not eod_token_ids(hf_config):
        raise MegatronPluginConfigError(
            "eod_mask_loss", True,
            "the model config has no eos_token_id to find document ends by: set config.eos_token_id to the "
            "end-of-document id before prepare, or set eod_mask_loss=False",
        )


def sequence_lengths(plugin, family, hf_config) -> Dict[str, Optional[int]]:
    """Megatron-LM's seq_length, encoder_seq_length and decoder_seq_length for the train steps' megatron_args.

    Decoder-only and encoder-only models have one length: seq_length, which encoder_seq_length names too
    (Megatron-LM sets each from the other), and which accelerate's GPT-2 and Llama parsers also read from
    decoder_seq_length; set in several, they must agree. T5 has an encoder length (seq_length or
    encoder_seq_length) and a decoder length (decoder_seq_length). Unset lengths are the model's positions.
    A length over the model's learned positions is refused."""
    default = family.max_positions(hf_config)
    limit = family.position_limit(hf_config)
    seq, enc, dec = (getattr(plugin, n, None) for n in ("seq_length", "encoder_seq_length", "decoder_seq_length"))
    seq2seq = family.name in ("t5", "mt5")
    if not seq2seq and dec is not None and family.train_step != "GPTTrainStep":
        raise MegatronPluginConfigError(
            "decoder_seq_length", dec, f"a {family.name} model has no decoder: use seq_length (or encoder_seq_length)",
        )
    named = {"seq_length": seq, "encoder_seq_length": enc}
    if not seq2seq:
        named["decoder_seq_length"] = dec
    given = {k: v for k, v in named.items() if v is not None}
    if len(set(given.values())) > 1:
        raise MegatronPluginConfigError(
            " / ".join(given), tuple(given.values()),
            "they name the same sequence length (Megatron-LM's seq_length is its encoder_seq_length): set one, "
            "or give them the same value",
        )
    length = next(iter(given.values()), default)
    out = {"seq_length": length, "encoder_seq_length": length, "decoder_seq_length": None}
    if seq2seq:
        out["decoder_seq_length"] = default if dec is None else dec
    if limit is not None:
        for name in ("seq_length", "decoder_seq_length"):
            value = out[name]
            if value is not None and value > limit:
                setting = name if name == "decoder_seq_length" else next(iter(given), "seq_length")
                raise MegatronPluginConfigError(
                    setting, value, f"the model has {limit} positions: use at most {limit}",
                )
    return out


def check_uneven_pipeline(plugin, num_layers: int) -> None:
    """decoder_last_pipeline_num_layers against the model: Megatron's rule (the other stages split the rest
    evenly, at least one layer each), with pipeline stages, without virtual ones."""
    last = getattr(plugin, "decoder_last_pipeline_num_layers", None)
    if last is None:
        return
    pp = plugin.pp_degree
    if pp == 1:
        raise MegatronPluginConfigError(
            "decoder_last_pipeline_num_layers", last,
            "it sizes the last of several pipeline stages: set pp_degree > 1, or leave it unset",
        )
    if plugin.num_layers_per_virtual_pipeline_stage is not None:
        raise MegatronPluginConfigError(
            "decoder_last_pipeline_num_layers", last,
            "an uneven last stage is not mapped with virtual pipeline stages (the interleaved layout): leave "
            "num_layers_per_virtual_pipeline_stage unset, or this unset for an even split",
        )
    rest = num_layers - last
    if rest < pp - 1 or rest % (pp - 1):
        raise MegatronPluginConfigError(
            "decoder_last_pipeline_num_layers", last,
            f"the other {pp - 1} pipeline stage(s) must split the remaining {num_layers} - {last} = {rest} layers "
            f"evenly, at least one each (Megatron's rule): choose a value that leaves a multiple of {pp - 1}",
        )
