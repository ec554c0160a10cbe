"""HF <-> Megatron-Core parameter mapping, driven by tables of `Rule`s.

A model family lists, as data, which HF tensor(s) become which Megatron tensor, by which exact
transform, and along which dimension Megatron splits it over tensor-parallel ranks. The functions here
apply any such table: HF full tensors -> this rank's shards, and all ranks' shards -> HF full tensors.
Every transform is a pure re-arrangement (transpose, reshape, concatenation, zero padding), so a round
trip is bit-exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Dims:
    """The sizes transforms need."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int


@dataclass(frozen=True)
class Transform:
    """`to_mcore(hf_tensors, dims) -> tensor` and its inverse `to_hf(tensor, dims) -> hf_tensors`.

    `read_shard(views, rule, dims, tp_size, tp_rank) -> tensor or None` reads one TP rank's part of
    `to_mcore`'s result from lazily read views of the HF tensors (see `read_shard` below), so that a rank
    of a big model never holds a whole weight. It returns None where it cannot (e.g. fewer KV heads than
    ranks); None as the field means it never can. Either way the whole tensor is then read, transformed
    and sharded. Keeping the reader next to the transform means a new transform is added in one place.
    """

    to_mcore: Callable[[Sequence[torch.Tensor], Dims], torch.Tensor]
    to_hf: Callable[[torch.Tensor, Dims], List[torch.Tensor]]
    read_shard: Optional[Callable[..., Optional[torch.Tensor]]] = None


def _qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    # Megatron's fused QKV rows are grouped by key/value head: [q of the group's heads, k, v] per group,
    # so that a contiguous TP split gives each rank whole groups.
    rest = q.shape[1:]
    per_group = d.heads // d.groups
    q = q.reshape(d.groups, per_group * d.head_dim, *rest)
    k = k.reshape(d.groups, d.head_dim, *rest)
    v = v.reshape(d.groups, d.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _qkv_to_hf(t: torch.Tensor, d: Dims) -> List[torch.Tensor]:
    rest = t.shape[1:]
    per_group = d.heads // d.groups
    grouped = t.reshape(d.groups, (per_group + 2) * d.head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]


def _kv_to_mcore(k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    # Megatron's cross-attention linear_kv rows are [k, v] per head, so a TP split keeps whole heads.
    rest = k.shape[1:]
    k = k.reshape(d.heads, d.head_dim, *rest)
    v = v.reshape(d.heads, d.head_dim, *rest)
    return torch.cat([k, v], dim=1).reshape(-1, *rest).contiguous()


def _kv_to_hf(t: torch.Tensor, d: Dims) -> List[torch.Tensor]:
    rest = t.shape[1:]
    k, v = torch.split(t.reshape(d.heads, 2 * d.head_dim, *rest), [d.head_dim, d.head_dim], dim=1)
    return [x.reshape(-1, *rest).contiguous() for x in (k, v)]


def _pad_vocab(t: torch.Tensor, d: Dims) -> torch.Tensor:
    pad = t.new_zeros((d.padded_vocab - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _rows(view, lo: int, hi: int, dim: int = 0) -> torch.Tensor:
    return view[lo:hi] if dim == 0 else view[:, lo:hi]


def _local(d: Dims, groups: int, heads: int) -> Dims:
    return dataclasses.replace(d, groups=groups, heads=heads)


# Shard readers (`Transform.read_shard`): views of the rule's HF tensors -> this TP rank's part of the
# transformed tensor, bit for bit `shard(to_mcore(whole tensors))`, or None to fall back to exactly that.

def _read_copy(views, rule: "Rule", d: Dims, p: int, r: int) -> Optional[torch.Tensor]:
    if rule.tp_interleave != 1:
        return None
    n = views[0].get_shape()[rule.tp_dim]
    return _rows(views[0], r * n // p, (r + 1) * n // p, rule.tp_dim).contiguous()


def _read_vocab(views, rule: "Rule", d: Dims, p: int, r: int) -> Optional[torch.Tensor]:
    if rule.tp_dim != 0:
        return None
    per = d.padded_vocab // p
    lo, hi = r * per, (r + 1) * per
    # a rank past the true vocabulary holds padding only; the padding is made where the weights are
    # (an HF model already on the GPU gives CUDA tensors)
    real = views[0][lo:min(hi, d.vocab)] if lo < d.vocab else views[0][0:0]
    pad = real.new_zeros((hi - lo - real.shape[0], *real.shape[1:]))
    return torch.cat([real, pad], 0).contiguous()


def _read_conv1d(views, rule: "Rule", d: Dims, p: int, r: int) -> torch.Tensor:
    # HF [in, out]; Megatron [out, in]
    n = views[0].get_shape()[1 - rule.tp_dim]
    return _rows(views[0], r * n // p, (r + 1) * n // p, 1 - rule.tp_dim).t().contiguous()


def _read_qkv_split(views, rule: "Rule", d: Dims, p: int, r: int) -> Optional[torch.Tensor]:
    if d.groups % p != 0:
        return None
    g = d.groups // p
    per = d.heads // d.groups
    q = views[0][r * g * per * d.head_dim:(r + 1) * g * per * d.head_dim]
    k, v = (x[r * g * d.head_dim:(r + 1) * g * d.head_dim] for x in views[1:])
    return _qkv_to_mcore(q, k, v, _local(d, g, g * per))


def _read_qkv_conv1d(bias: bool):
    def read(views, rule: "Rule", d: Dims, p: int, r: int) -> Optional[torch.Tensor]:
        if d.groups != d.heads:
            return None
        h = d.heads * d.head_dim
        lo, hi = r * h // p, (r + 1) * h // p
        local = _local(d, d.heads // p, d.heads // p)
        if bias:
            q, k, v = (views[0][i * h + lo:i * h + hi] for i in range(3))
        else:
            q, k, v = (views[0][:, i * h + lo:i * h + hi].t() for i in range(3))
        return _qkv_to_mcore(q, k, v, local)

    return read


def _read_gate_up(views, rule: "Rule", d: Dims, p: int, r: int) -> Optional[torch.Tensor]:
    if rule.tp_interleave != 2 or rule.tp_dim != 0:
        return None
    n = views[0].get_shape()[0]
    return torch.cat([v[r * n // p:(r + 1) * n // p] for v in views], 0).contiguous()


def _read_kv_split(views, rule: "Rule", d: Dims, p: int, r: int) -> torch.Tensor:
    heads = d.heads // p
    k, v = (x[r * heads * d.head_dim:(r + 1) * heads * d.head_dim] for x in views)
    return _kv_to_mcore(k, v, _local(d, heads, heads))


TRANSFORMS: Dict[str, Transform] = {
    "copy": Transform(lambda ts, d: ts[0], lambda t, d: [t], _read_copy),
    # HF's Conv1D stores [in, out]; Megatron's linears store [out, in].
    "conv1d": Transform(lambda ts, d: ts[0].t().contiguous(), lambda t, d: [t.t().contiguous()], _read_conv1d),
    "vocab": Transform(lambda ts, d: _pad_vocab(ts[0], d), lambda t, d: [t[: d.vocab].contiguous()], _read_vocab),
    # GPT-2's c_attn: one Conv1D producing [q | k | v].
    "qkv_conv1d": Transform(
        lambda ts, d: _qkv_to_mcore(*ts[0].t().reshape(3, -1, ts[0].shape[0]).unbind(0), d),
        lambda t, d: [torch.cat(_qkv_to_hf(t, d), dim=0).t().contiguous()],
        _read_qkv_conv1d(bias=False),
    ),
    "qkv_conv1d_bias": Transform(
        lambda ts, d: _qkv_to_mcore(*ts[0].reshape(3, -1).unbind(0), d),
        lambda t, d: [torch.cat(_qkv_to_hf(t, d), dim=0)],
        _read_qkv_conv1d(bias=True),
    ),
    # Llama-style separate q/k/v projections (weights or biases).
    "qkv_split": Transform(lambda ts, d: _qkv_to_mcore(*ts, d), _qkv_to_hf, _read_qkv_split),
    # separate k/v projections of a cross-attention -> Megatron's fused linear_kv
    "kv_split": Transform(lambda ts, d: _kv_to_mcore(*ts, d), _kv_to_hf, _read_kv_split),
    # Llama-style gate/up projections -> Megatron's fused fc1 of a gated MLP, split per TP rank below.
    "gate_up": Transform(lambda ts, d: torch.cat(ts, dim=0), lambda t, d: list(torch.chunk(t, 2, dim=0)),
                         _read_gate_up),
}


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor and where it comes from.

    `hf` names may hold `{i}` (a global layer index; `mcore` then uses the stage-local index) and, in a
    'layer' rule, `{e}` (the HF global expert index; `mcore` then uses the index among this expert-parallel
    rank's experts, see `StagePlan.with_experts`).
    `tp_dim` is the Megatron dimension split over TP ranks (None: replicated).
    `stage` is 'layer', 'first' (embeddings), 'last' (final norm, output layer), 'tied_output' (the
    last stage's copy of tied embeddings when it is not also the first stage: loaded, never exported)
    or 'whole' (a model that is not split over pipeline stages: T5).
    `tp_interleave`: the tensor is a concatenation of this many equal parts, each split over TP on its
    own (Megatron's fused gate/up fc1 of a gated MLP).
    `layers`: the global layer indices a 'layer' rule applies to (None: every layer), for models whose
    layers differ (an MoE model's dense layers). A rule with `{e}` is split over the EXPERT tensor-parallel
    ranks (Megatron-Core's `expert_tensor_parallel_size`), every other over the tensor-parallel ranks.
    """

    hf: Tuple[str, ...]
    mcore: str
    transform: str = "copy"
    tp_dim: Optional[int] = None
    stage: str = "layer"
    tp_interleave: int = 1
    layers: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.transform not in TRANSFORMS:
            raise KeyError(f"unknown transform {self.transform!r}")
        if self.stage not in ("layer", "first", "last", "tied_output", "whole"):
            raise ValueError(f"stage={self.stage!r}")
        if self.per_expert and self.stage != "layer":
            raise ValueError(f"an expert index {{e}} needs stage='layer', not {self.stage!r}")

    @property
    def per_expert(self) -> bool:
        """One tensor per expert (the names hold `{e}`)."""
        return any("{e}" in n for n in (*self.hf, self.mcore))


@dataclass(frozen=True)
class StagePlan:
    """Which layers and end pieces one pipeline stage holds, and which experts of each MoE layer (none by
    default): the global experts `expert_offset .. expert_offset + num_local_experts - 1`, the ones this
    expert-parallel rank holds as its local experts 0, 1, ..."""

    first: bool
    last: bool
    layer_offset: int
    num_layers: int
    num_experts: int = 0
    expert_offset: int = 0
    num_local_experts: int = 0

    @classmethod
    def single(cls, num_layers: int) -> "StagePlan":
        return cls(first=True, last=True, layer_offset=0, num_layers=num_layers)

    @classmethod
    def for_rank(cls, num_layers: int, pp_size: int, pp_rank: int, vp_stage: int = 0, vp_size: int = 1,
                 last_stage_layers: Optional[int] = None) -> "StagePlan":
        """Layers split evenly; with virtual stages, chunk `vp_stage` of rank r holds the layers of
        global stage vp_stage * pp_size + r (Megatron's interleaved layout). `last_stage_layers`
        (decoder_last_pipeline_num_layers, mcore's num_layers_in_last_pipeline_stage): the last stage holds
        that many layers, the others split the rest evenly, in order (mcore's get_transformer_layer_offset)."""
        if last_stage_layers is not None and pp_size > 1:
            if vp_size != 1:
                raise ValueError("an uneven last pipeline stage is not mapped with virtual pipeline stages")
            rest = num_layers - last_stage_layers
            if last_stage_layers < 1 or rest < pp_size - 1 or rest % (pp_size - 1):
                raise ValueError(f"{num_layers} layers with {last_stage_layers} on the last of {pp_size} stages "
                                 "leave the others no even split")
            per = rest // (pp_size - 1)
            last = pp_rank == pp_size - 1
            return cls(first=pp_rank == 0, last=last, layer_offset=pp_rank * per,
                       num_layers=last_stage_layers if last else per)
        per = num_layers // (pp_size * vp_size)
        stage = vp_stage * pp_size + pp_rank
        return cls(first=stage == 0, last=stage == pp_size * vp_size - 1, layer_offset=stage * per, num_layers=per)

    def with_experts(self, num_experts: int, ep_size: int = 1, ep_rank: int = 0) -> "StagePlan":
        """This plan for an MoE model: experts split evenly over `ep_size` ranks in rank order, as
        Megatron-Core's MoE layer splits them (`BaseMoELayer.local_expert_indices`)."""
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {ep_size} expert-parallel ranks")
        per = num_experts // ep_size
        return dataclasses.replace(self, num_experts=num_experts, expert_offset=ep_rank * per, num_local_experts=per)

    @property
    def ep_size(self) -> int:
        """How many expert-parallel ranks share the experts (1 without experts)."""
        return self.num_experts // self.num_local_experts if self.num_local_experts else 1

    def of_expert_rank(self, ep_rank: int) -> "StagePlan":
        """The same stage as expert-parallel rank `ep_rank` holds it: its `expand` yields the same tensors
        in the same order, named for that rank's experts (gathering experts names them through it)."""
        return dataclasses.replace(self, expert_offset=ep_rank * self.num_local_experts)

    def experts(self, rule: Rule) -> List[Tuple[Optional[int], Optional[int]]]:
        """(HF global, Megatron local) expert index pairs a rule expands over: one (None, None) for a rule
        without `{e}`, so that the names format as they always did."""
        if not rule.per_expert:
            return [(None, None)]
        if not self.num_experts:
            raise ValueError(f"{rule.mcore!r} is per expert, but the plan has no experts (see StagePlan.with_experts)")
        return [(self.expert_offset + j, j) for j in range(self.num_local_experts)]


def expand(rules: Iterable[Rule], plan: StagePlan) -> Iterator[Tuple[Rule, Tuple[str, ...], str]]:
    """(rule, concrete HF names, concrete Megatron name) for every tensor of the stage."""
    for rule in rules:
        if rule.stage == "layer":
            for local in range(plan.num_layers):
                i = plan.layer_offset + local
                if rule.layers is not None and i not in rule.layers:
                    continue
                for e, local_e in plan.experts(rule):
                    yield rule, tuple(n.format(i=i, e=e) for n in rule.hf), rule.mcore.format(i=local, e=local_e)
        elif (
            (rule.stage == "first" and plan.first)
            or (rule.stage == "last" and plan.last)
            or (rule.stage == "tied_output" and plan.last and not plan.first)
            or (rule.stage == "whole" and plan.first and plan.last)
        ):
            yield rule, rule.hf, rule.mcore


def shard(full: torch.Tensor, rule: Rule, tp_size: int, tp_rank: int) -> torch.Tensor:
    if rule.tp_dim is None or tp_size == 1:
        return full.contiguous()
    parts = torch.chunk(full, rule.tp_interleave, dim=rule.tp_dim)
    return torch.cat([torch.chunk(p, tp_size, dim=rule.tp_dim)[tp_rank] for p in parts], dim=rule.tp_dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], rule: Rule) -> torch.Tensor:
    """Inverse of `shard` given every TP rank's piece in rank order."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    split = [torch.chunk(s, rule.tp_interleave, dim=rule.tp_dim) for s in shards]
    parts = [torch.cat([s[j] for s in split], dim=rule.tp_dim) for j in range(rule.tp_interleave)]
    return torch.cat(parts, dim=rule.tp_dim)


def hf_to_mcore(
    get_slice: Callable[[str], object],
    rules: Sequence[Rule],
    dims: Dims,
    plan: StagePlan,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (Megatron name, this rank's tensor), one rule at a time, reading through `get_slice(name)`
    (see `read_shard`) only this rank's part of each HF tensor where the transform allows it."""
    for rule, hf_names, mcore_name in expand(rules, plan):
        yield mcore_name, read_shard(get_slice, rule, hf_names, dims, tp_size, tp_rank)


def mcore_to_hf(
    get_shards: Callable[[str, Rule], Sequence[torch.Tensor]],
    rules: Sequence[Rule],
    dims: Dims,
    plan: StagePlan,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) from every TP rank's shards of each Megatron tensor."""
    for rule, hf_names, mcore_name in expand(rules, plan):
        if rule.stage == "tied_output":
            continue
        full = unshard(get_shards(mcore_name, rule), rule)
        for name, tensor in zip(hf_names, TRANSFORMS[rule.transform].to_hf(full, dims)):
            yield name, tensor


class TensorSlice:
    """The `get_slice` interface (`.get_shape()`, `[a:b]`) over a tensor already in memory, so that
    `read_shard` reads a live HF state dict the way it reads a safetensors file."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]


def read_shard(get_slice: Callable[[str], object], rule: Rule, hf_names: Sequence[str], dims: Dims,
               tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's tensor of `rule`, reading only its part of each HF tensor where the transform
    allows it (`get_slice(name)` gives a lazily read view: `.get_shape()` and `[a:b]` / `[:, a:b]`), so a
    rank of a big model never holds a whole weight. Equal, bit for bit, to `shard(full transform)`.
    The transform's own `read_shard` knows how; this only dispatches."""
    views = [get_slice(n) for n in hf_names]
    transform = TRANSFORMS[rule.transform]
    if rule.tp_dim is None or tp_size == 1:
        return transform.to_mcore([v[:] for v in views], dims)
    if transform.read_shard is not None:
        part = transform.read_shard(views, rule, dims, tp_size, tp_rank)
        if part is not None:
            return part
    # anything else (e.g. fewer KV heads than ranks): the whole tensor, then this rank's part
    return shard(transform.to_mcore([v[:] for v in views], dims), rule, tp_size, tp_rank)
