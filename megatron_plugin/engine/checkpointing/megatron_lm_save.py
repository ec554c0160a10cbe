"""Saving a torch_dist checkpoint in Megatron-LM's layout: staged, checksummed, committed by the tracker.

Every rank writes its shards into `<dir>/.iter_NNNNNNN.partial` (megatron-core's dist_checkpointing,
`torch_dist_io.save_sharded`); then each checksums a share of the files; only when every rank is done
does rank 0 write the checksums, rename the folder to `iter_NNNNNNN` and write
`latest_checkpointed_iteration.txt` (the commit, atomic). A crash at any moment leaves the tracker naming
the previous complete checkpoint; a rank that fails stops every rank with one error and the staging
folder is removed.

Megatron-LM's readers take the tracker's number as the folder `iter_{N:07d}`, so a second save of the same
iteration replaces that folder (the old one is moved aside first and removed after the commit; a load in
between reads it, see `megatron_lm_layout.resolve`). The checkpoint the tracker named before is removed once
the new one is committed, as the native format does, unless it is of a later iteration (kept, with a
warning) or a release.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import defaultdict

import torch.distributed as dist

from ...errors import MegatronPluginConfigError
from ...fs import check_writable
from .collective import agree, broadcast_error, commit_on_rank0
from .megatron_lm_layout import (RELEASE, checkpoint_files, checksums, iteration_dir, my_share, read_tracker,
                                 replaced_dir, staging_dir, tag_dir, write_checksums, write_tracker)
from .megatron_lm_state import save_state_dict
from .state import TrainingState
from .torch_dist_io import save_sharded

# the name this warning has always been logged under (the native format's too)
logger = logging.getLogger("megatron_plugin.engine.checkpoint")


def save(output_dir: str, state: TrainingState) -> str:
    """Collective: every rank calls it. Returns the checkpoint's folder (`<output_dir>/iter_NNNNNNN`)."""
    output_dir = os.path.abspath(output_dir)
    name = iteration_dir(state.iteration)
    _open_staging(output_dir, name)
    staging = staging_dir(output_dir, name)
    sums = _write(output_dir, staging, state)
    commit_on_rank0(state.layout.rank == 0, output_dir, lambda: _commit(output_dir, name, state, sums), _kept)
    return os.path.join(output_dir, name)


def _kept(output_dir: str) -> str:
    """What a failed save leaves, and what to do."""
    try:
        previous = read_tracker(output_dir)
    except MegatronPluginConfigError:
        previous = None
    left = f"the tracker still names {tag_dir(previous)}" if previous else "the folder holds no checkpoint"
    return f"nothing was saved and {left}: free space or choose another folder, then save again"


def _open_staging(output_dir: str, name: str) -> None:
    """Collective: rank 0 checks the folder and makes an empty staging folder (a crashed save's staging
    folders go: nothing reads them); every rank gets rank 0's error, if any."""
    problem = None
    if dist.get_rank() == 0:
        try:
            check_writable(output_dir, "save_state(output_dir)")
            os.makedirs(output_dir, exist_ok=True)
            for entry in os.listdir(output_dir):
                if entry.startswith(".iter_") and entry.endswith(".partial"):
                    shutil.rmtree(os.path.join(output_dir, entry), ignore_errors=True)
            os.makedirs(staging_dir(output_dir, name))
        except MegatronPluginConfigError as err:
            problem = (err.setting, err.value, err.fix)
        except OSError as err:
            problem = ("save_state(output_dir)", output_dir, f"cannot write there ({err.strerror}): choose another folder")
    broadcast_error(problem)


def _write(output_dir: str, staging: str, state: TrainingState) -> dict:
    """Collective: the state into the staging folder, then a checksum of every file (each rank a share);
    returns every file's. If any rank fails, rank 0 removes the staging folder and every rank raises the
    same error."""
    grid = state.layout
    sharded = agree(lambda: save_state_dict(state))
    problem = None
    try:
        save_sharded(sharded, staging)
    except Exception as err:  # a full disk, a failing file system: told to every rank below
        problem = (f"could not write its part of the checkpoint ({type(err).__name__}: {err})", err)
    _stop_if_any_failed(output_dir, staging, grid, problem)  # and every rank's files are complete here
    sums = None
    try:
        sums = checksums(staging, my_share(checkpoint_files(staging), grid.rank, grid.world_size))
    except Exception as err:
        problem = (f"could not read back the checkpoint ({type(err).__name__}: {err})", err)
    everyone = _stop_if_any_failed(output_dir, staging, grid, problem, sums)
    return {k: v for part in everyone for k, v in part.items()}


def _stop_if_any_failed(output_dir: str, staging: str, grid, problem, result=None) -> list:
    """Collective: every rank's `result`, or, when any rank has a `problem` (text, exception), the staging
    folder removed by rank 0 and one error raised on every rank, naming the ranks and what they hit."""
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, (result, problem[0] if problem else None))
    failed = defaultdict(list)
    for rank, (_, p) in enumerate(everyone):
        if p is not None:
            failed[p].append(rank)
    if failed:
        if grid.rank == 0:  # every rank has stopped writing: the half-written checkpoint goes
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()  # gone before any rank returns
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} {p}" for p, r in failed.items())
        raise MegatronPluginConfigError("save_state(output_dir)", output_dir, f"{said}; {_kept(output_dir)}") from (
            problem[1] if problem else None)
    return [r for r, _ in everyone]


def _commit(output_dir: str, name: str, state: TrainingState, sums: dict) -> None:
    """Rank 0, once every rank's files are written and checksummed: the checksums, the folder renamed into
    place, the tracker written (the commit), then the previous checkpoint removed unless it is newer."""
    staging, final = staging_dir(output_dir, name), os.path.join(output_dir, name)
    write_checksums(staging, sums)
    try:
        previous = read_tracker(output_dir)
    except MegatronPluginConfigError:
        previous = None  # a garbled tracker: this save replaces it
    aside = None
    if os.path.exists(final):
        aside = replaced_dir(output_dir, name)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(staging, final)
    write_tracker(output_dir, state.iteration)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if previous is None or previous == RELEASE or tag_dir(previous) == name:
        return
    if int(previous) > state.iteration:
        logger.warning(
            "save_state: %s holds a newer checkpoint, %s of iteration %s; it is kept, and the tracker now names "
            "%s of iteration %d, just saved (load_state loads it; pass %s to load the newer one)", output_dir,
            tag_dir(previous), previous, name, state.iteration, os.path.join(output_dir, tag_dir(previous)))
        return
    shutil.rmtree(os.path.join(output_dir, tag_dir(previous)), ignore_errors=True)
