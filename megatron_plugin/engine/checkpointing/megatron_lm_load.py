"""Loading a torch_dist checkpoint (ours or Megatron-LM's) at any TP/PP/DP layout.

torch_dist tensors are global: this run's own sharded state dict asks for its shards of them, whatever
layout wrote them (megatron-core reads the overlapping parts; the vocabulary rows, padded to a multiple
that depends on TP, load where they overlap, the padding stays zero). Before any tensor is read, on every
rank: the files are checked (each one the metadata names is present and long enough; with our checksums,
every file against its checksum, each rank a share), the model is checked to be the checkpoint's, and
what to load is decided (optimizer state, RNG streams); an error is raised on every rank.

The optimizer state is read unless the run says no_load_optim, the checkpoint holds none (saved with
no_save_optim, a release), or it is of another optimizer (the CPU engine's torch optimizer vs megatron-core's,
distributed or not): then the weights load and the optimizer starts fresh, with a warning naming why.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.serialization import load_common_state_dict
from torch.distributed.checkpoint import FileSystemReader

from ...errors import MegatronPluginConfigError
from .collective import agree
from .megatron_lm_layout import (COMMON, DCP_METADATA, check_storage_files, my_share, read_checksums, read_config,
                                 verify_checksums)
from .megatron_lm_state import (CUSTOM_OBJECTS, ENTRY, RESHARDABLE, RNG, another_model, args_differences,
                                custom_objects_object,
                                from_megatron_rng, has_object, mcore_optimizer_load, mcore_optimizer_ready_to_load,
                                model_key,
                                model_sharded_state_dict, object_shape,
                                rng_request, tensor_dtypes, torch_optimizer_loaded, torch_optimizer_request,
                                without_extra_state)
from .same_model import mismatch
from .state import TrainingState
from .torch_dist_io import CONTENT_METADATA, load_sharded


@dataclass
class _Plan:
    ckpt: str
    release: bool
    common: dict
    dtypes: dict  # {tensor key: dtype} the checkpoint holds
    rng_shape: Optional[tuple]
    custom: bool
    optimizer: bool = False
    why_not_optimizer: Optional[str] = None  # warned when the optimizer starts fresh
    rng: bool = False

    @property
    def entry(self) -> dict:
        return self.common.get(ENTRY) or {}

    @property
    def args(self):
        return self.common.get("args")


def load(ckpt: str, release: bool, state: TrainingState) -> dict:
    """Collective. Loads weights, optimizer, scheduler, RNG, registered objects and iteration from the
    checkpoint folder `ckpt`; returns what it loaded (format, iteration, layout saved)."""
    plan = agree(lambda: _plan(ckpt, release, state))
    request = _request(plan, state)
    loaded = agree(lambda: _read(plan, request))
    agree(lambda: _apply(plan, loaded, state))
    dist.barrier()
    saved = _saved_layout(plan)
    return {"format": "torch_dist", "iteration": state.iteration, "checkpoint": ckpt, "release": release,
            "optimizer_loaded": plan.optimizer, **saved}


# -- before anything is read ------------------------------------------------------------------------
def _plan(ckpt: str, release: bool, state: TrainingState) -> _Plan:
    read_config(ckpt)
    for name in (COMMON, DCP_METADATA):
        if not os.path.isfile(os.path.join(ckpt, name)):
            raise MegatronPluginConfigError("load_state", os.path.join(ckpt, name),
                                            "the checkpoint lacks this file: it is incomplete")
    expected = read_checksums(ckpt)
    if expected is not None:  # each rank reads its share of the saved files once: a damaged byte is named
        verify_checksums(ckpt, expected, my_share(sorted(expected), state.layout.rank, state.layout.world_size))
    try:
        metadata = FileSystemReader(ckpt).read_metadata()
    except Exception as err:
        raise MegatronPluginConfigError("load_state", os.path.join(ckpt, DCP_METADATA),
                                        f"cannot read it ({type(err).__name__}: {err}): is the file damaged?") from None
    check_storage_files(ckpt, metadata)
    common = _read_common(ckpt)
    plan = _Plan(ckpt=ckpt, release=release, common=common, dtypes=tensor_dtypes(metadata),
                 rng_shape=object_shape(metadata, RNG), custom=has_object(metadata, CUSTOM_OBJECTS))
    _check_model(plan, state)
    if state.custom_objects and (not plan.custom or plan.entry.get("custom_objects") != len(state.custom_objects)):
        raise MegatronPluginConfigError(
            "load_state", ckpt, f"{len(state.custom_objects)} objects are registered with register_for_checkpointing, "
            f"but the checkpoint holds {plan.entry.get('custom_objects', 0) if plan.custom else 'none'}: register the "
            "same objects as the run that saved it")
    _decide_optimizer(plan, state)
    grid = state.layout
    saved = _saved_layout(plan)
    # the streams are one per data-parallel x context-parallel rank: another CP is like another DP
    plan.rng = (not release and plan.rng_shape == (grid.pp_size, grid.tp_size)
                and saved.get("world_size") == grid.world_size and saved["cp"] == grid.cp_size)
    return plan


def _read_common(ckpt: str) -> dict:
    path = os.path.join(ckpt, COMMON)
    try:
        common = load_common_state_dict(ckpt)  # megatron-core's read, weights-only: what Megatron-LM reads
    except Exception as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read it ({type(err).__name__}: {err}): is the "
                                        "file damaged?") from None
    if not isinstance(common, dict):
        raise MegatronPluginConfigError("load_state", path, "it holds no state dict: is the file damaged?")
    return common


def _saved_layout(plan: _Plan) -> dict:
    entry, args = plan.entry, plan.args
    # cp: Megatron-LM's args record context_parallel_size (its data_parallel_size excludes it); our entry records
    # it as `cp` since context parallelism came; a checkpoint that records neither was saved at 1
    cp = getattr(args, "context_parallel_size", None) or 1
    if entry:
        return dict({k: entry.get(k) for k in ("tp", "pp", "dp", "world_size")}, ep=entry.get("ep", 1),
                    cp=entry.get("cp") or cp)
    return {"tp": getattr(args, "tensor_model_parallel_size", 1), "pp": getattr(args, "pipeline_model_parallel_size", 1),
            "dp": getattr(args, "data_parallel_size", None), "world_size": getattr(args, "world_size", None),
            "ep": getattr(args, "expert_model_parallel_size", 1), "cp": cp}


def _check_model(plan: _Plan, state: TrainingState) -> None:
    """The checkpoint is of this run's model: by the HF config we recorded, or (a checkpoint of Megatron-LM)
    by the shape settings its args record. Raised before anything is loaded, naming each difference."""
    entry = plan.entry
    if entry:
        try:
            differ = mismatch({"family": entry["family"], "variant": entry["variant"], "hf_config": entry["hf_config"]},
                              state)
        except MegatronPluginConfigError:
            raise
        except Exception as err:
            raise MegatronPluginConfigError(
                "load_state", os.path.join(plan.ckpt, COMMON), f"cannot read the model config it records "
                f"({type(err).__name__}: {err}): is the file damaged?") from None
    else:
        differ = args_differences(state.model.config, plan.args)
    if differ:
        raise another_model(plan.ckpt, differ)


def _decide_optimizer(plan: _Plan, state: TrainingState) -> None:
    entry, args = plan.entry, plan.args
    saved_any = any(k.startswith("optimizer.") for k in plan.dtypes) or "optimizer" in plan.common
    if plan.release:
        plan.why_not_optimizer = "it is a release checkpoint (weights only)"
    elif not state.load_optimizer:
        plan.why_not_optimizer = ""  # asked for: no warning
    elif not saved_any or (entry and entry.get("optimizer") is None):
        plan.why_not_optimizer = "it holds no optimizer state (it was saved with no_save_optim=True)"
    elif entry and entry.get("engine") != ("cpu" if state.torch_optimizer else "mcore"):
        plan.why_not_optimizer = (f"its optimizer state is of the {'CPU' if entry.get('engine') == 'cpu' else 'GPU'} "
                                  "engine's optimizer, which this run's is not")
    elif not entry and state.torch_optimizer:
        plan.why_not_optimizer = "its optimizer state is megatron-core's (Megatron-LM's), not a torch optimizer's"
    else:
        saved_dist = entry.get("distributed_optimizer") if entry else getattr(args, "use_distributed_optimizer", False)
        sharding = (plan.common.get(CONTENT_METADATA) or {}).get("distrib_optim_sharding_type")
        layout = _saved_layout(plan)
        grid = state.layout
        if bool(saved_dist) != bool(state.distributed_optimizer):
            plan.why_not_optimizer = (f"it was saved with use_distributed_optimizer={bool(saved_dist)}, this run has "
                                      f"{state.distributed_optimizer}")
        elif saved_dist and sharding not in RESHARDABLE and (
                layout["tp"], layout["pp"], layout["dp"], layout["cp"]) != (grid.tp_size, grid.pp_size, grid.dp_size,
                                                                            grid.cp_size):
            # its shards are over the data-parallel x context-parallel ranks: another CP is another sharding
            plan.why_not_optimizer = (f"its distributed optimizer state ({sharding}) reshards only at its own layout "
                                      f"(tp={layout['tp']}, pp={layout['pp']}, dp={layout['dp']}, cp={layout['cp']})")
        elif not state.torch_optimizer and args is not None and (
                bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))) != (
                bool(state.model.config.bf16), bool(state.model.config.fp16)):
            plan.why_not_optimizer = "it was saved in another precision (bf16/fp16), whose optimizer keeps other state"
        elif not state.torch_optimizer and state.has_experts and (
                (layout.get("ep") or 1) > 1) != (state.experts.ep_size > 1):
            # megatron-core gives expert parameters an optimizer of their own (chained after the dense one) only
            # when they are split over expert-parallel ranks: the saved optimizer's structure is another one
            plan.why_not_optimizer = (f"its optimizer state was saved with expert_model_parallel_size={layout.get('ep')}, "
                                      f"this run has {state.experts.ep_size}: megatron-core chains an optimizer of "
                                      "the experts' own only when it is > 1")
        else:
            plan.optimizer = True


def _request(plan: _Plan, state: TrainingState) -> dict:
    """This rank's sharded state dict to load into: the model chunks, and the optimizer state, RNG streams
    and registered objects where the plan reads them."""
    metadata = dict(plan.common.get(CONTENT_METADATA) or {})
    metadata.setdefault("singleton_local_shards", False)
    metadata.setdefault("chained_optim_avoid_prefix", True)
    sd = model_sharded_state_dict(state.chunks, metadata)
    if plan.optimizer:
        if state.torch_optimizer:
            sd["optimizer"] = torch_optimizer_request(state, sd, plan.dtypes)
        else:
            mcore_optimizer_ready_to_load(state.optimizer)
            sd["optimizer"] = state.optimizer.sharded_state_dict(sd, is_loading=True, metadata=dict(metadata))
    sd = dict(sd, **without_extra_state({k: sd[k] for k in sd if k.startswith("model")}))
    if plan.rng:
        sd[RNG] = rng_request()
    if state.custom_objects:
        sd[CUSTOM_OBJECTS] = custom_objects_object(state.custom_objects, data=[None] * len(state.custom_objects))
    return sd


def _read(plan: _Plan, request: dict) -> dict:
    try:
        return load_sharded(request, plan.ckpt)
    except MegatronPluginConfigError:
        raise
    except Exception as err:  # megatron-core and torch.distributed.checkpoint raise on every rank alike
        text = str(err).strip().splitlines()
        raise MegatronPluginConfigError(
            "load_state", plan.ckpt, f"cannot read the checkpoint ({type(err).__name__}: {text[-1] if text else ''}): "
            "is it of this model, and complete?") from None


# -- after ------------------------------------------------------------------------------------------
def _apply(plan: _Plan, loaded: dict, state: TrainingState) -> None:
    n = len(state.chunks)
    with torch.no_grad():
        for i, chunk in enumerate(state.chunks):
            missing, unexpected = chunk.module.load_state_dict(loaded[model_key(i, n)], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise MegatronPluginConfigError(
                    "load_state", plan.ckpt, f"the checkpoint's model does not fit this one (missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]})")
    if plan.optimizer:
        try:
            if state.torch_optimizer:
                state.optimizer.load_state_dict(torch_optimizer_loaded(state, loaded["optimizer"], plan.entry))
            else:
                mcore_optimizer_load(state.optimizer, loaded["optimizer"])
        except MegatronPluginConfigError:
            raise
        except (ValueError, KeyError, RuntimeError) as err:
            raise MegatronPluginConfigError(
                "load_state", plan.ckpt, f"the optimizer state does not fit this run's optimizer ({err}): was it saved "
                "with other parameter groups or frozen parameters? (no_load_optim=True loads the weights only)") from None
    else:
        if plan.why_not_optimizer:
            warnings.warn(f"load_state: {plan.ckpt}: {plan.why_not_optimizer}; the optimizer starts fresh (the "
                          "weights are loaded)")
        state.optimizer_follows_weights()
    if state.scheduler is not None and not plan.release:
        if "opt_param_scheduler" in plan.common:
            state.load_scheduler(plan.common["opt_param_scheduler"])
        else:
            warnings.warn(f"load_state: {plan.ckpt} holds no learning-rate schedule; the schedule starts over")
    if plan.rng:
        per_rank = loaded[RNG]
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        state.set_rng_state(from_megatron_rng(per_rank[dp_rank] if dp_rank < len(per_rank) else per_rank[0]))
    elif not plan.release:
        layout = _saved_layout(plan)
        warnings.warn(f"load_state: {plan.ckpt} holds RNG states of tp={layout['tp']}, pp={layout['pp']}, "
                      f"cp={layout['cp']} over {layout['world_size']} processes; this run's random streams (dropout) start from the plugin's seed")
    for obj, saved in zip(state.custom_objects, loaded.get(CUSTOM_OBJECTS) or ()):
        obj.load_state_dict(saved)
    state.set_iteration(0 if plan.release else int(plan.common.get("iteration", 0)))


__all__ = ["load"]
