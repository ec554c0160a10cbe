r"""Convert and reshape checkpoints between HF (safetensors / .bin) and Megatron (Megatron-LM's formats or
this package's), at any TP/PP, tensor by tensor, as a command and as functions.

Megatron formats (each one read and written):
- `torch_dist` (default): Megatron-LM's layout (`latest_checkpointed_iteration.txt`, `iter_N/` or `release/`)
  with megatron-core's dist_checkpointing files; layout-free, any TP/PP loads it.
- `torch`: Megatron-LM's legacy layout, `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt` per (TP, PP) rank.
- `megatron_plugin`: this package's own, safetensors per (TP, PP) rank (an MoE model's experts per expert
  TP x EP x PP rank).

MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) convert at any `--target_expert_model_parallel_size` (EP) and
`--target_expert_tensor_parallel_size`; torch_dist is layout-free (EP is recorded in its args), the legacy
format writes Megatron-LM's `mp_rank_TT[_PPP]_EEE` folders when EP > 1.

Megatron-LM, NeMo, Megatron-Bridge and verl read the first two; `accelerator.load_state` reads all three.

Examples:
    # HF -> Megatron-LM torch_dist, for TP=2, PP=2 (accelerator.load_state and Megatron-LM read it)
    python -m checkpoint_utils.convert --load_path gpt/hf --save_path gpt/megatron \
        --target_tensor_model_parallel_size 2 --target_pipeline_model_parallel_size 2
    # HF -> Megatron-LM's legacy per-rank files
    python -m checkpoint_utils.convert --load_path gpt/hf --save_path gpt/megatron_legacy --checkpoint_format torch \
        --target_tensor_model_parallel_size 2 --target_params_dtype bf16 --print-checkpoint-structure
    # Megatron (any format and layout, e.g. from accelerator.save_state) -> HF sharded safetensors
    python -m checkpoint_utils.convert --convert_checkpoint_from_megatron_to_transformers \
        --load_path gpt/megatron --save_path gpt/hf2 --max_shard_size 200MB --tokenizer_name gpt/tokenizer
    # a checkpoint Megatron-LM wrote (it does not name the HF model): give the HF config folder
    python -m checkpoint_utils.convert --convert_checkpoint_from_megatron_to_transformers \
        --load_path gpt/iter_0005000 --save_path gpt/hf3 --hf_config gpt/hf
    # an MoE model for EP=2 in Megatron-LM's legacy per-rank files (mp_rank_TT_EEE/)
    python -m checkpoint_utils.convert --load_path mixtral/hf --save_path mixtral/megatron --checkpoint_format torch \
        --target_tensor_model_parallel_size 2 --target_expert_model_parallel_size 2
    # Megatron -> Megatron with another TP/PP or format (give a Megatron checkpoint as --load_path)
    python -m checkpoint_utils.convert --load_path gpt/megatron --save_path gpt/megatron_tp1_pp2 \
        --target_tensor_model_parallel_size 1 --target_pipeline_model_parallel_size 2 --checkpoint_format torch

Peak host memory stays near one output shard plus one full tensor for the per-rank formats: HF
safetensors are memory-mapped and read per tensor, and each Megatron (TP, PP) file is built and written
on its own. A torch_dist checkpoint is written from the whole model in one process (as Megatron-LM's
converters do) and read one key (one weight of every layer) at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.plugin import MegatronLMPlugin

# torch, safetensors and megatron-core load inside the functions: `--help` should not wait for them
DTYPE_NAMES = ("fp32", "fp16", "bf16")


def is_megatron_checkpoint(path: str) -> bool:
    """Whether `path` holds a Megatron checkpoint of any of the three formats."""
    from .megatron_lm_layout import is_megatron_checkpoint as looks_megatron

    return looks_megatron(path)


def _dtype(name: Optional[str]):
    if name is None:
        return None
    from megatron_plugin.engine.hf_io import DTYPES

    if name not in DTYPES:
        raise MegatronPluginConfigError("--target_params_dtype", name, f"use one of {sorted(DTYPES)}")
    return DTYPES[name]


def expert_layout(family, cfg, *, tp: int, pp: int, dp: Optional[int], ep: int, etp: Optional[int],
                  checkpoint_format: str):
    """(dp, etp) of a target layout with `ep` expert-parallel ranks, checked as Megatron-Core checks it: the
    experts split evenly over EP, the world of TP x PP x DP ranks split evenly by expert TP x EP x PP. DP
    only names the world in the checkpoint's args; unset, the smallest that fits."""
    experts = family.num_experts(cfg)
    etp = tp if etp is None else etp
    if ep < 1 or etp < 1:
        raise MegatronPluginConfigError(
            "--target_expert_model_parallel_size" if ep < 1 else "--target_expert_tensor_parallel_size",
            ep if ep < 1 else etp, "use a positive size")
    if not experts and (ep > 1 or etp != tp):
        raise MegatronPluginConfigError(
            "--target_expert_model_parallel_size" if ep > 1 else "--target_expert_tensor_parallel_size",
            ep if ep > 1 else etp, f"the {family.name} model has no experts: leave the expert sizes unset")
    if experts and experts % ep:
        raise MegatronPluginConfigError(
            "--target_expert_model_parallel_size", ep,
            f"the model's {experts} experts must split evenly over expert-parallel ranks: use a divisor of {experts}")
    width = family.transformer_config(cfg).get("moe_ffn_hidden_size") if experts else None
    if width and width % etp:
        raise MegatronPluginConfigError(
            "--target_expert_tensor_parallel_size", etp,
            f"the experts' MLP width {width} must split evenly over expert tensor-parallel ranks: use a divisor of {width}")
    if experts and checkpoint_format == "torch" and etp != tp:
        raise MegatronPluginConfigError(
            "--target_expert_tensor_parallel_size", etp,
            "Megatron-LM's legacy torch files name a rank by its dense TP rank only: use the torch_dist or "
            f"megatron_plugin format for an expert TP other than the TP ({tp})")
    if dp is None:
        dp = next(d for d in range(1, etp * ep * pp + 1) if (tp * pp * d) % (etp * ep * pp) == 0)
    if (tp * pp * dp) % (etp * ep * pp):
        raise MegatronPluginConfigError(
            "--target_data_parallel_size", dp,
            f"Megatron-Core lays expert TP x EP x PP = {etp} x {ep} x {pp} over the world of TP x PP x DP = "
            f"{tp} x {pp} x {dp} ranks, which it must divide: use a DP that makes it so")
    return dp, etp


def write_megatron(reader, save_path: str, tp: int = 1, pp: int = 1, dp: Optional[int] = None, params_dtype: str = "fp32",
                   make_vocab_size_divisible_by: int = 128, use_distributed_optimizer: bool = False,
                   checkpoint_format: str = "torch_dist", overwrite: bool = False, print_structure: bool = False,
                   progress: bool = True, release: bool = True, ep: int = 1, etp: Optional[int] = None) -> str:
    """Write `reader`'s model (an HF folder's or a Megatron checkpoint's) as a model-only Megatron checkpoint
    in `checkpoint_format`, laid out (and its vocabulary padded) for TP x PP x DP ranks, an MoE model's
    experts over `ep` expert-parallel ranks split over `etp` expert tensor-parallel ranks (default: TP). A
    reshaped Megatron checkpoint keeps its iteration. An HF model is written as Megatron-LM's `release/`
    checkpoint, or with `release=False` as `iter_0000000/` with a tracker holding 0 (accelerate's example
    asserts that)."""
    from megatron_plugin.models import check_model

    from .megatron_lm_layout import FORMATS

    if checkpoint_format not in FORMATS:
        raise MegatronPluginConfigError("--checkpoint_format", checkpoint_format, f"use one of {list(FORMATS)}")
    cfg, family = reader.config, reader.family
    dp, etp = expert_layout(family, cfg, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, checkpoint_format=checkpoint_format)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    plugin.validate(world_size=tp * pp * dp)
    check_model(plugin, cfg)
    _dtype(params_dtype)
    missing = sorted(family.mapped_hf_names(cfg, reader.variant) - set(reader.names))
    if missing:
        raise MegatronPluginConfigError("--load_path", getattr(reader, "path", reader), f"lacks tensors {missing[:5]}")
    settings = dict(tp=tp, pp=pp, dp=dp, params_dtype=params_dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                    use_distributed_optimizer=use_distributed_optimizer, overwrite=overwrite,
                    print_structure=print_structure, progress=progress, ep=ep, etp=etp)
    with _process_group_for(reader, checkpoint_format):
        if checkpoint_format == "megatron_plugin":
            return _write_native(reader, save_path, **settings)
        return _write_megatron_lm(reader, save_path, checkpoint_format, release=release, **settings)


def _write_megatron_lm(reader, save_path: str, checkpoint_format: str, *, tp, pp, dp, params_dtype,
                       make_vocab_size_divisible_by, use_distributed_optimizer, overwrite, print_structure,
                       progress, release: bool = True, ep: int = 1, etp: Optional[int] = None) -> str:
    """Megatron-LM's layout: the tracker file and one iteration's folder, torch_dist or legacy."""
    from tqdm.auto import tqdm

    from megatron_plugin.engine.hf_io import staged_output
    from megatron_plugin.models.convert import model_dims

    from . import legacy, torch_dist
    from .megatron_lm_args import megatron_lm_args, plugin_entry
    from .megatron_lm_layout import seal, tag_for, write_tracker

    cfg, family, variant = reader.config, reader.family, reader.variant
    iteration = getattr(reader, "meta", {}).get("iteration", 0)
    args = megatron_lm_args(family, variant, cfg, tp=tp, pp=pp, dp=dp, params_dtype=params_dtype,
                            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                            use_distributed_optimizer=use_distributed_optimizer, iteration=iteration,
                            ckpt_format=checkpoint_format, ep=ep, etp=etp)
    entry = plugin_entry(family, variant, cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp=tp, pp=pp,
                         dp=dp, distributed_optimizer=use_distributed_optimizer, ep=ep, etp=etp)
    dtype = _dtype(params_dtype)
    with staged_output(save_path, overwrite) as out:
        ckpt = os.path.join(out, tag_for(iteration, release))
        if checkpoint_format == "torch_dist":
            torch_dist.write(reader, ckpt, tp=tp, params_dtype=dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                             iteration=iteration, args=args, entry=entry, distributed_optimizer=use_distributed_optimizer,
                             print_structure=print_structure)
        else:
            bar = tqdm(total=tp * pp * ep, desc="megatron shards", disable=not progress)
            legacy.write(reader, ckpt, tp=tp, pp=pp, ep=ep, dims=model_dims(family, cfg, make_vocab_size_divisible_by, tp),
                         params_dtype=dtype, iteration=iteration, args=args, entry=entry,
                         on_file=(lambda f, t: _print_file(f, t, os.path.relpath(f, out))) if print_structure else None,
                         progress=lambda: bar.update(1))
            bar.close()
        seal(ckpt)
        write_tracker(out, iteration, release)
    return save_path


def _write_native(reader, save_path: str, *, tp, pp, dp, params_dtype, make_vocab_size_divisible_by,
                  use_distributed_optimizer, overwrite, print_structure, progress, ep: int = 1,
                  etp: Optional[int] = None) -> str:
    """This package's own format (`megatron_plugin/1`): safetensors per (TP, PP) rank, an MoE model's routed
    experts per (expert TP, EP, PP) rank, and meta.json."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from megatron_plugin.engine.checkpointing.layout import (checkpoint_meta, expert_file, model_file, point_latest,
                                                             write_meta)
    from megatron_plugin.engine.hf_io import staged_output
    from megatron_plugin.fs import file_checksum
    from megatron_plugin.models.convert import model_dims
    from megatron_plugin.models.mapping import StagePlan, expand, read_shard

    cfg, family, variant = reader.config, reader.family, reader.variant
    dtype = _dtype(params_dtype)
    rules = family.table(cfg, variant)
    num_layers = family.num_layers(cfg)
    dims = model_dims(family, cfg, make_vocab_size_divisible_by, tp)
    iteration = getattr(reader, "meta", {}).get("iteration", 0)
    has_experts = bool(family.num_experts(cfg))
    etp = etp or tp
    tag = f"iter_{iteration:07d}"

    def write(file, tensors):
        save_file(tensors, file)
        files[os.path.relpath(file, os.path.join(out, tag))] = file_checksum(file)
        if print_structure:
            _print_file(file, tensors)

    def tensors_of(plan, experts: bool, size: int, rank: int):
        return {name: read_shard(reader.get_slice, rule, hf_names, dims, size, rank).to(dtype).contiguous()
                for rule, hf_names, name in expand([r for r in rules if r.per_expert == experts], plan)}

    with staged_output(save_path, overwrite) as out:
        os.makedirs(os.path.join(out, tag, "model"))
        files = {}
        bar = tqdm(total=pp * (tp + (etp * ep if has_experts else 0)), desc="megatron shards", disable=not progress)
        for pp_rank in range(pp):
            stage = StagePlan.for_rank(num_layers, pp, pp_rank)
            for t in range(tp):
                write(model_file(os.path.join(out, tag), t, pp_rank), tensors_of(stage, False, tp, t))
                bar.update(1)
            for e in range(ep if has_experts else 0):
                plan = family.plan_with_experts(cfg, stage, ep, e)
                for t in range(etp):
                    write(expert_file(os.path.join(out, tag), t, e, pp_rank), tensors_of(plan, True, etp, t))
                    bar.update(1)
        bar.close()
        write_meta(os.path.join(out, tag, "meta.json"), dict(checkpoint_meta(
            iteration=iteration, tp=tp, pp=pp, dp=dp, vpp=None, distributed_optimizer=use_distributed_optimizer,
            model_only=True, family=family.name, variant=variant,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by, hf_config=cfg.to_dict(),
            **(dict(ep=ep, etp=etp) if has_experts else {}),
        ), files=files))
        point_latest(out, tag)
    return save_path


def write_hf(reader, save_path: str, max_shard_size: str = "10GB", params_dtype: Optional[str] = None,
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
    with staged_output(save_path, overwrite) as out, _process_group_for(reader):
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


def _print_file(file, tensors, label=None):
    print(f"== {label or os.path.basename(file)}")
    for name, x in tensors.items():
        print(f"   {name}: {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}")


def _open_megatron(load_path: str, hf_config: Optional[str] = None):
    """A reader of the Megatron checkpoint at `load_path`, whichever its format (torch_dist readers need
    `process.one_process` around their use)."""
    from megatron_plugin.engine.hf_io import MegatronReader

    from .megatron_lm_layout import locate

    fmt, ckpt = locate(load_path)
    if fmt == "megatron_plugin":
        return MegatronReader(ckpt)
    if fmt == "torch_dist":
        from .torch_dist import TorchDistReader

        return TorchDistReader(ckpt, hf_config)
    from .legacy import LegacyReader

    return LegacyReader(ckpt, hf_config)


def _process_group_for(reader, checkpoint_format: Optional[str] = None):
    """megatron-core's dist_checkpointing (torch_dist in or out) wants a process group; the other formats
    are plain files. Entered after every check of the input, so bad input starts nothing."""
    from contextlib import nullcontext

    from .torch_dist import TorchDistReader

    if isinstance(reader, TorchDistReader) or checkpoint_format == "torch_dist":
        from .process import one_process

        return one_process()
    return nullcontext()


def convert_hf_to_megatron(load_path: str, save_path: str, checkpoint_format: str = "torch_dist", **kwargs) -> str:
    """HF folder -> Megatron checkpoint (`checkpoint_format`: torch_dist, torch or megatron_plugin)."""
    from megatron_plugin.engine.hf_io import HFReader

    return write_megatron(HFReader(load_path), save_path, checkpoint_format=checkpoint_format, **kwargs)


def reshape_megatron(load_path: str, save_path: str, checkpoint_format: str = "torch_dist",
                     hf_config: Optional[str] = None, **kwargs) -> str:
    """Megatron checkpoint (any format and layout) -> Megatron checkpoint for another layout or format."""
    return write_megatron(_open_megatron(load_path, hf_config), save_path, checkpoint_format=checkpoint_format, **kwargs)


def convert_megatron_to_hf(load_path: str, save_path: str, hf_config: Optional[str] = None, **kwargs) -> str:
    """Megatron checkpoint (any format and layout) -> HF folder, vocabulary padding removed. `hf_config`:
    a local HF config folder, for checkpoints that do not name their model (Megatron-LM's own)."""
    return write_hf(_open_megatron(load_path, hf_config), save_path, **kwargs)


def build_parser():
    intro, _, examples = __doc__.partition("\n\n")
    p = argparse.ArgumentParser(prog="megatron-convert-checkpoint", description=" ".join(intro.split()),
                                epilog=examples.split("\n\nPeak")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--convert_checkpoint_from_megatron_to_transformers", action="store_true",
                   help="Megatron -> HF; without it: HF -> Megatron, or Megatron -> Megatron when --load_path is one")
    p.add_argument("--load_path", required=True)
    p.add_argument("--save_path", required=True)
    p.add_argument("--target_tensor_model_parallel_size", type=int, default=1)
    p.add_argument("--target_pipeline_model_parallel_size", type=int, default=1)
    p.add_argument("--target_data_parallel_size", type=int, default=None,
                   help="recorded in the checkpoint's args; default: the smallest the expert layout allows (1 without)")
    p.add_argument("--target_expert_model_parallel_size", type=int, default=1,
                   help="expert-parallel ranks an MoE model's experts are split over (Megatron-LM's expert_model_parallel_size)")
    p.add_argument("--target_expert_tensor_parallel_size", type=int, default=None,
                   help="tensor-parallel ranks inside each expert (Megatron-LM's expert_tensor_parallel_size); default: the TP")
    p.add_argument("--target_params_dtype", default=None, choices=DTYPE_NAMES, help="default: as stored (fp32 for Megatron output)")
    p.add_argument("--make_vocab_size_divisible_by", type=int, default=128)
    p.add_argument("--use_distributed_optimizer", action="store_true")
    p.add_argument("--max_shard_size", default="10GB")
    p.add_argument("--tokenizer_name", default=None, help="a local tokenizer folder to copy into the HF output")
    p.add_argument("--checkpoint_format", default="torch_dist", choices=("torch_dist", "torch", "megatron_plugin"),
                   help="what HF -> Megatron and reshapes write: Megatron-LM's torch_dist (default) or legacy "
                   "torch, or this package's megatron_plugin; Megatron input is recognized whatever its format")
    p.add_argument("--hf_config", default=None,
                   help="a local HF config folder: the model of a Megatron-LM checkpoint that does not name it")
    p.add_argument("--print-checkpoint-structure", "--print_checkpoint_structure", dest="print_checkpoint_structure",
                   action="store_true", help="print every tensor written: name, shape, dtype")
    p.add_argument("--release_as_iteration_0", action="store_true",
                   help="write an HF model as iter_0000000/ with a tracker holding 0 instead of Megatron-LM's release/ "
                        "(what accelerate's example asserts for --initial_megatron_lm_checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --save_path")
    p.add_argument("--no_progress", action="store_true")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    common = dict(overwrite=a.overwrite, print_structure=a.print_checkpoint_structure, progress=not a.no_progress)
    try:
        if a.convert_checkpoint_from_megatron_to_transformers:
            convert_megatron_to_hf(a.load_path, a.save_path, hf_config=a.hf_config, max_shard_size=a.max_shard_size,
                                   params_dtype=a.target_params_dtype, tokenizer_name=a.tokenizer_name, **common)
        else:
            kwargs = dict(tp=a.target_tensor_model_parallel_size, pp=a.target_pipeline_model_parallel_size,
                          dp=a.target_data_parallel_size, ep=a.target_expert_model_parallel_size,
                          etp=a.target_expert_tensor_parallel_size, params_dtype=a.target_params_dtype or "fp32",
                          make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                          use_distributed_optimizer=a.use_distributed_optimizer,
                          checkpoint_format=a.checkpoint_format, **common)
            if a.release_as_iteration_0:
                kwargs["release"] = False
            if is_megatron_checkpoint(a.load_path):
                reshape_megatron(a.load_path, a.save_path, hf_config=a.hf_config, **kwargs)
            else:
                convert_hf_to_megatron(a.load_path, a.save_path, **kwargs)
    except MegatronPluginConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.save_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
