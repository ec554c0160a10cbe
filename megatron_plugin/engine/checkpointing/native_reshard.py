"""Loading a native checkpoint saved at another TP/PP/virtual-stage/expert-parallel layout.

The weights are resharded through HF names (the converter's reader); the CPU engine's optimizer state
too; mcore's optimizer state, whose layout follows the parallel layout, starts fresh (with a warning).
RNG states are per rank and start fresh when the world size changed.
"""

from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist

from ...models.convert import model_dims
from ...models.mapping import TRANSFORMS, TensorSlice, expand, read_shard, unshard
from ..hf_io import MegatronReader
from .collective import agree
from .layout import expert_sizes, optimizer_file, replicas, shard_name, torch_load, verify_file
from .native_load import read_rest
from .state import TrainingState


def load_resharded(ckpt: str, meta: dict, state: TrainingState) -> dict:
    """Collective. Like `load_same_layout`, for a checkpoint of another layout; returns meta."""

    def read():
        reader = MegatronReader(ckpt, setting="load_state")
        for chunk in state.chunks:
            chunk.load_hf(reader.get_slice, reader.names)
        saved = {}
        if meta.get("model_only"):
            return saved
        wanted = meta.get("optimizer", True) and state.load_optimizer
        # an MoE model's expert states are sharded over other groups: its optimizer starts fresh (torch_dist,
        # the default format, reshards them)
        if wanted and meta.get("engine") == "cpu" and state.torch_optimizer and meta["pp"] == 1 and not state.has_experts:
            saved["optimizer"] = _resharded_optimizer_state(ckpt, meta, state)
        return read_rest(ckpt, meta, state, saved)

    with torch.no_grad():
        saved = agree(read)
    layout = f"tp={meta['tp']}, pp={meta['pp']}, virtual stages={meta.get('vpp')}"
    if expert_sizes(meta) is not None:
        layout += ", expert_model_parallel_size={}, expert_tensor_parallel_size={}".format(*expert_sizes(meta))
    if not meta.get("model_only"):
        if "optimizer" in saved:
            state.optimizer.load_state_dict(saved["optimizer"])
        else:
            if not meta.get("optimizer", True) and state.load_optimizer:
                warnings.warn(f"load_state: {ckpt} holds no optimizer state (it was saved with no_save_optim=True); "
                              "the optimizer starts fresh (the weights are loaded)")
            elif state.load_optimizer:
                warnings.warn(f"load_state: {ckpt} was saved with {layout}; the weights were resharded to this run's "
                              "layout, the optimizer state could not be and starts fresh")
            state.optimizer_follows_weights()
        state.restore(saved, ckpt, meta["world_size"], replicas(meta)[1])
    else:
        state.optimizer_follows_weights()
    state.set_iteration(meta["iteration"])
    dist.barrier()
    return meta


def _saved_optimizer_states(ckpt: str, meta: dict) -> list:
    """Per saved TP rank: {Megatron parameter name: its torch optimizer state}."""
    saved = []
    for t in range(meta["tp"]):
        stem = shard_name(t, 0)
        with open(verify_file(ckpt, optimizer_file(stem, "names.json"), meta)) as f:
            names = json.load(f)
        sd = torch_load(verify_file(ckpt, optimizer_file(stem, "dp000.pt"), meta), map_location="cpu")
        saved.append({n: sd["state"][i] for i, n in enumerate(names) if i in sd["state"]})
    return saved


def _resharded_optimizer_state(ckpt: str, meta: dict, state: TrainingState) -> dict:
    """The CPU engine's torch optimizer state saved at another TP layout, moved to this rank's layout
    the way the weights are: per state tensor (exp_avg, ...) all TP shards -> the HF tensor -> this
    rank's shard (mapping.read_shard)."""
    model, old_tp = state.model, meta["tp"]
    saved = _saved_optimizer_states(ckpt, meta)
    old_dims = model_dims(model.family, model.hf_config, meta["make_vocab_size_divisible_by"], old_tp)
    rules = model.family.table(model.hf_config, model.variant)
    new_names = state.optimizer_param_names()
    by_name = {}
    for rule, hf_names, mcore_name in expand(rules, model.plan):
        if mcore_name not in new_names or mcore_name not in saved[0]:
            continue
        entry = {}
        for key, value in saved[0][mcore_name].items():
            if not torch.is_tensor(value) or value.dim() == 0:
                entry[key] = value  # the step count
                continue
            parts = [saved[t][mcore_name][key] for t in range(old_tp)]
            hf = dict(zip(hf_names, TRANSFORMS[rule.transform].to_hf(unshard(parts, rule), old_dims)))
            entry[key] = read_shard(lambda n: TensorSlice(hf[n]), rule, hf_names, model.dims,
                                    state.layout.tp_size, state.layout.tp_rank)
        by_name[mcore_name] = entry
    current = state.optimizer.state_dict()
    current["state"] = {i: by_name[n] for i, n in enumerate(new_names) if n in by_name}
    return current
