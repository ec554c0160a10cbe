"""Move weights between an HF model and the Megatron-Core model of this rank."""

from __future__ import annotations

import re
import warnings
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from . import ModelFamily
from .gpt import padded_vocab_size
from ..errors import MegatronPluginConfigError
from .mapping import TRANSFORMS, Dims, StagePlan, expand, mcore_to_hf, read_shard, unshard

# HF tensors that are not weights (buffers some transformers versions keep in state dicts)
_IGNORED_HF = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def model_dims(family: ModelFamily, hf_config, divisible_by: int, tp: int) -> Dims:
    return family.dims(hf_config, padded_vocab_size(hf_config.vocab_size, divisible_by, tp))


def _mcore_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    # TE modules add `_extra_state` entries (fp8 metadata); they are not weights.
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


def normalize_hf_state_dict(hf_state: Dict[str, torch.Tensor], family: ModelFamily, variant: str):
    """Name HF tensors as the mapping table does (a base model's `wte.weight` -> `transformer.wte.weight`)."""
    prefix = family.prefix(variant)
    return {prefix + k: v for k, v in hf_state.items()} if prefix else hf_state


@torch.no_grad()
def load_hf_into_mcore(
    model: torch.nn.Module,
    get_slice: Callable[[str], object],
    hf_names,
    family: ModelFamily,
    hf_config,
    plan: StagePlan,
    dims: Dims,
    *,
    variant: str,
    tp_size: int,
    tp_rank: int,
    extra_tensors: str = "raise",
    etp_size: Optional[int] = None,
    etp_rank: Optional[int] = None,
) -> None:
    """Fill every parameter of `model` (one TP/PP rank) from HF tensors, read through `get_slice(name)`
    (a lazily read view, `mapping.read_shard`; `TensorSlice` over a tensor in memory). Raises if any
    Megatron parameter stays unfilled or any HF weight is left unused, so a mapping gap can't pass
    silently, or if a tensor's shape does not fit (naming it). Experts (rules with `{e}`, those of `plan`'s
    expert-parallel rank only) are split over the expert tensor-parallel ranks `etp_size`/`etp_rank`
    (default: the tensor-parallel ones)."""
    etp_size, etp_rank = (tp_size, tp_rank) if etp_size is None else (etp_size, etp_rank)
    target = _mcore_state(model)
    rules = family.table(hf_config, variant)
    filled, used = set(), set()

    def get_and_track(name):
        used.add(name)
        return get_slice(name)

    for rule, sources, name in expand(rules, plan):
        try:
            p, r = (etp_size, etp_rank) if rule.per_expert else (tp_size, tp_rank)
            tensor = read_shard(get_and_track, rule, sources, dims, p, r)
        except MegatronPluginConfigError:
            raise
        except (RuntimeError, ValueError, IndexError) as err:  # a source of another shape than the config says
            raise MegatronPluginConfigError(
                "checkpoint", sources, f"cannot build {name} from these HF tensors ({err}): the checkpoint does not "
                "match the model's config",
            ) from None
        if name not in target:
            raise KeyError(f"mapping names Megatron tensor {name!r}, which the model does not have")
        dest = target[name]
        if dest.shape != tensor.shape:
            raise MegatronPluginConfigError(
                "checkpoint", sources, f"gives {name} the shape {tuple(tensor.shape)}, but the model's config makes it "
                f"{tuple(dest.shape)}: the checkpoint is of another model size",
            )
        dest.copy_(tensor)
        filled.add(name)
    missing = sorted(set(target) - filled)
    if missing:
        raise KeyError(f"Megatron tensors not filled from the HF checkpoint: {missing}")
    # Any HF weight the mapping never names (for any stage) would be silently dropped: refuse instead.
    mapped = family.mapped_hf_names(hf_config, variant)
    aliases = family.tied_aliases(hf_config, variant)  # tied copies of a mapped tensor
    unused = sorted(n for n in hf_names if n not in mapped and n not in aliases and not _IGNORED_HF.search(n))
    if unused and extra_tensors == "raise":
        raise MegatronPluginConfigError(
            "model", f"{len(unused)} unmapped tensors, e.g. {unused[:3]}",
            f"the {family.name} mapping does not use them, and dropping weights silently would train another "
            "model: this variant or feature is not supported",
        )
    if unused:  # a checkpoint with more heads than the model built from it (as from_pretrained, warn)
        warnings.warn(f"checkpoint tensors this {family.name} model does not use: {unused[:8]}")


@torch.no_grad()
def iter_hf_tensors(
    model: torch.nn.Module,
    family: ModelFamily,
    hf_config,
    plan: StagePlan,
    dims: Dims,
    *,
    variant: str,
    grads: bool = False,
    group: Optional[dist.ProcessGroup] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors, one Megatron tensor's worth at a time: its TP shards all-gathered and
    converted (names as in the mapping table; strip `family.prefix(variant)` for the variant's own). With
    `grads`, the parameters' gradients. An MoE model's experts are gathered over the expert
    tensor-parallel group, then over the expert-parallel group, so every rank gets every expert (in
    expert-parallel rank order after each local expert). Call on every rank of the TP group (and, with
    experts split over ranks, of the expert-model-parallel group), consuming it to the end."""
    group = group or parallel_state.get_tensor_model_parallel_group()
    local = _mcore_state(model)
    rules = family.table(hf_config, variant)
    ep = plan.ep_size
    has_experts = any(rule.per_expert for rule in rules)
    expert_tp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False) if has_experts else None
    expert_tp_group = expert_tp_group or group
    ep_group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None

    def tensor(name):
        return (local[name].grad if grads else local[name]).detach().contiguous()

    def gather(mine, g):
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(g))]
        dist.all_gather(parts, mine, group=g)
        return parts

    def shards(name, rule):
        g = expert_tp_group if rule.per_expert else group
        mine = tensor(name)
        if dist.get_world_size(g) == 1 or rule.tp_dim is None:
            return [mine]
        return gather(mine, g)

    if ep == 1:
        yield from mcore_to_hf(shards, rules, dims, plan)
        return
    others = [list(expand(rules, plan.of_expert_rank(r))) for r in range(ep)]
    for k, (rule, hf_names, mcore_name) in enumerate(expand(rules, plan)):
        if rule.stage == "tied_output":
            continue
        full = unshard(shards(mcore_name, rule), rule)
        per_rank = gather(full.contiguous(), ep_group) if rule.per_expert else [full]
        for r, t in enumerate(per_rank):
            names = others[r][k][1] if rule.per_expert else hf_names
            yield from zip(names, TRANSFORMS[rule.transform].to_hf(t, dims))


def gather_hf_state_dict(model, family, hf_config, plan, dims, *, variant, grads=False, group=None) -> Dict[str, torch.Tensor]:
    """All of `iter_hf_tensors` as a dict."""
    return dict(iter_hf_tensors(model, family, hf_config, plan, dims, variant=variant, grads=grads, group=group))


def hf_tensor_headers(family: ModelFamily, hf_config, plan: StagePlan, dims: Dims, variant: str, tp: int,
                      local: Dict[str, torch.Tensor], expert_tp: Optional[int] = None) -> list:
    """[(HF name, shape, dtype)] of what `iter_hf_tensors` yields for this stage, in order, without
    gathering anything (the transforms run on meta tensors). `expert_tp`: the expert tensor-parallel size
    (default: megatron-core's, once its groups exist, else `tp`)."""
    if expert_tp is None:
        initialized = parallel_state.get_expert_tensor_parallel_group(check_initialized=False) is not None
        expert_tp = parallel_state.get_expert_tensor_parallel_world_size() if initialized else tp
    rules = family.table(hf_config, variant)
    others = [list(expand(rules, plan.of_expert_rank(r))) for r in range(plan.ep_size)]
    out = []
    for k, (rule, hf_names, mcore_name) in enumerate(expand(rules, plan)):
        if rule.stage == "tied_output":
            continue
        shape = list(local[mcore_name].shape)
        if rule.tp_dim is not None:
            shape[rule.tp_dim] *= expert_tp if rule.per_expert else tp
        full = torch.empty(shape, dtype=local[mcore_name].dtype, device="meta")
        for names in ([o[k][1] for o in others] if rule.per_expert else [hf_names]):
            for name, t in zip(names, TRANSFORMS[rule.transform].to_hf(full, dims)):
                out.append((name, tuple(t.shape), t.dtype))
    return out


def mcore_to_hf_sources(family: ModelFamily, hf_config, plan: StagePlan, variant: str) -> Dict[str, tuple]:
    """Megatron parameter name -> the HF parameters it is made from (q, k and v for a fused QKV), named
    as in the HF model the user passed (base models without `family.base_prefix`; a live transformers-5 MoE
    model's stacked expert parameters, `family.live_name`)."""
    rules = family.table(hf_config, variant)
    strip = len(family.prefix(variant))
    return {mcore_name: tuple(dict.fromkeys(family.live_name(n)[strip:] for n in hf_names))
            for _, hf_names, mcore_name in expand(rules, plan)}
