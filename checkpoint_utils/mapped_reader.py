"""HF tensors rebuilt from a Megatron checkpoint through the family's mapping table. The readers of
Megatron-LM's formats (torch_dist.py, legacy.py) say only how to read one Megatron tensor whole; the
names, the inverse transforms and their checks are here, shared."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.models.convert import model_dims
from megatron_plugin.models.mapping import TRANSFORMS, Rule, TensorSlice, expand


class MappedReader:
    """`names`, `get(name)` and `get_slice(name)` over HF tensor names, the interface of hf_io's readers.
    Subclasses implement `_read(rule, mcore_name, pp, vp, ep) -> the whole (TP-unsharded) Megatron tensor`.
    `plans`: (pp, vp, plan) or (pp, vp, plan, ep rank) per stage (and expert-parallel rank, whose plan holds its
    experts): an expert-parallel rank other than 0 gives only its experts' tensors."""

    def __init__(self, config, family, variant: str, plans: List[tuple], setting: str, where: str):
        self.config, self.family, self.variant = config, family, variant
        self.setting, self.where = setting, where
        # the inverse transforms need head counts, not the padded vocabulary: any padding reads back
        self.dims = model_dims(family, config, 1, 1)
        self._source: Dict[str, tuple] = {}
        for pp, vp, plan, *ep in plans:
            ep = ep[0] if ep else 0
            for rule, hf_names, mcore_name in expand(family.table(config, variant), plan):
                if rule.stage == "tied_output" or (ep and not rule.per_expert):  # HF has each tensor once
                    continue
                for i, n in enumerate(hf_names):
                    self._source[n] = (rule, mcore_name, pp, vp, ep, i)
        self.names = list(self._source)
        self._cache: Tuple[object, List[torch.Tensor]] = (None, [])

    def sources(self):
        """The distinct (rule, Megatron name, pp, vp, ep) the HF tensors come from."""
        seen = {}
        for rule, mcore_name, pp, vp, ep, _ in self._source.values():
            seen[(mcore_name, pp, vp, ep)] = rule
        return [(rule, name, pp, vp, ep) for (name, pp, vp, ep), rule in seen.items()]

    def _read(self, rule: Rule, mcore_name: str, pp: int, vp: int, ep: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def get_slice(self, name: str):
        return TensorSlice(self.get(name))

    def get(self, name: str) -> torch.Tensor:
        rule, mcore_name, pp, vp, ep, index = self._source[name]
        key = (mcore_name, pp, vp, ep)
        if self._cache[0] != key:  # q, k and v of one fused tensor are asked for in turn: rebuild it once
            full = self._read(rule, mcore_name, pp, vp, ep)
            if rule.transform == "vocab" and full.shape[0] < self.dims.vocab:
                raise MegatronPluginConfigError(
                    self.setting, self.where, f"{mcore_name} has {full.shape[0]} rows, fewer than the HF config's "
                    f"vocabulary of {self.dims.vocab}: is the HF config this model's?")
            try:
                self._cache = (key, TRANSFORMS[rule.transform].to_hf(full, self.dims))
            except (RuntimeError, ValueError) as err:
                raise MegatronPluginConfigError(
                    self.setting, self.where, f"{mcore_name} of shape {tuple(full.shape)} does not fit the HF config "
                    f"({err}): is the HF config this model's?") from None
        return self._cache[1][index]
