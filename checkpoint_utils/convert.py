r"""Convert and reshape checkpoints between HF (safetensors / .bin) and Megatron (any TP/PP), tensor by
tensor, as a command and as functions.

    # HF -> Megatron, laid out for TP=2, PP=2 (accelerator.load_state reads it directly)
    python -m checkpoint_utils.convert --load_path gpt/hf --save_path gpt/megatron \
        --target_tensor_model_parallel_size 2 --target_pipeline_model_parallel_size 2
    # Megatron (any layout, e.g. from accelerator.save_state) -> HF sharded safetensors
    python -m checkpoint_utils.convert --convert_checkpoint_from_megatron_to_transformers \
        --load_path gpt/megatron --save_path gpt/hf2 --max_shard_size 200MB --tokenizer_name gpt/tokenizer
    # Megatron -> Megatron with another TP/PP (give a Megatron checkpoint as --load_path)
    python -m checkpoint_utils.convert --load_path gpt/megatron --save_path gpt/megatron_tp1_pp2 \
        --target_tensor_model_parallel_size 1 --target_pipeline_model_parallel_size 2

Peak host memory stays near one output shard plus one full tensor: HF safetensors are memory-mapped and
read per tensor, and each Megatron (TP, PP) file is built and written on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.plugin import MegatronLMPlugin

# torch, safetensors and megatron-core load inside the functions: `--help` should not wait for them
DTYPE_NAMES = ("fp32", "fp16", "bf16")


def is_megatron_checkpoint(path: str) -> bool:
    from megatron_plugin.engine.checkpointing.layout import is_checkpoint_dir

    return is_checkpoint_dir(path)


def _dtype(name: Optional[str]):
    if name is None:
        return None
    from megatron_plugin.engine.hf_io import DTYPES

    if name not in DTYPES:
        raise MegatronPluginConfigError("--target_params_dtype", name, f"use one of {sorted(DTYPES)}")
    return DTYPES[name]


def write_megatron(reader, save_path: str, tp: int = 1, pp: int = 1, dp: int = 1, params_dtype: str = "fp32",
                   make_vocab_size_divisible_by: int = 128, use_distributed_optimizer: bool = False,
                   overwrite: bool = False, print_structure: bool = False, progress: bool = True) -> str:
    """Write `reader`'s model (HFReader or MegatronReader) as a model-only Megatron checkpoint. A
    reshaped Megatron checkpoint keeps its iteration."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from megatron_plugin.engine.checkpointing.layout import checkpoint_meta, model_file, point_latest, write_meta
    from megatron_plugin.fs import file_checksum
    from megatron_plugin.models.convert import model_dims
    from megatron_plugin.models import check_model
    from megatron_plugin.models.mapping import StagePlan, hf_to_mcore

    from megatron_plugin.engine.hf_io import staged_output

    cfg, family = reader.config, reader.family
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    plugin.validate(world_size=tp * pp * dp)
    check_model(plugin, cfg)
    dtype = _dtype(params_dtype)
    variant = reader.variant
    rules = family.table(cfg, variant)
    num_layers = family.num_layers(cfg)
    missing = sorted(family.mapped_hf_names(cfg, variant) - set(reader.names))
    if missing:
        raise MegatronPluginConfigError("--load_path", getattr(reader, "path", reader), f"lacks tensors {missing[:5]}")
    dims = model_dims(family, cfg, make_vocab_size_divisible_by, tp)
    iteration = getattr(reader, "meta", {}).get("iteration", 0)
    tag = f"iter_{iteration:07d}"
    with staged_output(save_path, overwrite) as out:
        os.makedirs(os.path.join(out, tag, "model"))
        files = {}
        bar = tqdm(total=tp * pp, desc="megatron shards", disable=not progress)
        for pp_rank in range(pp):
            plan = StagePlan.for_rank(num_layers, pp, pp_rank)
            for t in range(tp):
                tensors = {name: x.to(dtype).contiguous() for name, x in hf_to_mcore(reader.get_slice, rules, dims, plan, tp, t)}
                file = model_file(os.path.join(out, tag), t, pp_rank)
                save_file(tensors, file)
                files[os.path.relpath(file, os.path.join(out, tag))] = file_checksum(file)
                if print_structure:
                    _print_file(file, tensors)
                del tensors
                bar.update(1)
        bar.close()
        write_meta(os.path.join(out, tag, "meta.json"), dict(checkpoint_meta(
            iteration=iteration, tp=tp, pp=pp, dp=dp, vpp=None, distributed_optimizer=use_distributed_optimizer,
            model_only=True, family=family.name, variant=variant,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by, hf_config=cfg.to_dict(),
        ), files=files))
        point_latest(out, tag)
    return save_path


def write_hf(reader: MegatronReader, save_path: str, max_shard_size: str = "10GB", params_dtype: Optional[str] = None,
             tokenizer_name: Optional[str] = None, overwrite: bool = False, print_structure: bool = False,
             progress: bool = True) -> str:
    """Write a Megatron checkpoint as an HF folder: sharded safetensors, config, tokenizer."""
    from tqdm.auto import tqdm

    from megatron_plugin.engine.hf_io import HFShardWriter, staged_output

    limit = max_shard_size
    dtype = _dtype(params_dtype)
    cfg, family = reader.config, reader.family
    variant = reader.variant
    strip = len(family.prefix(variant))
    if tokenizer_name is not None and not os.path.isdir(tokenizer_name):
        raise MegatronPluginConfigError("--tokenizer_name", tokenizer_name, "pass a local tokenizer folder")
    with staged_output(save_path, overwrite) as out:
        writer = HFShardWriter(out, limit, on_shard=_print_file if print_structure else None)
        for name in tqdm(reader.names, desc="HF tensors", disable=not progress):
            x = reader.get(name)
            writer.add(name[strip:], x.to(dtype) if dtype else x)
        writer.finish()
        cfg.architectures = [family.classes[variant]]
        cfg.save_pretrained(out)
        if tokenizer_name is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_name).save_pretrained(out)
    return save_path


def _print_file(file, tensors):
    print(f"== {os.path.basename(file)}")
    for name, x in tensors.items():
        print(f"   {name}: {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}")


def convert_hf_to_megatron(load_path: str, save_path: str, **kwargs) -> str:
    from megatron_plugin.engine.hf_io import HFReader

    return write_megatron(HFReader(load_path), save_path, **kwargs)


def reshape_megatron(load_path: str, save_path: str, **kwargs) -> str:
    from megatron_plugin.engine.hf_io import MegatronReader

    return write_megatron(MegatronReader(load_path), save_path, **kwargs)


def convert_megatron_to_hf(load_path: str, save_path: str, **kwargs) -> str:
    from megatron_plugin.engine.hf_io import MegatronReader

    return write_hf(MegatronReader(load_path), save_path, **kwargs)


def build_parser():
    intro, _, examples = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="megatron-convert-checkpoint", description=" ".join(intro.split()),
                                epilog="examples:\n" + examples.split("\n\nPeak")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--convert_checkpoint_from_megatron_to_transformers", action="store_true",
                   help="Megatron -> HF; without it: HF -> Megatron, or Megatron -> Megatron when --load_path is one")
    p.add_argument("--load_path", required=True)
    p.add_argument("--save_path", required=True)
    p.add_argument("--target_tensor_model_parallel_size", type=int, default=1)
    p.add_argument("--target_pipeline_model_parallel_size", type=int, default=1)
    p.add_argument("--target_data_parallel_size", type=int, default=1)
    p.add_argument("--target_params_dtype", default=None, choices=DTYPE_NAMES, help="default: as stored (fp32 for Megatron output)")
    p.add_argument("--make_vocab_size_divisible_by", type=int, default=128)
    p.add_argument("--use_distributed_optimizer", action="store_true")
    p.add_argument("--max_shard_size", default="10GB")
    p.add_argument("--tokenizer_name", default=None, help="a local tokenizer folder to copy into the HF output")
    p.add_argument("--print-checkpoint-structure", dest="print_checkpoint_structure", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --save_path")
    p.add_argument("--no_progress", action="store_true")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    common = dict(overwrite=a.overwrite, print_structure=a.print_checkpoint_structure, progress=not a.no_progress)
    try:
        if a.convert_checkpoint_from_megatron_to_transformers:
            convert_megatron_to_hf(a.load_path, a.save_path, max_shard_size=a.max_shard_size,
                                   params_dtype=a.target_params_dtype, tokenizer_name=a.tokenizer_name, **common)
        else:
            kwargs = dict(tp=a.target_tensor_model_parallel_size, pp=a.target_pipeline_model_parallel_size,
                          dp=a.target_data_parallel_size, params_dtype=a.target_params_dtype or "fp32",
                          make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                          use_distributed_optimizer=a.use_distributed_optimizer, **common)
            if is_megatron_checkpoint(a.load_path):
                reshape_megatron(a.load_path, a.save_path, **kwargs)
            else:
                convert_hf_to_megatron(a.load_path, a.save_path, **kwargs)
    except MegatronPluginConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.save_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
