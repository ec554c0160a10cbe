"""Which of the three formats a folder holds, for the converter. The names and the tracker are those of
`engine/checkpointing/megatron_lm_layout` (what save_state and load_state use), so the converter and the
runs cannot drift apart:

    DIR/latest_checkpointed_iteration.txt   the iteration ("5"), or "release" for a converted model
    DIR/iter_0000005/  or  DIR/release/     one checkpoint:
        torch_dist: megatron-core dist_checkpointing (metadata.json, common.pt, .metadata, __0_0.distcp)
        torch (legacy): mp_rank_TT/model_optim_rng.pt (PP = 1) or mp_rank_TT_PPP/model_optim_rng.pt

Megatron-LM refuses a tracker holding 0 (`assert iteration > 0 or release`), so a checkpoint of
iteration 0 (a converted HF model) is a release one, unless `release=False`: accelerate's example
(`--initial_megatron_lm_checkpoint`) asserts the opposite, `iter_0000000/` and a tracker holding 0.
"""

from __future__ import annotations

import os
from typing import Tuple

from megatron_plugin.engine.checkpointing import megatron_lm_layout as layout
from megatron_plugin.errors import MegatronPluginConfigError

FORMATS = ("torch_dist", "torch", "megatron_plugin")


def tag_for(iteration: int, release: bool = True) -> str:
    """The folder (and tracker text) of a checkpoint of `iteration`."""
    return layout.RELEASE if iteration == 0 and release else layout.iteration_dir(iteration)


def write_tracker(out: str, iteration: int, release: bool = True) -> None:
    layout.write_tracker(out, layout.RELEASE if iteration == 0 and release else iteration)


def seal(ckpt: str) -> None:
    """The checksums of every file, as save_state writes them: load_state then names a damaged file."""
    layout.write_checksums(ckpt, layout.checksums(ckpt, layout.checkpoint_files(ckpt)))


def verify(ckpt: str, setting: str = "--load_path") -> None:
    """Every file against the checksums saved with it (save_state's and this converter's checkpoints; a
    checkpoint of Megatron-LM has none), naming the first damaged one before anything is converted."""
    try:
        expected = layout.read_checksums(ckpt)
        if expected is not None:
            layout.verify_checksums(ckpt, expected, sorted(expected))
    except MegatronPluginConfigError as err:
        raise MegatronPluginConfigError(setting, err.value, err.fix) from None


def iteration_of_tag(ckpt: str) -> int:
    name = os.path.basename(os.path.normpath(ckpt))
    return int(name[len("iter_"):]) if name.startswith("iter_") and name[len("iter_"):].isdigit() else 0


def locate(path: str) -> Tuple[str, str]:
    """(format, checkpoint folder) of a Megatron checkpoint: a save folder with the tracker file, one
    iteration's folder (iter_N, release), or a folder of this package's own format."""
    from megatron_plugin.engine.checkpointing.layout import is_checkpoint_dir, resolve_checkpoint

    if not path or not os.path.isdir(path):
        raise MegatronPluginConfigError("--load_path", path, "no such folder: pass a checkpoint folder")
    if layout.is_checkpoint_dir(path):
        try:
            ckpt, _, _ = layout.resolve(path)
            if layout.kind_of(ckpt) == "torch_dist":
                layout.read_config(ckpt)  # a backend other than torch_dist is refused here, by name
        except MegatronPluginConfigError as err:  # named for the converter's flag
            raise MegatronPluginConfigError("--load_path", err.value, err.fix) from None
        return layout.kind_of(ckpt), ckpt
    if is_checkpoint_dir(path):
        return "megatron_plugin", resolve_checkpoint(path)
    raise MegatronPluginConfigError(
        "--load_path", path, f"is no Megatron checkpoint: no {layout.TRACKER}, no metadata.json or mp_rank_* folders, "
        "no 'latest' or meta.json")


def is_megatron_checkpoint(path: str) -> bool:
    """Whether `path` looks like a Megatron checkpoint of any format (cheap; `locate` says what is wrong
    with one that is damaged)."""
    from megatron_plugin.engine.checkpointing.layout import is_checkpoint_dir

    if not path or not os.path.isdir(path):
        return False
    return layout.is_checkpoint_dir(path) or is_checkpoint_dir(path)
