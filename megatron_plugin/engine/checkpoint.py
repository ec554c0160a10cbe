"""`save_state` / `load_state` for Megatron runs: what the accelerator calls.

Both take the run's `TrainingState` from the engine once and hand it to a checkpoint format
(`checkpointing.formats.CheckpointFormat`): a save to the format named (the plugin's `ckpt_format`:
Megatron-LM's `torch_dist` by default, or `megatron_plugin`, the native `megatron_plugin/1`), a load to
the first registered format that recognizes the folder (native; Megatron-LM's torch_dist and legacy
torch). To add a format, implement the interface and `register_format` it; nothing here changes.
"""

from __future__ import annotations

import os
from typing import Dict

from ..errors import MegatronPluginConfigError
from .checkpointing.collective import agree
from .checkpointing.formats import CheckpointFormat
from .checkpointing.layout import FORMAT, missing_checkpoint
from .checkpointing.megatron_lm import NAME as TORCH_DIST
from .checkpointing.megatron_lm import TorchDistFormat
from .checkpointing.native import NativeFormat
from .checkpointing.shared import check_shared_for_save, find_for_load
from .checkpointing.state import TrainingState

__all__ = ["ALIASES", "FORMATS", "agree", "format_for", "format_named", "load_state", "register_format", "save_state"]

# every format a load may find, tried in this order; a save writes the one it names
FORMATS: Dict[str, CheckpointFormat] = {FORMAT: NativeFormat(), TORCH_DIST: TorchDistFormat()}
# the plugin's `ckpt_format` values -> format names
ALIASES = {"megatron_plugin": FORMAT}


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Make `fmt` available to save_state (by its name) and to load_state (after the formats before it)."""
    FORMATS[fmt.name] = fmt
    return fmt


def format_named(name: str) -> CheckpointFormat:
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        raise MegatronPluginConfigError("ckpt_format", name, f"use one of {sorted(set(FORMATS) | set(ALIASES))}")
    return FORMATS[name]


def format_for(input_dir: str) -> CheckpointFormat:
    """The first registered format that recognizes `input_dir`, or a clear error when none does."""
    if input_dir is None or not os.path.isdir(input_dir):
        raise missing_checkpoint(input_dir)
    for fmt in FORMATS.values():
        if fmt.recognizes(input_dir):
            return fmt
    raise missing_checkpoint(input_dir)


def save_state(output_dir: str, engine, custom_objects=(), distributed_optimizer: bool = False,
               format_name: str = TORCH_DIST) -> str:
    """Collective: every rank calls it. Returns the checkpoint's folder (see the format's `save`)."""
    fmt = format_named(format_name)
    # on several machines every rank writes its part there: a folder each machine has its own of is refused
    # before anything is written (once per folder and run)
    check_shared_for_save(output_dir, owner=engine)
    state = TrainingState.of_engine(engine, custom_objects, distributed_optimizer)
    return fmt.save(output_dir, state)


def load_state(input_dir: str, engine, custom_objects=()) -> dict:
    """Collective. Loads model, optimizer, scheduler, RNG and iteration; returns the checkpoint's metadata."""
    # as `agree`, and a folder rank 0 reads but other machines cannot see is named as such
    fmt = find_for_load(input_dir, lambda: format_for(input_dir))
    return fmt.load(input_dir, TrainingState.of_engine(engine, custom_objects))
