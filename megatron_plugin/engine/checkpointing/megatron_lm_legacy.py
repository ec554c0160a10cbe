"""Reading Megatron-LM's legacy (`--ckpt-format torch`) checkpoints into this run, at any TP/PP layout.

    iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt        (no pipeline)
    iter_NNNNNNN/mp_rank_TT_PPP/model_optim_rng.pt
    iter_NNNNNNN/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt  (an MoE model over EP > 1 ranks: the dense tensors
        and that expert-parallel rank's experts, under their local index)    each: {'model' (or 'model0', 'model1' per virtual
        stage): that rank's mcore state dict, 'args', 'iteration', 'checkpoint_version', 'optimizer',
        'opt_param_scheduler', 'rng_state', ...}

The state dicts use each stage's local layer numbers and TP shards. They are read the way the native
format's are resharded: per tensor, every TP shard of the stage that holds it, joined by the family's mapping
table (`mapping.unshard`: the TP dimension, and GLU halves that each rank holds apart) into the HF tensor,
which every chunk of this run reads its own slice of. Layer norms under the names Megatron-LM's TE layers
give them (`...linear_qkv.layer_norm_weight`) are read as our layers' (`input_layernorm.weight`).

Weights, learning-rate schedule and iteration are loaded. The optimizer state (whose layout follows the
saved run's optimizer buffers) is not: the optimizer starts fresh, with a warning; so do the random streams.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import replace
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer

from ...errors import MegatronPluginConfigError
from ...models.convert import model_dims
from ...models.mapping import TRANSFORMS, StagePlan, TensorSlice, expand, unshard
from .collective import agree
from .megatron_lm_layout import first_legacy_file, legacy_dirs, legacy_file
from .megatron_lm_state import another_model, args_differences, model_key
from .state import TrainingState

_LAYER = re.compile(r"^(.*\.layers\.\d+\.)(.+)$")
_LAYER_INDEX = re.compile(r"^(.*\.layers)\.(\d+)\.")


def load_legacy(ckpt: str, release: bool, state: TrainingState) -> dict:
    """Collective. Loads the weights (resharded to this run), the schedule and the iteration."""
    reader = agree(lambda: LegacyReader(ckpt, state))
    with torch.no_grad():
        agree(lambda: [chunk.load_hf(reader.get_slice, reader.names) for chunk in state.chunks])
    reader.release_memory()
    first = reader.first
    if state.load_optimizer:
        warnings.warn(f"load_state: {ckpt} is a legacy (torch) checkpoint of Megatron-LM: its optimizer state is not "
                      "read, the optimizer starts fresh (the weights are loaded)")
    state.optimizer_follows_weights()
    if state.scheduler is not None and not release and "opt_param_scheduler" in first:
        agree(lambda: _load_scheduler(ckpt, state, first["opt_param_scheduler"]))
    if not release:
        warnings.warn(f"load_state: {ckpt} is a legacy checkpoint: this run's random streams (dropout) start from the "
                      "plugin's seed")
    state.set_iteration(0 if release else int(first.get("iteration", 0)))
    dist.barrier()
    return {"format": "torch", "iteration": state.iteration, "checkpoint": ckpt, "release": release,
            "optimizer_loaded": False, "tp": reader.tp, "pp": reader.pp, "dp": None,
            "world_size": getattr(first.get("args"), "world_size", None)}


def _load_scheduler(ckpt, state, saved):
    try:
        state.load_scheduler(saved)
    except (KeyError, TypeError, AssertionError) as err:
        raise MegatronPluginConfigError(
            "load_state", ckpt, f"its learning-rate schedule does not fit this run's ({type(err).__name__}: {err})") from None


def _legacy_names(state: TrainingState) -> Dict[str, str]:
    """{name Megatron-LM's TE layers give a tensor: our layers' name}, from our layers' checkpoint keys map."""
    renames = {}
    for chunk in state.chunks:
        for module in chunk.module.modules():
            if isinstance(module, TransformerLayer):
                for ours, theirs in module.submodules_config.sharded_state_dict_keys_map.items():
                    renames[theirs] = ours
    return renames


class LegacyReader:
    """A legacy checkpoint, read one pipeline stage (all its TP files) at a time. `get(name)` rebuilds one HF
    tensor of this run's model."""

    def __init__(self, ckpt: str, state: TrainingState):
        if state.custom_objects:
            raise MegatronPluginConfigError(
                "load_state", ckpt, f"{len(state.custom_objects)} objects are registered with register_for_checkpointing, "
                "but a legacy checkpoint of Megatron-LM holds none: load it without them")
        self.ckpt = ckpt
        self.renames = _legacy_names(state)
        self._stage: Tuple[tuple, List[dict]] = ((), [])
        first = first_legacy_file(ckpt)
        if first is None:
            raise MegatronPluginConfigError("load_state", ckpt, "the checkpoint lacks rank 0's mp_rank_00* folder: it is incomplete")
        self.first = self._read_path(first)
        args = self.first.get("args")
        # two numbers in a folder name are the pipeline stage or the expert-parallel rank: the args say which
        dirs = legacy_dirs(ckpt, pipeline=(getattr(args, "pipeline_model_parallel_size", None) or 1) > 1,
                           expert=(getattr(args, "expert_model_parallel_size", None) or 1) > 1)
        self.tp, self.pp, self.ep = (1 + max(r[i] for r in dirs) for i in range(3))
        for setting, saved, mine in (("tensor_model_parallel_size", getattr(args, "tensor_model_parallel_size", self.tp), self.tp),
                                     ("pipeline_model_parallel_size", getattr(args, "pipeline_model_parallel_size", self.pp), self.pp),
                                     ("expert_model_parallel_size", getattr(args, "expert_model_parallel_size", None) or 1, self.ep)):
            if saved != mine:
                raise MegatronPluginConfigError(
                    "load_state", ckpt, f"its args say {setting}={saved}, but it holds the folders of {mine}: is it complete?")
        etp = getattr(args, "expert_tensor_parallel_size", None)
        if etp not in (None, self.tp) and getattr(args, "num_experts", None):
            raise MegatronPluginConfigError(
                "load_state", ckpt, f"its experts are split over expert_tensor_parallel_size={etp} ranks, but its folders "
                f"are named by the {self.tp} tensor-parallel ranks only: convert it with Megatron-LM to torch_dist first")
        self._check_model(state, args)
        model = state.model
        self.family, self.config, self.variant = model.family, model.hf_config, model.variant
        divisible = getattr(args, "make_vocab_size_divisible_by", None) or state.make_vocab_size_divisible_by
        self.dims = model_dims(self.family, self.config, divisible, self.tp)
        if getattr(args, "padded_vocab_size", None):
            self.dims = replace(self.dims, padded_vocab=args.padded_vocab_size)
        chunk_keys = sorted(k for k in self.first if re.fullmatch(r"model\d*", k))
        vpp = len(chunk_keys) if chunk_keys != ["model"] else 1
        if not chunk_keys:
            raise MegatronPluginConfigError("load_state", self._file(0, 0), "it holds no 'model' state dict")
        rules = self.family.table(self.config, self.variant)
        num_layers = self.family.num_layers(self.config)
        uneven = [k for k in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
                  if getattr(args, k, None) is not None]
        if num_layers % (self.pp * vpp) or uneven:
            raise MegatronPluginConfigError(
                "load_state", ckpt, f"its {self.pp} pipeline stages x {vpp} chunks do not hold the {num_layers} layers "
                f"evenly ({', '.join(uneven) or 'an uneven split'}): legacy checkpoints are read with even stages only; "
                "convert it with Megatron-LM to torch_dist, which records each layer's index")
        self._chunk_keys, self._layers_per_chunk = chunk_keys, num_layers // (self.pp * vpp)
        self._checked_stages = set()
        self._check_depth(self.first, self._file(0, 0))
        self._source: Dict[str, tuple] = {}
        experts = self.family.num_experts(self.config)
        if self.ep > 1 and (not experts or experts % self.ep):
            raise MegatronPluginConfigError(
                "load_state", ckpt, f"it holds {self.ep} expert-parallel ranks' folders, which this model's "
                f"{experts or 'no'} experts do not split over: is it of this model?")
        for p in range(self.pp):
            for vp in range(vpp):
                stage = StagePlan.for_rank(num_layers, self.pp, p, vp, vpp)
                for e in range(self.ep):  # each expert-parallel rank's file: the dense tensors and its experts
                    plan = self.family.plan_with_experts(self.config, stage, self.ep, e)
                    for rule, hf_names, mcore_name in expand(rules, plan):
                        if rule.stage == "tied_output" or (e and not rule.per_expert):
                            continue
                        for i, n in enumerate(hf_names):
                            self._source[n] = (rule, model_key(vp, vpp), mcore_name, p, e if rule.per_expert else 0, i)
        self.names = list(self._source)
        self._cache: Tuple[tuple, List[torch.Tensor]] = ((), [])

    def _check_model(self, state, args) -> None:
        differ = args_differences(state.model.config, args)
        if differ:
            raise another_model(self.ckpt, differ)

    def _check_depth(self, saved: dict, path: str) -> None:
        """Each model chunk of a stage's file holds the layers an even split gives it; a stage of another
        depth (uneven stages, another model) would otherwise load layers into the wrong places."""
        for key in self._chunk_keys:
            stacks: Dict[str, set] = {}
            for name in saved.get(key) or {}:
                m = _LAYER_INDEX.match(name)
                if m:
                    stacks.setdefault(m.group(1), set()).add(int(m.group(2)))
            for stack, indices in stacks.items():
                if len(indices) != self._layers_per_chunk:
                    raise MegatronPluginConfigError(
                        "load_state", path, f"its {key!r} holds {len(indices)} layers in {stack}, an even split of "
                        f"this model gives {self._layers_per_chunk}: legacy checkpoints are read with even stages of "
                        "this model only")

    def _file(self, t: int, p: int, e: int = 0) -> str:
        return legacy_file(self.ckpt, t, p, self.pp, e, self.ep)

    def _read(self, t: int, p: int, e: int = 0) -> dict:
        return self._read_path(self._file(t, p, e))

    def _read_path(self, path: str) -> dict:
        if not os.path.isfile(path):
            raise MegatronPluginConfigError("load_state", path, "the checkpoint lacks this file: it is incomplete")
        try:
            saved = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            raise MegatronPluginConfigError(
                "load_state", path, f"cannot read this file ({type(err).__name__}: {err}): is it complete?") from None
        if not isinstance(saved, dict):
            raise MegatronPluginConfigError("load_state", path, "it holds no state dict: is the file damaged?")
        for key in [k for k in saved if re.fullmatch(r"model\d*", k)]:
            saved[key] = {self._our_name(k): v for k, v in saved[key].items()}
        return saved

    def _our_name(self, key: str) -> str:
        m = _LAYER.match(key)
        if m:
            for theirs, ours in self.renames.items():
                if m.group(2).startswith(theirs):
                    return m.group(1) + ours + m.group(2)[len(theirs):]
        return key

    def _files_of_stage(self, p: int, e: int = 0) -> List[dict]:
        if self._stage[0] != (p, e):
            self._stage = ((p, e), [])  # one stage (of one expert-parallel rank) in memory at a time
            self._stage = ((p, e), [self.first if (t, p, e) == (0, 0, 0) else self._read(t, p, e) for t in range(self.tp)])
            if (p, e) not in self._checked_stages:
                for t, saved in enumerate(self._stage[1]):
                    self._check_depth(saved, self._file(t, p, e))
                self._checked_stages.add((p, e))
        return self._stage[1]

    def get_slice(self, name: str):
        return TensorSlice(self.get(name))

    def get(self, name: str) -> torch.Tensor:
        rule, key, mcore_name, p, e, index = self._source[name]
        where = (p, e, key, mcore_name)
        if self._cache[0] != where:  # q/k/v of one fused tensor are asked for in turn: rebuild it once
            shards = []
            for t, saved in enumerate(self._files_of_stage(p, e)):
                tensors = saved.get(key) or {}
                if mcore_name not in tensors:
                    raise MegatronPluginConfigError(
                        "load_state", self._file(t, p, e), f"its {key!r} state dict lacks {mcore_name!r}: is it of this model?")
                shards.append(tensors[mcore_name])
            try:
                self._cache = (where, TRANSFORMS[rule.transform].to_hf(unshard(shards, rule), self.dims))
            except (RuntimeError, ValueError, IndexError) as err:  # shapes of another model: every rank must hear it
                raise MegatronPluginConfigError(
                    "load_state", self._file(0, p, e), f"its {mcore_name!r} does not fit this model "
                    f"({type(err).__name__}: {err})") from None
        return self._cache[1][index]

    def release_memory(self) -> None:
        self._stage, self._cache = ((), []), ((), [])
        self.first = {k: v for k, v in self.first.items() if not re.fullmatch(r"model\d*|optimizer", k)}


__all__ = ["LegacyReader", "load_legacy"]
