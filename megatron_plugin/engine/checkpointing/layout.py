"""The on-disk layout of the `megatron_plugin/1` format: file names, meta.json, checksums.

    <dir>/latest                         name of the complete checkpoint below (replaced atomically)
    <dir>/iter_0000010/meta.json         layout, iteration, model config, checksums (written last)
    <dir>/iter_0000010/model/tp00_pp000.safetensors
    <dir>/iter_0000010/model/experts_etp00_ep000_pp000.safetensors   (MoE models: the routed experts)
    <dir>/iter_0000010/optimizer/tp00_pp000_dp000.pt
    <dir>/iter_0000010/scheduler.pt
    <dir>/iter_0000010/rng/rank00000.pt
    <dir>/iter_0000010/custom/<i>.pt     objects registered with `register_for_checkpointing`

Both the writers (the native format, checkpoint_utils) and the readers (the native format,
`hf_io.MegatronReader`) name files through here, so they cannot drift apart. Nothing here imports the
rest of the engine.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from ...errors import MegatronPluginConfigError
from ...fs import atomic_write_text, file_checksum

LATEST = "latest"
FORMAT = "megatron_plugin/1"
META = "meta.json"
SCHEDULER = "scheduler.pt"


def shard_name(tp_rank: int, pp_rank: int) -> str:
    """The stem of one model-parallel rank's files (model/<stem>.safetensors, optimizer/<stem>_...)."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}"


def model_file(ckpt_dir: str, tp_rank: int, pp_rank: int) -> str:
    """One model-parallel rank's weights inside a checkpoint folder (an MoE model's routed experts apart)."""
    return os.path.join(ckpt_dir, "model", f"{shard_name(tp_rank, pp_rank)}.safetensors")


# A routed expert's tensors in a module's state dict (megatron-core's SequentialMLP names).
_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)\.")


def is_expert_key(name: str) -> bool:
    """Whether `name` (a state-dict or model-file name) is a routed expert's tensor. Experts are split over
    expert-parallel ranks and over the expert tensor-parallel group, which need not be the dense one, so
    they live in files of their own (`expert_file`)."""
    return _EXPERT.search(name) is not None


def expert_shard_name(etp_rank: int, ep_rank: int, pp_rank: int) -> str:
    """The stem of the routed experts' file of one (expert TP, expert-parallel, pipeline) rank. Tensor names
    inside use the local expert index; the file's `ep` rank and meta.json's `ep` size give the global one."""
    return f"experts_etp{etp_rank:02d}_ep{ep_rank:03d}_pp{pp_rank:03d}"


def expert_file(ckpt_dir: str, etp_rank: int, ep_rank: int, pp_rank: int) -> str:
    return os.path.join(ckpt_dir, "model", f"{expert_shard_name(etp_rank, ep_rank, pp_rank)}.safetensors")


def expert_sizes(meta: dict):
    """(expert-parallel size, expert tensor-parallel size) a checkpoint was saved with, or None for a model
    without routed experts (whose files are the tp/pp ones only)."""
    if meta.get("ep") is None:
        return None
    return int(meta["ep"]), int(meta.get("etp") or meta["tp"])


def optimizer_file(stem: str, part: str) -> str:
    """optimizer/<stem>_<part> relative to the checkpoint: `dp000.pt`, `names.json`, `param_state.pt`."""
    return os.path.join("optimizer", f"{stem}_{part}")


def rng_file(rank: int) -> str:
    return os.path.join("rng", f"rank{rank:05d}.pt")


def custom_file(index: int) -> str:
    return os.path.join("custom", f"{index}.pt")


def chunk_key(chunk: int, num_chunks: int, name: str) -> str:
    """A tensor's name in a model file: chunk i's names get `chunk{i}.` when a rank holds several."""
    return f"chunk{chunk}.{name}" if num_chunks > 1 else name


def checkpoint_meta(*, iteration, tp, pp, dp, vpp, distributed_optimizer, model_only, family, variant,
                    make_vocab_size_divisible_by, hf_config, ep=None, etp=None, cp=1) -> dict:
    """meta.json, the same keys for checkpoints of runs and of checkpoint_utils. `ep` / `etp` (expert-parallel
    and expert tensor-parallel sizes) only for a model with routed experts, which then has expert files. `dp` is
    data parallel without context parallel (`cp`): the run had tp * cp * pp * dp processes."""
    experts = {} if ep is None else {"ep": ep, "etp": etp or tp}
    return {
        "format": FORMAT, "iteration": iteration, "tp": tp, "pp": pp, "dp": dp, "cp": cp,
        "world_size": tp * cp * pp * dp,
        "vpp": vpp, "distributed_optimizer": distributed_optimizer, "model_only": model_only, "family": family,
        "variant": variant, "lm_head": variant != "base", "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "hf_config": hf_config,
        **experts,
    }


def replicas(meta: dict) -> tuple:
    """(dp, cp) a checkpoint was saved with: the replicas of each model shard, over which per-rank state (RNG
    streams, the distributed optimizer's shards) is laid out. A checkpoint written before context parallelism
    records no `cp`: 1."""
    return int(meta["dp"]), int(meta.get("cp") or 1)


def write_meta(path: str, meta: dict) -> None:
    atomic_write_text(path, json.dumps(meta, indent=2))


def point_latest(output_dir: str, tag: str) -> None:
    atomic_write_text(os.path.join(output_dir, LATEST), tag)


def read_latest(output_dir: str) -> Optional[str]:
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def iteration_of(ckpt: str) -> Optional[int]:
    """The iteration meta.json records, or None where it cannot be read."""
    try:
        with open(os.path.join(ckpt, META)) as f:
            return int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_checkpoint_dir(path: str) -> bool:
    """Whether `path` looks like a checkpoint of this format: a save folder (`latest`) or one checkpoint."""
    return os.path.exists(os.path.join(path, LATEST)) or os.path.exists(os.path.join(path, META))


def missing_checkpoint(input_dir) -> MegatronPluginConfigError:
    """The error for a load folder that holds no complete checkpoint (or is no folder at all)."""
    if input_dir is None or not os.path.isdir(input_dir):
        return MegatronPluginConfigError(
            "load_state input_dir", input_dir, "no such folder: pass the folder given to accelerator.save_state"
        )
    return MegatronPluginConfigError(
        "load_state input_dir", input_dir,
        "no complete checkpoint there (no 'latest' file naming a folder with meta.json): pass the folder "
        "given to accelerator.save_state",
    )


def resolve_checkpoint(input_dir: str) -> str:
    """A folder with `latest`, or a checkpoint folder itself (with meta.json)."""
    if input_dir is None or not os.path.isdir(input_dir):
        raise missing_checkpoint(input_dir)
    if os.path.exists(os.path.join(input_dir, META)):
        return input_dir
    tag = read_latest(input_dir)
    if tag is None or not os.path.exists(os.path.join(input_dir, tag, META)):
        raise missing_checkpoint(input_dir)
    return os.path.join(input_dir, tag)


def read_meta(ckpt: str) -> dict:
    """meta.json of a checkpoint folder, or a clear error naming it."""
    path = os.path.join(ckpt, META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read the checkpoint's metadata ({err})") from None
    needed = ("format", "iteration", "tp", "pp", "dp", "hf_config", "family", "lm_head", "make_vocab_size_divisible_by")
    if isinstance(meta, dict):  # checkpoints written before variants existed say only whether there was an LM head
        meta.setdefault("variant", "lm" if meta.get("lm_head", True) else "base")
    missing = [k for k in needed if k not in meta] if isinstance(meta, dict) else list(needed)
    if missing or meta.get("format") != FORMAT:
        raise MegatronPluginConfigError(
            "load_state", path, f"not a {FORMAT} checkpoint's metadata (missing {missing or 'format'}): is the file damaged?"
        )
    return meta


def verify_file(ckpt: str, relpath: str, meta: dict) -> str:
    """The absolute path of a checkpoint file after checking it against meta.json's checksum."""
    path = os.path.join(ckpt, relpath)
    if not os.path.exists(path):
        raise MegatronPluginConfigError("load_state", ckpt, f"the checkpoint lacks {relpath}: it is incomplete")
    expected = (meta.get("files") or {}).get(relpath)
    if expected is not None:
        got = file_checksum(path)
        if got != expected:
            raise MegatronPluginConfigError(
                "load_state", path,
                f"the file is damaged: {got['bytes']} bytes with CRC-32 {got['crc32']}, but it was saved as "
                f"{expected['bytes']} bytes with CRC-32 {expected['crc32']}; restore it or load an older checkpoint",
            )
    return path


def torch_load(path: str, map_location=None):
    """A torch-saved file of a checkpoint, or a clear error naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read this file ({err}): is it complete?") from None
