"""What a Megatron-LM checkpoint says besides its tensors: the `args` Namespace Megatron-LM's loaders
read (layout, model shape, vocabulary padding), and this package's own `megatron_plugin` entry that names
the HF model, so that a checkpoint converts back to HF without flags. A checkpoint without the entry
(written by Megatron-LM itself) needs the HF config given (`--hf_config`)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron_plugin.engine.checkpointing.megatron_lm_state import ENTRY, moe_args
from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.models import get_family
from megatron_plugin.models.gpt import padded_vocab_size

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def plugin_entry(family, variant: str, hf_config, *, make_vocab_size_divisible_by: int, tp: int, pp: int, dp: int,
                 distributed_optimizer: bool, ep: int = 1, etp: Optional[int] = None) -> dict:
    """The entry save_state writes (engine/checkpointing/megatron_lm_state.plugin_entry), for a model-only
    checkpoint: no engine, optimizer or registered objects."""
    return dict(family=family.name, variant=variant, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                hf_config=hf_config.to_dict(), tp=tp, pp=pp, dp=dp, vpp=None, world_size=tp * pp * dp, engine=None,
                distributed_optimizer=distributed_optimizer, custom_objects=0, optimizer=None, ep=ep, etp=etp or tp)


def megatron_lm_args(family, variant: str, hf_config, *, tp: int, pp: int, dp: int, params_dtype: str,
                     make_vocab_size_divisible_by: int, use_distributed_optimizer: bool, iteration: int,
                     ckpt_format: str, ep: int = 1, etp: Optional[int] = None) -> argparse.Namespace:
    """The `args` of a checkpoint as Megatron-LM's `save_checkpoint` stores them (the fields its loaders
    and converters read, as save_state's `megatron_lm_state.megatron_args` writes them), for the layout the
    checkpoint is meant for."""
    tc = family.transformer_config(hf_config)
    heads = tc["num_attention_heads"]
    groups = tc.get("num_query_groups") or heads
    kwargs = family.model_kwargs(hf_config)
    position = "rope" if family.rotary else kwargs.get("position_embedding_type", "learned_absolute")
    args = dict(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
        world_size=tp * pp * dp, virtual_pipeline_model_parallel_size=None,
        num_layers=tc["num_layers"], hidden_size=tc["hidden_size"], ffn_hidden_size=tc.get("ffn_hidden_size"),
        num_attention_heads=heads, num_query_groups=groups, group_query_attention=groups != heads,
        kv_channels=tc.get("kv_channels") or tc["hidden_size"] // heads,
        seq_length=family.max_positions(hf_config), max_position_embeddings=family.max_positions(hf_config),
        vocab_size=hf_config.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(hf_config.vocab_size, make_vocab_size_divisible_by, tp),
        normalization=tc.get("normalization", "LayerNorm"), norm_epsilon=tc.get("layernorm_epsilon"),
        swiglu=bool(tc.get("gated_linear_unit")) and tc.get("activation_func") is F.silu, squared_relu=False,
        add_bias_linear=tc.get("add_bias_linear", True), add_qkv_bias=tc.get("add_qkv_bias", False),
        qk_layernorm=bool(tc.get("qk_layernorm")), apply_layernorm_1p=False, position_embedding_type=position,
        add_position_embedding=position == "learned_absolute", use_rotary_position_embeddings=family.rotary,
        rotary_base=getattr(hf_config, "rope_theta", 10000), rotary_percent=1.0, rotary_interleaved=False,
        untie_embeddings_and_output_weights=not family.tied_embeddings(hf_config),
        hidden_dropout=tc.get("hidden_dropout"), attention_dropout=tc.get("attention_dropout"),
        init_method_std=tc.get("init_method_std"), sequence_parallel=False, context_parallel_size=1,
        **moe_args(tc.get, ep, etp or tp),
        fp16=params_dtype == "fp16", bf16=params_dtype == "bf16", params_dtype=DTYPES[params_dtype],
        use_distributed_optimizer=use_distributed_optimizer, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format == "torch_dist", transformer_impl="local",
        iteration=iteration, consumed_train_samples=0, consumed_valid_samples=0, skipped_train_samples=0,
        no_save_optim=True, no_save_rng=True,
    )
    if hasattr(hf_config, "num_decoder_layers"):  # T5: Megatron-LM's encoder/decoder depth
        args.update(encoder_num_layers=tc["num_layers"], decoder_num_layers=hf_config.num_decoder_layers)
    return argparse.Namespace(**args)


def read_hf_config_dir(path: str):
    from megatron_plugin.engine.hf_io import hf_config_from_dict

    cfg = os.path.join(path or "", "config.json")
    if not path or not os.path.exists(cfg):
        raise MegatronPluginConfigError("--hf_config", path, "pass a local folder with the HF model's config.json")
    with open(cfg) as f:
        return hf_config_from_dict(json.load(f))


def model_of(common: dict, hf_config_dir: Optional[str], where: str) -> Tuple[object, object, str, int]:
    """(HF config, family, variant, make_vocab_size_divisible_by) of a Megatron-LM checkpoint, from its
    `megatron_plugin` entry, or from `--hf_config` (which wins when given: the user knows best which HF
    model a foreign checkpoint is)."""
    from megatron_plugin.engine.hf_io import hf_config_from_dict

    entry = common.get(ENTRY) if isinstance(common, dict) else None
    args = common.get("args") if isinstance(common, dict) else None
    if hf_config_dir is not None:
        config = read_hf_config_dir(hf_config_dir)
    elif isinstance(entry, dict) and "hf_config" in entry:
        config = hf_config_from_dict(entry["hf_config"])
    else:
        raise MegatronPluginConfigError(
            "--hf_config", None, f"{where} does not say which HF model it holds (no '{ENTRY}' entry: written by "
            "Megatron-LM?): pass --hf_config <local folder with the model's config.json>")
    family = get_family(config)
    if isinstance(entry, dict) and hf_config_dir is None:
        variant = entry.get("variant")
    else:
        archs = getattr(config, "architectures", None) or [None]
        variant = family.variant_of_class(archs[0])
    divisible = (entry or {}).get("make_vocab_size_divisible_by") or getattr(args, "make_vocab_size_divisible_by", 128)
    return config, family, variant, int(divisible)
