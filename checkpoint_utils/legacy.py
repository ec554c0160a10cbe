"""Megatron-LM's legacy `torch` checkpoints: one `model_optim_rng.pt` per (TP, PP, EP) rank,
`iter_N/mp_rank_TT[_PPP][_EEE]/` (_EEE: an MoE model's expert-parallel rank, whose file holds its own experts),
each holding that rank's module `state_dict()` under 'model' ('model0', 'model1', ... with virtual pipeline
stages) and Megatron-LM's entries (iteration, checkpoint_version, args). Layers are numbered within the
stage; each rank holds its TP part of every split tensor.

Writing goes rank by rank through the mapping table, so memory stays near one rank's tensors. Reading
keeps the files of one pipeline stage open (memory-mapped) and concatenates the TP parts of one tensor
at a time. Optimizer and RNG state are not written: the checkpoints are model-only, as Megatron-LM's
own converters write them (Megatron-LM skips both for a release checkpoint).
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

import torch

from megatron_plugin.engine.checkpointing.megatron_lm_layout import first_legacy_file, legacy_dirs, legacy_file
from megatron_plugin.engine.checkpointing.megatron_lm_state import CHECKPOINT_VERSION, ENTRY, model_key
from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.models.mapping import StagePlan, hf_to_mcore, unshard

from .mapped_reader import MappedReader
from .megatron_lm_args import model_of
from .megatron_lm_layout import iteration_of_tag, verify
from .megatron_lm_names import layer_indices, split_layer, state_dict_names


def write(reader, ckpt: str, *, tp: int, pp: int, dims, params_dtype: torch.dtype, iteration: int, args, entry: dict,
          on_file=None, progress=None, ep: int = 1) -> None:
    """One model_optim_rng.pt per (TP, PP, EP) rank into the new folder `ckpt`; `on_file(path, tensors)` after
    each. As Megatron-LM saves an MoE model: each expert-parallel rank's file holds the dense tensors (its TP
    shard) and its own experts under their local index (expert TP = TP)."""
    rules = reader.family.table(reader.config, reader.variant)
    num_layers = reader.family.num_layers(reader.config)
    for pp_rank in range(pp):
        stage = StagePlan.for_rank(num_layers, pp, pp_rank)
        for e in range(ep):
            plan = reader.family.plan_with_experts(reader.config, stage, ep, e)
            for t in range(tp):
                tensors = {name: x.to(params_dtype).contiguous()
                           for name, x in hf_to_mcore(reader.get_slice, rules, dims, plan, tp, t)}
                path = legacy_file(ckpt, t, pp_rank, pp, e, ep)
                os.makedirs(os.path.dirname(path))
                torch.save({"model": tensors, "iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                            "args": args, ENTRY: entry}, path)
                if on_file is not None:
                    on_file(path, tensors)
                del tensors
                if progress is not None:
                    progress()


def _load(path: str, setting: str) -> dict:
    try:
        try:  # memory-mapped: only the tensors asked for are read
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # a file of torch's old (non-zip) serialization cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise MegatronPluginConfigError(setting, path, f"cannot read this file ({err}): is it complete?") from None
    if not isinstance(state, dict) or not any(re.fullmatch(r"model\d*", str(k)) for k in state):
        raise MegatronPluginConfigError(setting, path, "holds no 'model' state dict: is it a Megatron-LM checkpoint?")
    return state


def _chunks(state: dict) -> int:
    """How many model chunks (virtual pipeline stages) a rank's file holds."""
    if "model" in state:
        return 1
    return sum(1 for k in state if re.fullmatch(r"model\d+", str(k)))


class LegacyReader(MappedReader):
    """A legacy checkpoint folder (one iteration's, with mp_rank_* folders) as HF tensors."""

    def __init__(self, ckpt: str, hf_config: Optional[str] = None, setting: str = "--load_path"):
        self.ckpt = ckpt
        self.setting = setting
        verify(ckpt, setting)
        first_file = first_legacy_file(ckpt)
        if first_file is None or not os.path.exists(first_file):
            raise MegatronPluginConfigError(setting, ckpt, "the checkpoint lacks rank 0's mp_rank_00* file: it is incomplete")
        first = _load(first_file, setting)
        args = first.get("args")
        sizes = {k: getattr(args, k, None) for k in ("pipeline_model_parallel_size", "expert_model_parallel_size")}
        ranks = legacy_dirs(ckpt, pipeline=(sizes["pipeline_model_parallel_size"] or 1) > 1,
                            expert=(sizes["expert_model_parallel_size"] or 1) > 1)
        self.tp, self.pp, self.ep = (1 + max(r[i] for r in ranks) for i in range(3))
        self.files = {(t, p, e): legacy_file(ckpt, t, p, self.pp, e, self.ep)
                      for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        for file in self.files.values():
            if not os.path.exists(file):
                raise MegatronPluginConfigError(
                    setting, ckpt, f"the checkpoint lacks {os.path.relpath(file, ckpt)}: it is incomplete")
        config, family, variant, self.make_vocab_size_divisible_by = model_of(first, hf_config, ckpt)
        etp = getattr(args, "expert_tensor_parallel_size", None)
        if etp not in (None, self.tp) and getattr(args, "num_experts", None):
            raise MegatronPluginConfigError(
                setting, ckpt, f"its experts are split over expert_tensor_parallel_size={etp} ranks, but its folders are "
                f"named by the {self.tp} tensor-parallel ranks only: convert it with Megatron-LM to torch_dist first")
        experts = family.num_experts(config)
        if self.ep > 1 and (not experts or experts % self.ep):
            raise MegatronPluginConfigError(
                setting, ckpt, f"it holds {self.ep} expert-parallel ranks' folders, which the HF config's "
                f"{experts or 'no'} experts do not split over: is the HF config this model's?")
        iteration = first.get("iteration")
        self.meta = {"iteration": int(iteration) if isinstance(iteration, int) else iteration_of_tag(ckpt)}
        self.vpp = _chunks(first)
        num_layers = family.num_layers(config)
        if num_layers % (self.pp * self.vpp):
            raise MegatronPluginConfigError(
                setting, ckpt, f"{self.pp} pipeline stages x {self.vpp} chunks do not split the HF config's {num_layers} "
                "layers evenly: is the HF config this model's? (uneven stages are not read)")
        plans = [(p, v, family.plan_with_experts(config, StagePlan.for_rank(num_layers, self.pp, p, v, self.vpp), self.ep, e),
                  e) for p in range(self.pp) for v in range(self.vpp) for e in range(self.ep)]
        super().__init__(config, family, variant, plans, setting, ckpt)
        self._stage: Dict[tuple, list] = {}
        self._names: Dict[tuple, str] = {}
        by_stage: Dict[tuple, list] = {}
        for _, name, p, v, e in self.sources():
            by_stage.setdefault((p, v, e), []).append(name)
        for p in range(self.pp):  # every tensor there, stages of the config's depth, before anything is written
            for e in range(self.ep):
                states = self._states(p, e)
                for v in range(self.vpp):
                    names = by_stage.get((p, v, e), [])
                    for t, state in enumerate(states):
                        model = state.get(self._chunk_key(v))
                        if not isinstance(model, dict):
                            raise MegatronPluginConfigError(
                                setting, self.files[(t, p, e)], f"has no {self._chunk_key(v)!r} state dict, as the "
                                "first rank's file has: the ranks' files are of different checkpoints")
                        # every expert-parallel rank's file holds the stage's layers (rank 0's names name them all)
                        self._check_depth(model, by_stage.get((p, v, 0), []), self.files[(t, p, e)])
                        for name in names:
                            found = next((n for n in state_dict_names(name) if n in model), None)
                            if found is None:
                                raise MegatronPluginConfigError(
                                    setting, self.files[(t, p, e)], f"has no tensor {name!r}: is it of this HF model "
                                    f"({family.name}, variant {variant!r})?")
                            self._names[(name, p, v, e)] = found

    def _chunk_key(self, v: int) -> str:
        return model_key(v, self.vpp)

    def _check_depth(self, model: dict, names, path: str) -> None:
        """A stage holding more layers than the HF config gives it (another model, or uneven stages)
        would otherwise convert with layers missing."""
        for stack in {split_layer(n)[0] for n in names if split_layer(n) is not None}:
            expected, got = len(layer_indices(names, stack)), len(layer_indices(model, stack))
            if got != expected:
                raise MegatronPluginConfigError(
                    self.setting, path, f"holds {got} layers in {stack}, the HF config gives this stage {expected}: is "
                    "the HF config this model's? (uneven pipeline stages are not read)")

    def _states(self, pp_rank: int, ep_rank: int = 0) -> list:
        """The TP ranks' files of one stage and expert-parallel rank (one open at a time)."""
        if (pp_rank, ep_rank) not in self._stage:
            self._stage = {}
            self._stage[(pp_rank, ep_rank)] = [_load(self.files[(t, pp_rank, ep_rank)], self.setting)
                                               for t in range(self.tp)]
        return self._stage[(pp_rank, ep_rank)]

    def _read(self, rule, mcore_name: str, pp: int, vp: int, ep: int = 0) -> torch.Tensor:
        found = self._names[(mcore_name, pp, vp, ep)]
        shards = [state[self._chunk_key(vp)][found] for state in self._states(pp, ep)]
        return unshard(shards, rule)
