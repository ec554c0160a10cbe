"""Loading a native checkpoint saved at this run's TP/PP/virtual-stage layout: every file checked against
its checksum on every rank before anything is loaded, then the state filled in."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from ...errors import MegatronPluginConfigError
from .collective import agree
from .layout import (SCHEDULER, custom_file, expert_file, is_expert_key, model_file, optimizer_file, replicas, rng_file,
                     torch_load, verify_file)
from .native_save import optimizer_stem
from .state import TrainingState


def load_same_layout(ckpt: str, meta: dict, state: TrainingState) -> dict:
    """Collective. Loads model shards, optimizer, scheduler, RNG and iteration; returns meta."""
    saved = agree(lambda: _read(ckpt, meta, state))
    with torch.no_grad():
        for key, dest in state.named_tensors():
            dest.copy_(saved["tensors"][key])
    if not meta.get("model_only"):
        # model_only checkpoints (checkpoint_utils) are weights: optimizer, scheduler and RNG start fresh
        _load_optimizer(ckpt, meta, state, saved.get("optimizer"))
        state.restore(saved, ckpt, meta["world_size"], replicas(meta)[1])
    else:
        state.optimizer_follows_weights()
    state.set_iteration(meta["iteration"])
    dist.barrier()
    return meta


def same_replicas(meta: dict, state: TrainingState) -> bool:
    """Whether the checkpoint was saved by as many processes, with as many data-parallel and context-parallel
    ranks per model shard, as this run: what per-rank state (RNG streams, the distributed optimizer's shards over
    DP x CP) needs to load rank for rank. A different CP counts as a different DP."""
    grid = state.layout
    return meta["world_size"] == grid.world_size and replicas(meta) == (grid.dp_size, grid.cp_size)


def read_rest(ckpt: str, meta: dict, state: TrainingState, saved: dict) -> dict:
    """Into `saved`: the scheduler's state, this rank's RNG states when the processes are laid out as saved
    (`same_replicas`: they are per rank), and the registered objects' states."""
    if state.scheduler is not None:
        saved["scheduler"] = torch_load(verify_file(ckpt, SCHEDULER, meta))
    if same_replicas(meta, state):
        saved["rng"] = torch_load(verify_file(ckpt, rng_file(state.layout.rank), meta))
    saved["custom"] = [torch_load(verify_file(ckpt, custom_file(i), meta)) for i in range(len(state.custom_objects))]
    return saved


def _read(ckpt: str, meta: dict, state: TrainingState) -> dict:
    """Every file this rank loads, checked; raises before anything is loaded."""
    saved = {"tensors": _read_model(ckpt, meta, state)}
    if meta.get("model_only"):
        return saved
    grid = state.layout
    name = optimizer_stem(state)
    other_dp = not same_replicas(meta, state)  # the same layout, other replicas (DP and/or CP)
    # the distributed optimizer shards its state over the data-parallel (x context-parallel) ranks: only the
    # same sharding loads
    sharded = meta["distributed_optimizer"] or state.distributed_optimizer
    fits = not (sharded and (other_dp or meta["distributed_optimizer"] != state.distributed_optimizer))
    if fits and meta.get("optimizer", True) and state.load_optimizer:
        saved["optimizer"] = torch_load(verify_file(ckpt, optimizer_file(name, "dp000.pt"), meta),
                                        map_location=state.device)
        if meta["distributed_optimizer"] and grid.dp_cp_rank == 0:
            verify_file(ckpt, optimizer_file(name, "param_state.pt"), meta)
    return read_rest(ckpt, meta, state, saved)


def _read_model(ckpt: str, meta: dict, state: TrainingState) -> dict:
    """This rank's model files (an MoE model's experts apart), checked to hold every tensor of this model at
    its shape."""
    grid = state.layout
    files = [model_file(ckpt, grid.tp_rank, grid.pp_rank)]
    if state.has_experts:
        files.append(expert_file(ckpt, state.experts.etp_rank, state.experts.ep_rank, grid.pp_rank))
    tensors, where = {}, {}
    for file in files:
        path = verify_file(ckpt, os.path.relpath(file, ckpt), meta)
        try:
            part = load_file(path)
        except Exception as err:  # safetensors raises its own error types for truncated or garbled files
            raise MegatronPluginConfigError("load_state", path, f"cannot read this model shard ({err}): is it complete?") from None
        tensors.update(part)
        where.update(dict.fromkeys(part, path))
    for key, dest in state.named_tensors():
        path = where.get(key, files[-1] if is_expert_key(key) else files[0])
        if key not in tensors:
            raise MegatronPluginConfigError(
                "load_state", path, f"the shard lacks tensor {key!r}: it is of another model "
                f"({meta['hf_config'].get('model_type')}, {meta['hf_config'].get('num_hidden_layers', meta['hf_config'].get('n_layer'))} layers)",
            )
        if tensors[key].shape != dest.shape:
            raise MegatronPluginConfigError(
                "load_state", path, f"tensor {key!r} has shape {tuple(tensors[key].shape)} in the checkpoint but "
                f"{tuple(dest.shape)} in this model: the checkpoint is of another model size",
            )
    return tensors


def _load_optimizer(ckpt: str, meta: dict, state: TrainingState, optimizer_state) -> None:
    """The optimizer's state, or a warning that it starts fresh (none saved, or saved with another
    sharding); none under no_load_optim, which asked for that."""
    if optimizer_state is None:
        if not state.load_optimizer:
            pass
        elif not meta.get("optimizer", True):
            warnings.warn(f"load_state: {ckpt} holds no optimizer state (it was saved with no_save_optim=True); "
                          "the optimizer starts fresh (the weights are loaded)")
        else:
            warnings.warn(f"load_state: {ckpt} was saved with use_distributed_optimizer={meta['distributed_optimizer']} "
                          f"over {meta['dp']} data-parallel x {replicas(meta)[1]} context-parallel ranks; its optimizer "
                          "state does not fit this run's and starts fresh (the weights are loaded)")
        state.optimizer_follows_weights()
        return
    try:
        state.optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise MegatronPluginConfigError(
            "load_state", os.path.join(ckpt, "optimizer"),
            f"the optimizer state does not fit this run's optimizer ({err}): was it saved with other parameter "
            "groups or frozen parameters?",
        ) from None
    if meta["distributed_optimizer"]:
        name = optimizer_stem(state)
        state.optimizer.load_parameter_state(os.path.join(ckpt, optimizer_file(name, "param_state.pt")))
