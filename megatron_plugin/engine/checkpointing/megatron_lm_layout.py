"""Megatron-LM's checkpoint layout, named as `megatron/training/checkpointing.py` names it:

    <dir>/latest_checkpointed_iteration.txt    "5" (or "release"): the commit point, replaced atomically
    <dir>/iter_0000005/                         one checkpoint (a converted one: <dir>/release/)
        torch_dist:  metadata.json, common.pt, .metadata, __<r>_<i>.distcp   (megatron-core dist_checkpointing)
                     megatron_plugin_checksums.json: ours, written last (size and CRC-32 of every file)
        legacy torch: mp_rank_<TT>[_<PPP>][_<EEE>]/model_optim_rng.pt   (_EEE: expert-parallel rank, EP > 1)

Writers (save_state, checkpoint_utils) and readers (load_state) name files through here, and a save
stages into `<dir>/.iter_0000005.partial` first. Nothing here runs a collective or imports torch models:
the converter can use it as is.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

from ...errors import MegatronPluginConfigError
from ...fs import atomic_write_text, file_checksum

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CONFIG = "metadata.json"  # dist_checkpointing's: which backend wrote the folder
COMMON = "common.pt"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: every tensor, and where its bytes are
CHECKSUMS = "megatron_plugin_checksums.json"
LEGACY_FILE = "model_optim_rng.pt"
_LEGACY_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(iteration: int) -> str:
    """A checkpoint's folder name: `iter_0000005`, exactly as Megatron-LM's readers expect it."""
    return f"iter_{iteration:07d}"


def tag_dir(tag: str) -> str:
    """The folder the tracker's text names: "release" -> release, "5" -> iter_0000005."""
    return RELEASE if tag == RELEASE else iteration_dir(int(tag))


def staging_dir(save_dir: str, name: str) -> str:
    """Where a save writes before the folder is renamed into place; never read by a load."""
    return os.path.join(save_dir, f".{name}.partial")


def replaced_dir(save_dir: str, name: str) -> str:
    """Where a checkpoint of the same iteration waits while the new one is renamed into its place."""
    return os.path.join(save_dir, f".{name}.replaced")


def write_tracker(save_dir: str, tag) -> None:
    """The commit: the tracker names the checkpoint a load of `save_dir` reads ("5" or "release")."""
    atomic_write_text(os.path.join(save_dir, TRACKER), str(tag))


def read_tracker(save_dir: str) -> Optional[str]:
    """The tracker's text ("5", "release"), None without a tracker; a clear error when it is garbled."""
    path = os.path.join(save_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read the tracker file ({err.strerror})") from None
    if text != RELEASE and not text.isdigit():
        raise MegatronPluginConfigError(
            "load_state", path, f"the tracker file holds {text!r}, not an iteration number or 'release': is it damaged?")
    return text


def legacy_dirs(ckpt: str, pipeline: Optional[bool] = None, expert: Optional[bool] = None) -> Dict[Tuple[int, int, int], str]:
    """{(tp rank, pp rank, ep rank): folder} of a legacy (torch) checkpoint; empty when it is none. Megatron-LM
    names a rank's folder mp_rank_TT, adds _PPP with pipeline stages and then _EEE with expert-parallel ranks,
    so two numbers are either: `pipeline` / `expert` (whether the checkpoint's args have PP > 1 / EP > 1)
    decide; unknown, the second number is the pipeline stage."""
    out = {}
    for name in os.listdir(ckpt) if os.path.isdir(ckpt) else ():
        m = _LEGACY_DIR.match(name)
        if m and os.path.isdir(os.path.join(ckpt, name)):
            t, second, third = int(m.group(1)), m.group(2), m.group(3)
            if third is not None:
                p, e = int(second), int(third)
            elif second is not None and expert and not pipeline:
                p, e = 0, int(second)
            else:
                p, e = int(second or 0), 0
            out[(t, p, e)] = os.path.join(ckpt, name)
    return out


def first_legacy_file(ckpt: str) -> Optional[str]:
    """The file of rank 0 (mp_rank_00, mp_rank_00_000 or mp_rank_00_000_000), whatever the layout: its args say
    how the other folders' numbers read."""
    names = sorted(n for n in os.listdir(ckpt) if _LEGACY_DIR.match(n) and set(n[len("mp_rank_"):]) <= set("0_"))
    return os.path.join(ckpt, names[0], LEGACY_FILE) if names else None


def legacy_file(ckpt: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt: _PPP with pipeline stages, _EEE with expert-parallel ranks."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep_size > 1:
        name += f"_{ep_rank:03d}"
    return os.path.join(ckpt, name, LEGACY_FILE)


def kind_of(ckpt: str) -> Optional[str]:
    """"torch_dist" (dist_checkpointing's metadata.json), "torch" (mp_rank_* folders) or None."""
    if not os.path.isdir(ckpt):
        return None
    if os.path.isfile(os.path.join(ckpt, CONFIG)):
        return "torch_dist"
    if any(_LEGACY_DIR.match(n) for n in os.listdir(ckpt)):
        return "torch"
    return None


def is_checkpoint_dir(path: str) -> bool:
    """A save folder (with the tracker) or one checkpoint folder of Megatron-LM's layout."""
    return os.path.isfile(os.path.join(path, TRACKER)) or kind_of(path) is not None


def resolve(input_dir: str) -> Tuple[str, Optional[int], bool]:
    """(checkpoint folder, its iteration from the folder name or None, release?) of a save folder (the
    tracker names the checkpoint) or of a checkpoint folder passed directly (iter_NNNNNNN, release)."""
    if input_dir is None or not os.path.isdir(input_dir):
        raise MegatronPluginConfigError(
            "load_state input_dir", input_dir, "no such folder: pass the folder given to accelerator.save_state")
    if kind_of(input_dir) is not None:
        name = os.path.basename(os.path.normpath(input_dir))
        m = _ITER_DIR.match(name)
        return input_dir, (int(m.group(1)) if m else None), name == RELEASE
    tag = read_tracker(input_dir)
    if tag is None:
        raise MegatronPluginConfigError(
            "load_state input_dir", input_dir,
            f"no checkpoint there (no {TRACKER}, and it is no checkpoint folder itself): pass the folder given to "
            "accelerator.save_state")
    name = tag_dir(tag)
    ckpt = os.path.join(input_dir, name)
    if kind_of(ckpt) is None and kind_of(replaced_dir(input_dir, name)) is not None:
        # a save of the same iteration stopped between its two renames: the old folder is complete
        ckpt = replaced_dir(input_dir, name)
    if kind_of(ckpt) is None:
        raise MegatronPluginConfigError(
            "load_state", os.path.join(input_dir, TRACKER),
            f"the tracker names {name}, which holds no checkpoint: restore it, or write the iteration of a complete "
            "checkpoint into the tracker")
    return ckpt, (None if tag == RELEASE else int(tag)), tag == RELEASE


def read_config(ckpt: str) -> dict:
    """metadata.json (the backend that wrote the folder), or a clear error naming it."""
    path = os.path.join(ckpt, CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read it ({err}): is the file damaged?") from None
    if not isinstance(config, dict) or config.get("sharded_backend") != "torch_dist":
        backend = config.get("sharded_backend") if isinstance(config, dict) else config
        raise MegatronPluginConfigError(
            "load_state", path, f"a checkpoint of sharded backend {backend!r}: only torch_dist is read (convert it with "
            "Megatron-LM's tools)")
    return config


def storage_files(ckpt: str, dcp_metadata) -> Dict[str, int]:
    """{file name: bytes its tensors need} from torch.distributed.checkpoint's metadata."""
    needed: Dict[str, int] = {}
    for info in (dcp_metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def check_storage_files(ckpt: str, dcp_metadata) -> None:
    """Every file the metadata names exists and is long enough: a truncated or missing shard is named here,
    before any tensor is read."""
    for name, size in sorted(storage_files(ckpt, dcp_metadata).items()):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            raise MegatronPluginConfigError("load_state", path, "the checkpoint lacks this file: it is incomplete")
        got = os.path.getsize(path)
        if got < size:
            raise MegatronPluginConfigError(
                "load_state", path, f"the file is damaged: {got} bytes, but its tensors end at byte {size}; restore it "
                "or load an older checkpoint")


def checkpoint_files(folder: str) -> List[str]:
    """Every file of a checkpoint folder (relative paths, sorted), but the checksums' own file."""
    out = []
    for root, _, files in os.walk(folder):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), folder)
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def my_share(files: List[str], rank: int, world_size: int) -> List[str]:
    """The files this rank checksums: every rank a part, so each file is read once."""
    return [f for i, f in enumerate(files) if i % world_size == rank]


def checksums(folder: str, files: List[str]) -> dict:
    return {f: file_checksum(os.path.join(folder, f)) for f in files}


def write_checksums(folder: str, sums: dict) -> None:
    atomic_write_text(os.path.join(folder, CHECKSUMS), json.dumps({"files": dict(sorted(sums.items()))}, indent=1))


def read_checksums(ckpt: str) -> Optional[dict]:
    """{relpath: checksum} written at save, None for a checkpoint without them (Megatron-LM's own)."""
    path = os.path.join(ckpt, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read it ({err}): is the file damaged?") from None


def verify_checksums(ckpt: str, expected: dict, files: List[str]) -> None:
    """`files` (relative) against the checksums saved with them, naming the first damaged or missing one."""
    for rel in files:
        path = os.path.join(ckpt, rel)
        if not os.path.isfile(path):
            raise MegatronPluginConfigError("load_state", path, "the checkpoint lacks this file: it is incomplete")
        got, want = file_checksum(path), expected[rel]
        if got != want:
            raise MegatronPluginConfigError(
                "load_state", path,
                f"the file is damaged: {got['bytes']} bytes with CRC-32 {got['crc32']}, but it was saved as "
                f"{want['bytes']} bytes with CRC-32 {want['crc32']}; restore it or load an older checkpoint")
