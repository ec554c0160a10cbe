"""Saving in the native format (`layout`): staged, checksummed, committed by `latest`.

Every rank writes into a staging folder; only when all are done does rank 0 rename it into place and
then point `latest` at it. A crash at any moment leaves `latest` naming a complete checkpoint (the
previous one), and a half-written staging folder is never what a load reads. A rank that fails while
writing (a full disk) stops every rank with one error, and the staging folder is removed; no rank is left
waiting in a collective for it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ...errors import MegatronPluginConfigError
from ...fs import atomic_write_text, check_writable, file_checksum
from .collective import broadcast_error, commit_on_rank0
from .layout import (META, SCHEDULER, checkpoint_meta, custom_file, expert_file, iteration_of, model_file,
                     optimizer_file, point_latest, read_latest, rng_file, shard_name, write_meta)
from .state import TrainingState

# the name this warning has always been logged under
logger = logging.getLogger("megatron_plugin.engine.checkpoint")


def save(output_dir: str, state: TrainingState) -> str:
    """Collective: every rank calls it. Returns the checkpoint's folder.

    The previous checkpoint (the one `latest` named) is deleted once the new one is complete and `latest`
    names it, unless it is of a later iteration: a newer checkpoint is kept, with a warning."""
    output_dir = os.path.abspath(output_dir)
    tag = _open_staging(output_dir, state.iteration)
    staging = _staging_dir(output_dir, tag)
    files = _write_rank_files(output_dir, staging, state)
    commit_on_rank0(state.layout.rank == 0, output_dir, lambda: _commit(output_dir, tag, state, files), _kept)
    return os.path.join(output_dir, tag)


def _kept(output_dir: str) -> str:
    """What a failed save leaves, and what to do."""
    previous = read_latest(output_dir)
    left = f"`latest` still names {previous}" if previous else "the folder holds no checkpoint"
    return f"nothing was saved and {left}: free space or choose another folder, then save again"


def _staging_dir(output_dir: str, tag: str) -> str:
    return os.path.join(output_dir, f".{tag}.partial")


def _open_staging(output_dir: str, iteration: int) -> str:
    """Collective: rank 0 checks the folder and makes an empty staging folder for a new tag (iter_N, or
    iter_N_k if iter_N exists); every rank gets the tag, or rank 0's error."""
    tag, problem = [None], None
    if dist.get_rank() == 0:
        try:
            check_writable(output_dir, "save_state(output_dir)")
            os.makedirs(output_dir, exist_ok=True)
            base, k = f"iter_{iteration:07d}", 0
            tag[0] = base
            while os.path.exists(os.path.join(output_dir, tag[0])):
                k += 1
                tag[0] = f"{base}_{k}"
            staging = _staging_dir(output_dir, tag[0])
            shutil.rmtree(staging, ignore_errors=True)
            for sub in ("model", "optimizer", "rng", "custom"):
                os.makedirs(os.path.join(staging, sub))
        except MegatronPluginConfigError as err:
            problem = (err.setting, err.value, err.fix)
        except OSError as err:
            problem = ("save_state(output_dir)", output_dir, f"cannot write there ({err.strerror}): choose another folder")
    broadcast_error(problem)
    dist.broadcast_object_list(tag, src=0)
    dist.barrier()
    return tag[0]


def _write_rank_files(output_dir: str, staging: str, state: TrainingState) -> dict:
    """Collective: this rank's files into the staging folder; returns every rank's {relpath: checksum}.
    If any rank fails to write, rank 0 removes the staging folder and every rank raises the same error."""
    grid = state.layout
    sums, problem, cause = None, None, None
    try:
        sums = _write_files(staging, state)
    except Exception as err:  # a full disk, a failing file system: told to every rank below
        problem, cause = f"rank {grid.rank} could not write its part of the checkpoint ({type(err).__name__}: {err})", err
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, (sums, problem))
    failed = [p for _, p in everyone if p is not None]
    if failed:
        if grid.rank == 0:  # every rank has stopped writing: the half-written checkpoint goes
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()  # gone before any rank returns
        raise MegatronPluginConfigError(
            "save_state(output_dir)", output_dir, f"{'; '.join(failed)}; {_kept(output_dir)}") from cause
    return {k: v for part, _ in everyone for k, v in part.items()}


def optimizer_stem(state: TrainingState) -> str:
    """The stem of this rank's optimizer files. A rank's optimizer state covers its dense shards (tp, pp) and,
    in an MoE model, its experts' (expert TP and EP rank): both are named."""
    grid = state.layout
    stem = shard_name(grid.tp_rank, grid.pp_rank)
    if state.has_experts:
        place = state.experts
        stem += f"_etp{place.etp_rank:02d}_ep{place.ep_rank:03d}"
    return stem


def _writes_optimizer(state: TrainingState) -> bool:
    """Collective. Whether this rank writes its optimizer files: the first rank of each distinct
    optimizer state. Without routed experts that is data-parallel (x context-parallel) rank 0; with them the ranks of one
    dense shard hold different experts' states, so the first rank of each (tp, pp, expert tp, ep)."""
    if not state.has_experts:
        return state.layout.dp_cp_rank == 0
    grid, place = state.layout, state.experts
    mine = (grid.tp_rank, grid.pp_rank, place.etp_rank, place.ep_rank)
    everyone = [None] * grid.world_size
    dist.all_gather_object(everyone, mine)
    return everyone.index(mine) == grid.rank


def _write_files(staging: str, state: TrainingState) -> dict:
    """This rank's files; returns their {relpath: checksum}. The distributed optimizer's state is gathered
    first, a collective every rank reaches before any rank can fail on its own files."""
    grid = state.layout
    name = optimizer_stem(state)
    written = []
    writes_optimizer = _writes_optimizer(state)
    if state.distributed_optimizer and state.save_optimizer:
        # mcore gathers the DP-sharded optimizer state onto DP rank 0 of each model-parallel rank
        path = os.path.join(staging, optimizer_file(name, "param_state.pt"))
        state.optimizer.save_parameter_state(path)
        if grid.dp_cp_rank == 0:
            written.append(path)
    if grid.dp_cp_rank == 0:
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.named_tensors(experts=False)}
        save_file(tensors, model_file(staging, grid.tp_rank, grid.pp_rank))
        written.append(model_file(staging, grid.tp_rank, grid.pp_rank))
    if state.has_experts and state.experts.edp_rank == 0:
        # expert data-parallel rank 0 of each (expert TP, EP, PP) rank: every expert shard once
        place = state.experts
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.named_tensors(experts=True)}
        written.append(expert_file(staging, place.etp_rank, place.ep_rank, grid.pp_rank))
        save_file(tensors, written[-1])
    if writes_optimizer and state.save_optimizer:
        written.append(os.path.join(staging, optimizer_file(name, "dp000.pt")))
        torch.save(state.optimizer.state_dict(), written[-1])
        if state.torch_optimizer:
            # which parameter each state index is: what a load into another layout reshards by
            written.append(os.path.join(staging, optimizer_file(name, "names.json")))
            atomic_write_text(written[-1], json.dumps(state.optimizer_param_names()))
    written.append(os.path.join(staging, rng_file(grid.rank)))
    torch.save(state.rng_state(), written[-1])
    if grid.rank == 0 and state.scheduler is not None:
        written.append(os.path.join(staging, SCHEDULER))
        torch.save(state.scheduler.state_dict(), written[-1])
    if grid.rank == 0:
        for i, obj in enumerate(state.custom_objects):
            written.append(os.path.join(staging, custom_file(i)))
            torch.save(obj.state_dict(), written[-1])
    return {os.path.relpath(p, staging): file_checksum(p) for p in written}


def _commit(output_dir: str, tag: str, state: TrainingState, files: dict) -> None:
    """Rank 0, once every rank's files are written: meta.json last, the staging folder renamed into
    place, `latest` pointed at it (the commit), then the previous checkpoint removed, unless it is newer
    than this one: that one is kept, with a warning."""
    staging, final, grid = _staging_dir(output_dir, tag), os.path.join(output_dir, tag), state.layout
    write_meta(os.path.join(staging, META), dict(checkpoint_meta(
        iteration=state.iteration, tp=grid.tp_size, pp=grid.pp_size, dp=grid.dp_size, cp=grid.cp_size, vpp=state.vpp,
        distributed_optimizer=state.distributed_optimizer, model_only=False, **state.model_fields(),
        **(dict(ep=state.experts.ep_size, etp=state.experts.etp_size) if state.has_experts else {}),
    ), files=dict(sorted(files.items())), engine="cpu" if state.torch_optimizer else "mcore",
       optimizer=state.save_optimizer))
    os.replace(staging, final)
    previous = read_latest(output_dir)
    point_latest(output_dir, tag)
    if not previous or previous == tag:
        return
    old = iteration_of(os.path.join(output_dir, previous))
    if old is not None and old > state.iteration:
        logger.warning(
            "save_state: %s holds a newer checkpoint, %s of iteration %d; it is kept, and `latest` now names "
            "%s of iteration %d, just saved (load_state loads it; pass %s to load the newer one)", output_dir,
            previous, old, tag, state.iteration, os.path.join(output_dir, previous))
        return
    shutil.rmtree(os.path.join(output_dir, previous), ignore_errors=True)
