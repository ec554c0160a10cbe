"""peft's LoRA on the Megatron twin: what a `PeftModel` asks for (`LoraSpec`, refusals by name), adapters
on this rank's linears (`attach_lora`), peft's tensors in and out (`load_lora`, `lora_hf_state_dict`), the
adapter folder peft loads (`save_adapter`) and merged HF weights (`merged_hf_weights`).

Names on the HF side are peft's, as `peft.get_peft_model_state_dict` gives them:
`base_model.model.<HF module path>.lora_A.weight` / `.lora_B.weight`, and a `modules_to_save` module's
tensors under its plain HF name (`base_model.model.lm_head.weight`). On the Megatron side an adapter is
`<linear>.lora_adapters.<HF leaf name>.lora_A` / `.lora_B` (layers/lora.py).
"""

from __future__ import annotations

import sys

import copy
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.lora import LoRAAdapter, attach, mark_sequence_parallel, set_fused_layout
from . import get_family
from .lora_targets import FAMILY_TARGETS, LoraTarget
from .mapping import TRANSFORMS, TensorSlice, expand, read_shard, unshard

PEFT_PREFIX = "base_model.model."
# LoraConfig fields whose non-default values change the model in ways the Megatron twin does not carry
_UNSUPPORTED_OPTIONS = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) is not mapped: use plain LoRA (use_dora=False)"),
    "lora_bias": (False, "LoRA biases on lora_B are not mapped: set lora_bias=False"),
    "use_qalora": (False, "QA-LoRA is not mapped: set use_qalora=False"),
    "use_bdlora": (False, "block-diagonal LoRA is not mapped: set use_bdlora=False"),
    "layer_replication": (None, "layer replication is not mapped: leave layer_replication unset"),
    "trainable_token_indices": (None, "trainable token embeddings are not mapped: leave trainable_token_indices "
                                      "unset (or put the embedding in modules_to_save)"),
    "target_parameters": (None, "adapters on raw parameters (MoE experts) are not mapped: target modules"),
    "alora_invocation_tokens": (None, "activated LoRA is not mapped: leave alora_invocation_tokens unset"),
}


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA a peft model asks for, as the Megatron side carries it.

    `target_modules`: HF module leaf names (sorted) peft put adapters on; `layer_targets`: their paths
    inside a decoder layer ('self_attn.q_proj', 'mlp.c_proj'), which tell GPT-2's two `c_proj`s apart (an MoE
    family's: those of its dense and MoE layers together, `targets(kind)` those of one kind);
    `modules_to_save`: peft's names of the fully trained modules; `peft_config`: the LoraConfig, written
    back as adapter_config.json; `family`: the model family's name."""

    r: int
    alpha: float
    dropout: float
    target_modules: Tuple[str, ...]
    use_rslora: bool = False
    modules_to_save: Tuple[str, ...] = ()
    adapter_name: str = "default"
    peft_config: Any = None
    layer_targets: Tuple[str, ...] = ()
    family: str = ""

    @property
    def scaling(self) -> float:
        """peft's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (self.r ** 0.5) if self.use_rslora else self.alpha / self.r

    def targets(self, kind: Optional[str] = None) -> List[LoraTarget]:
        """The family table's entries for `layer_targets`; with `kind` ('dense' or 'moe', `layer_kind`), those a
        layer of that kind holds."""
        _, table = FAMILY_TARGETS[self.family]
        return [table[t] for t in self.layer_targets if kind is None or table[t].layers in (None, kind)]


def layer_kind(family, hf_config, i: int) -> str:
    """'moe' for global layer `i` of an MoE family whose MLP is an MoE block, else 'dense'."""
    if not family.num_experts(hf_config):
        return "dense"
    from .moe import moe_layers

    return "moe" if moe_layers(hf_config)[i] else "dense"


def is_peft_model(model) -> bool:
    if "peft" not in sys.modules:  # a PeftModel cannot exist before peft is imported: plain runs skip the import
        return False
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _lora_layer_class():
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _layer_pattern(family, variant: str) -> "re.Pattern":
    """A regex matching an HF module path of a decoder layer: (layer index, path inside the layer)."""
    prefix, _ = FAMILY_TARGETS[family.name]
    strip = family.prefix(variant)
    if strip and prefix.startswith(strip):
        prefix = prefix[len(strip):]
    return re.compile("^" + re.escape(prefix).replace(re.escape("{i}"), r"(\d+)") + r"(.+)$")


def _uniform(pattern: dict, default, setting: str):
    values = set(pattern.values()) if pattern else set()
    if values and values != {default}:
        raise MegatronPluginConfigError(
            setting, dict(pattern), "a rank or alpha per module is not mapped: use one r and lora_alpha for every target")


def lora_spec_of(peft_model) -> LoraSpec:
    """The `LoraSpec` of a peft model, refusing what the Megatron twin does not carry, by the setting's
    name (`MegatronPluginConfigError`), before any distributed work: another PEFT method, several adapters,
    a bias other than 'none', DoRA and the other LoRA variants, per-module ranks, adapters on some layers
    only, targets the family's table does not map (an MoE model's routed experts among them)."""
    if not is_peft_model(peft_model):
        raise MegatronPluginConfigError("model", type(peft_model).__name__, "pass a peft.PeftModel (get_peft_model)")
    configs = dict(peft_model.peft_config)
    if len(configs) != 1:
        raise MegatronPluginConfigError(
            "peft_config", sorted(configs), "one adapter per model is mapped: delete the others (delete_adapter) first")
    (name, config), = configs.items()
    kind = getattr(config.peft_type, "value", config.peft_type)
    if kind != "LORA":
        raise MegatronPluginConfigError("peft_type", kind, "only LoRA (peft.LoraConfig) is mapped")
    if config.bias != "none":
        raise MegatronPluginConfigError("bias", config.bias, "set bias='none': trained base biases are not mapped")
    for field, (default, fix) in _UNSUPPORTED_OPTIONS.items():
        value = getattr(config, field, default)
        if value and value != default:  # unset reads as None, False or an empty collection
            raise MegatronPluginConfigError(field, value, fix)
    init = getattr(config, "init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        # pissa, olora, corda, eva, loftq rewrite the base weights in get_peft_model: the adapter folder then needs
        # peft's conversion to load against the original base, and the streamed base weights are the residual
        raise MegatronPluginConfigError(
            "init_lora_weights", init, "initializations that rewrite the base weights are not mapped: use True "
            "(peft's default), False or 'gaussian'",
        )
    _uniform(getattr(config, "rank_pattern", None), config.r, "rank_pattern")
    _uniform(getattr(config, "alpha_pattern", None), config.lora_alpha, "alpha_pattern")

    base = peft_model.get_base_model()
    family = get_family(base.config)
    if family.name not in FAMILY_TARGETS:
        raise MegatronPluginConfigError(
            "model_type", base.config.model_type,
            f"LoRA is mapped for {sorted(FAMILY_TARGETS)}; {family.name}'s adapters are not yet")
    _, table = FAMILY_TARGETS[family.name]
    pattern = _layer_pattern(family, family.variant_of(base))
    per_layer: Dict[int, set] = {}
    lora_layer = _lora_layer_class()
    for module_name, module in base.named_modules():
        if not isinstance(module, lora_layer):
            continue
        m = pattern.match(module_name)
        if m is None or m.group(2) not in table:
            experts = " (an MoE model's routed experts, router and shared-expert gate are not mapped)" \
                if family.num_experts(base.config) else ""
            raise MegatronPluginConfigError(
                "target_modules", module_name,
                f"{family.name}'s LoRA table maps {sorted({t.leaf for t in table.values()})} inside the decoder layers"
                f"{experts}; drop this target")
        per_layer.setdefault(int(m.group(1)), set()).add(m.group(2))
    if not per_layer:
        raise MegatronPluginConfigError("target_modules", config.target_modules, "the model has no LoRA layers")
    found = sorted(set().union(*per_layer.values()))
    for i in range(family.num_layers(base.config)):
        # an MoE family's dense and MoE layers hold different modules (dense MLP / shared expert): each layer
        # must have every target its kind holds
        kind = layer_kind(family, base.config, i)
        if per_layer.get(i, set()) != {t for t in found if table[t].layers in (None, kind)}:
            raise MegatronPluginConfigError(
                "layers_to_transform", sorted(per_layer),
                "adapters on some layers (or different modules per layer) are not mapped: put the same targets on "
                f"every layer (layer {i} has {sorted(per_layer.get(i, ()))})")
    modules_to_save = tuple(sorted(getattr(config, "modules_to_save", None) or ()))
    if modules_to_save:
        mapped = family.mapped_hf_names(base.config, family.variant_of(base))
        strip = len(family.prefix(family.variant_of(base)))
        for m in modules_to_save:
            if not any(_under_module(n[strip:], m) for n in mapped):
                raise MegatronPluginConfigError(
                    "modules_to_save", m, f"no tensor of {family.name}'s mapping table is under it (a head tied to the "
                    "embeddings is the embeddings'): name modules the model holds weights of")
        tied = bool(getattr(base.config, "tie_word_embeddings", False))
        embedding = [m for m in modules_to_save if m.split(".")[-1] in ("embed_tokens", "wte", "lm_head")]
        if tied and embedding:
            # peft trains an untied copy of the embedding while the head keeps the original; the Megatron twin
            # holds one tied weight, so the two would differ
            raise MegatronPluginConfigError(
                "modules_to_save", embedding[0], "the model ties its embeddings and output layer, and peft trains a "
                "copy of one of them apart from the other: leave the embedding out of modules_to_save, or untie the "
                "weights (config.tie_word_embeddings=False) before get_peft_model")
    return LoraSpec(
        r=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout or 0.0),
        target_modules=tuple(sorted({table[t].leaf for t in found})), use_rslora=bool(config.use_rslora),
        modules_to_save=modules_to_save, adapter_name=name, peft_config=config, layer_targets=tuple(found),
        family=family.name,
    )


def _under_module(hf_name: str, module: str) -> bool:
    """Whether HF tensor `hf_name` belongs to the module peft's `modules_to_save` entry `module` names
    (peft matches the entry against a module name's end)."""
    owner = hf_name.rsplit(".", 1)[0]
    return owner == module or owner.endswith("." + module)


def base_model_of(peft_model) -> torch.nn.Module:
    """The HF model inside a peft model (with peft's wrappers still in it: read weights with
    `base_state_dict`)."""
    return peft_model.get_base_model()


def base_state_dict(peft_model) -> Dict[str, torch.Tensor]:
    """The base model's weights under their plain HF names: peft's `.base_layer` dropped from wrapped
    modules' names, LoRA tensors left out, and a `modules_to_save` module as its trained copy (what the
    adapted model computes with; the copy equals the original until trained)."""
    out = {}
    for name, t in base_model_of(peft_model).state_dict().items():
        if re.search(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.", name) or ".original_module." in name:
            continue
        name = name.replace(".base_layer.", ".")
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        out[name] = t
    base = base_model_of(peft_model)
    if get_family(base.config).num_experts(base.config):  # the tables read an MoE model's checkpoint names
        from .moe_names import checkpoint_names

        out = checkpoint_names(base, out)
    return out


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _layers(chunk) -> Iterator[Tuple[int, torch.nn.Module]]:
    """(global layer index, the chunk's decoder layer) for the layers this pipeline stage holds."""
    for local in range(chunk.plan.num_layers):
        yield chunk.plan.layer_offset + local, chunk.module.get_submodule(f"decoder.layers.{local}")


def _layer_targets(chunk, spec: LoraSpec, i: int) -> List[LoraTarget]:
    """The targets global layer `i` of `chunk` holds."""
    return spec.targets(layer_kind(chunk.family, chunk.hf_config, i))


def _tp() -> Tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def check_lora_layout(spec: LoraSpec, hf_config, tp_degree: int) -> None:
    """Refuse a TP size the adapters cannot be split over, before any distributed work: adapters on
    q/k/v_proj need whole key/value heads on each rank (Megatron's QKV rows are grouped by KV head)."""
    tc = get_family(hf_config).transformer_config(hf_config)
    groups = tc.get("num_query_groups") or tc["num_attention_heads"]
    if any(t.part in ("q", "k", "v") for t in spec.targets()) and groups % tp_degree:
        raise MegatronPluginConfigError(
            "tp_degree", tp_degree, f"LoRA on q/k/v_proj needs the model's {groups} key/value heads split evenly over "
            "TP ranks: use a divisor of the number of KV heads")


def _check_layout(chunk, spec: LoraSpec, tp: int) -> None:
    check_lora_layout(spec, chunk.hf_config, tp)


def _adapter_shape(chunk, target: LoraTarget, linear, tp: int) -> Tuple[int, int]:
    """(in, out) of this rank's adapter on `linear`."""
    d = chunk.dims
    if target.parallel == "row":
        return linear.input_size_per_partition, linear.output_size
    out = linear.output_size_per_partition
    if target.part in ("q", "k", "v"):
        groups = d.groups // tp
        out = groups * (d.heads // d.groups) * d.head_dim if target.part == "q" else groups * d.head_dim
    elif target.part in ("gate", "up"):
        out = out // 2
    return linear.input_size, out


def _fused_layout(chunk, target: LoraTarget, linear, tp: int) -> None:
    d = chunk.dims
    if target.part in ("q", "k", "v"):
        set_fused_layout(linear, ((d.heads // d.groups) * d.head_dim, d.head_dim, d.head_dim), d.groups // tp)
    elif target.part in ("gate", "up"):
        half = linear.output_size_per_partition // 2
        set_fused_layout(linear, (half, half), 1)


def attach_lora(model, spec: LoraSpec) -> List[LoRAAdapter]:
    """Put `spec`'s adapters on this rank's linears (this pipeline stage's layers; `model` a MegatronModel
    or a list of chunks), freeze every base parameter (`requires_grad=False`) but those of
    `modules_to_save`, and return the adapters. Call after the base weights are loaded. Adapters start as
    peft's default init (A random, B zero); `load_lora` gives them the peft model's values."""
    tp, _ = _tp()
    added = []
    for chunk in _chunks(model):
        _check_layout(chunk, spec, tp)
        for p in chunk.module.parameters():
            p.requires_grad_(False)
        sp = bool(getattr(chunk.config, "sequence_parallel", False)) and tp > 1
        for i, layer in _layers(chunk):
            for target in _layer_targets(chunk, spec, i):
                linear = layer.get_submodule(target.linear)
                n_in, n_out = _adapter_shape(chunk, target, linear, tp)
                adapter = LoRAAdapter(spec.r, n_in, n_out, spec.scaling, spec.dropout, parallel=target.parallel,
                                      part=target.part, dtype=linear.weight.dtype, device=linear.weight.device)
                adapter.reset_parameters()
                if sp:
                    mark_sequence_parallel(adapter)
                _fused_layout(chunk, target, linear, tp)
                added.append(attach(linear, target.leaf, adapter))
        for p in _modules_to_save_params(chunk, spec):
            p.requires_grad_(True)
        chunk.lora_spec = spec
    return added


def _modules_to_save_params(chunk, spec: LoraSpec) -> List[torch.nn.Parameter]:
    """This stage's Megatron parameters made from the HF tensors of `spec.modules_to_save`."""
    if not spec.modules_to_save:
        return []
    params = dict(chunk.module.named_parameters())
    return [params[name] for _, _, name in _save_rules(chunk, spec) if name in params]


def _save_rules(chunk, spec: LoraSpec):
    strip = len(chunk.family.prefix(chunk.variant))
    for rule, hf_names, name in expand(chunk.family.table(chunk.hf_config, chunk.variant), chunk.plan):
        if any(_under_module(n[strip:], m) for n in hf_names for m in spec.modules_to_save):
            yield rule, hf_names, name


def _hf_module(chunk, i: int, target: LoraTarget) -> str:
    """peft's name of the HF module `target` in global layer `i` (without the `base_model.model.` prefix)."""
    prefix, _ = FAMILY_TARGETS[chunk.family.name]
    strip = chunk.family.prefix(chunk.variant)
    if strip and prefix.startswith(strip):
        prefix = prefix[len(strip):]
    return prefix.format(i=i) + target.hf


def _qkv_rows_to_mcore(b: torch.Tensor, d) -> torch.Tensor:
    # GPT-2's c_attn output rows are [q; k; v]: B's rows regroup as the fused weight's do
    return TRANSFORMS["qkv_split"].to_mcore(list(b.reshape(3, -1, b.shape[-1]).unbind(0)), d)


def _shard_pair(chunk, target: LoraTarget, A: torch.Tensor, B: torch.Tensor, tp: int, rank: int):
    """peft's whole A [r, in], B [out, r] of one module -> this rank's (A, B)."""
    if target.parallel == "row":
        return A.chunk(tp, dim=1)[rank], B
    if target.fused_qkv:
        B = _qkv_rows_to_mcore(B, chunk.dims)
    return A, B.chunk(tp, dim=0)[rank]


def _unshard_pair(chunk, target: LoraTarget, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor]):
    """Every rank's (A, B) shards -> peft's whole A, B."""
    if target.parallel == "row":
        return torch.cat(list(As), dim=1), Bs[0]
    B = torch.cat(list(Bs), dim=0)
    if target.fused_qkv:
        B = torch.cat(TRANSFORMS["qkv_split"].to_hf(B, chunk.dims), dim=0)
    return As[0], B


def _adapter_slots(chunk, spec: LoraSpec) -> Iterator[Tuple[str, LoraTarget, LoRAAdapter]]:
    """(peft module name, target, this rank's adapter) over this stage's layers."""
    for i, layer in _layers(chunk):
        for target in _layer_targets(chunk, spec, i):
            linear = layer.get_submodule(target.linear)
            yield _hf_module(chunk, i, target), target, linear.lora_adapters[target.leaf]


def lora_param_sources(chunk, spec: Optional[LoraSpec] = None) -> Dict[str, Tuple[str, ...]]:
    """This chunk's adapter parameters (names in `chunk.module`) -> the live peft model's parameter they
    stand for (`PeftModel.named_parameters()` names, adapter name in them), as
    `convert.mcore_to_hf_sources` maps the base weights: for carrying the user's optimizer groups over."""
    spec = spec or spec_of_model(chunk)
    out = {}
    for i, _ in _layers(chunk):
        for target in _layer_targets(chunk, spec, i):
            for x in "AB":
                mine = f"decoder.layers.{i - chunk.plan.layer_offset}.{target.linear}.lora_adapters.{target.leaf}.lora_{x}"
                out[mine] = (f"{PEFT_PREFIX}{_hf_module(chunk, i, target)}.lora_{x}.{spec.adapter_name}.weight",)
    return out


def spec_of_model(model) -> LoraSpec:
    """The LoraSpec `attach_lora` put on `model` (kept on each chunk as `lora_spec`)."""
    spec = getattr(_chunks(model)[0], "lora_spec", None)
    if spec is None:
        raise ValueError("this model has no LoRA adapters (attach_lora)")
    return spec


@torch.no_grad()
def load_lora(model, peft_state: Dict[str, torch.Tensor], spec: Optional[LoraSpec] = None) -> None:
    """peft's adapter tensors (names as `get_peft_model_state_dict` gives them; the adapter name may be in
    them, as `PeftModel.state_dict` has it) -> this rank's adapter shards (TP split, fused placement,
    GPT-2's regrouped c_attn rows), and `modules_to_save` tensors into their Megatron parameters. Raises
    naming a missing tensor. No collectives."""
    spec = spec or spec_of_model(model)
    state = _without_adapter_name(peft_state, spec)
    tp, rank = _tp()
    for chunk in _chunks(model):
        for dest, src in _adapter_values(chunk, spec, state, tp, rank):
            dest.copy_(src)
        _load_saved_modules(chunk, spec, state, tp, rank)


def lora_param_values(model, peft_state: Dict[str, torch.Tensor],
                      spec: Optional[LoraSpec] = None) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """(this rank's adapter parameter, its value from peft's tensors, in their dtype) as `load_lora` places them,
    without writing: for the engine to set fp32 masters from peft's fp32 adapters. No collectives."""
    spec = spec or spec_of_model(model)
    state = _without_adapter_name(peft_state, spec)
    tp, rank = _tp()
    return [pair for chunk in _chunks(model) for pair in _adapter_values(chunk, spec, state, tp, rank)]


def _without_adapter_name(peft_state, spec: LoraSpec) -> Dict[str, torch.Tensor]:
    return {re.sub(rf"\.{re.escape(spec.adapter_name)}\.weight$", ".weight", k): v for k, v in peft_state.items()}


def _adapter_values(chunk, spec: LoraSpec, state, tp: int, rank: int):
    for module, target, adapter in _adapter_slots(chunk, spec):
        names = [f"{PEFT_PREFIX}{module}.lora_{x}.weight" for x in "AB"]
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"peft adapter tensors missing: {missing}")
        A, B = _shard_pair(chunk, target, state[names[0]], state[names[1]], tp, rank)
        for dest, src, what in ((adapter.lora_A, A, names[0]), (adapter.lora_B, B, names[1])):
            if dest.shape != src.shape:
                raise MegatronPluginConfigError(
                    "adapter", what, f"has this rank's shape {tuple(src.shape)}, the model's adapter "
                    f"{tuple(dest.shape)}: the adapter is of another r or model size")
            yield dest, src


def _load_saved_modules(chunk, spec: LoraSpec, state, tp: int, rank: int) -> None:
    if not spec.modules_to_save:
        return
    params = dict(chunk.module.named_parameters())
    strip = len(chunk.family.prefix(chunk.variant))
    for rule, hf_names, name in _save_rules(chunk, spec):
        keys = [PEFT_PREFIX + n[strip:] for n in hf_names]
        if name not in params or not all(k in state for k in keys):
            continue  # not in this state (peft's state dict holds only trained modules)
        lookup = dict(zip(hf_names, keys))
        params[name].copy_(read_shard(lambda n: TensorSlice(state[lookup[n]]), rule, hf_names, chunk.dims, tp, rank))


@torch.no_grad()
def lora_hf_state_dict(model, spec: Optional[LoraSpec] = None, grads: bool = False,
                       value_of: Optional[Callable[[torch.nn.Parameter], torch.Tensor]] = None,
                       ) -> Dict[str, torch.Tensor]:
    """The adapters (and `modules_to_save` tensors) as peft's whole tensors, named as
    `get_peft_model_state_dict` names them; with `grads`, their gradients instead; with `value_of`, what it
    gives for each of this rank's parameters (its shape; e.g. the optimizer's fp32 master, engine/lora.py),
    called in the same order on every rank. Collective: over the TP group (every TP rank gets the stage's
    tensors) and the pipeline group (every rank gets every stage's, rank 0 among them). The inverse of
    `load_lora`, bit for bit."""
    spec = spec or spec_of_model(model)
    tp, _ = _tp()
    group = parallel_state.get_tensor_model_parallel_group()
    out: Dict[str, torch.Tensor] = {}

    def value(p):
        t = p.grad if grads else p if value_of is None else value_of(p)
        return (torch.zeros_like(p) if t is None else t).detach().contiguous()

    def gather(t):
        if tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t, group=group)
        return parts

    for chunk in _chunks(model):
        for module, target, adapter in _adapter_slots(chunk, spec):
            As, Bs = gather(value(adapter.lora_A)), gather(value(adapter.lora_B))
            A, B = _unshard_pair(chunk, target, As, Bs)
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.contiguous()
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.contiguous()
        if spec.modules_to_save:
            strip = len(chunk.family.prefix(chunk.variant))
            params = dict(chunk.module.named_parameters())
            for rule, hf_names, name in _save_rules(chunk, spec):
                if rule.stage == "tied_output" or name not in params:
                    continue
                mine = value(params[name])
                full = unshard(gather(mine) if rule.tp_dim is not None else [mine], rule)
                for n, t in zip(hf_names, TRANSFORMS[rule.transform].to_hf(full, chunk.dims)):
                    out[PEFT_PREFIX + n[strip:]] = t.contiguous()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) > 1:
        stages = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()}, group=pp_group)
        device = next(iter(out.values())).device if out else torch.device("cpu")
        out = {k: v.to(device) for s in stages for k, v in s.items()}
    return out


def adapter_config_dict(spec: LoraSpec, base_name_or_path: Optional[str] = None) -> dict:
    """adapter_config.json's content: the peft config as peft writes it (inference mode, the base
    model's name or path)."""
    config = copy.deepcopy(spec.peft_config)
    if base_name_or_path is not None:
        config.base_model_name_or_path = base_name_or_path
    config.inference_mode = True
    out = config.to_dict()
    for k, v in out.items():  # peft writes sets as lists
        if isinstance(v, set):
            out[k] = sorted(v)
    return out


def save_adapter(directory: str, spec: LoraSpec, tensors: Dict[str, torch.Tensor],
                 base_name_or_path: Optional[str] = None) -> None:
    """Write peft's adapter folder: `adapter_config.json` and `adapter_model.safetensors` (`tensors` as
    `lora_hf_state_dict` gives them), which `PeftModel.from_pretrained(base, directory)` loads. One rank
    writes (no collectives here); `base_name_or_path`: the HF config's `name_or_path`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(adapter_config_dict(spec, base_name_or_path), f, indent=2, sort_keys=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def merged_hf_weights(base_state: Dict[str, torch.Tensor], lora_state: Dict[str, torch.Tensor],
                      spec: LoraSpec) -> Dict[str, torch.Tensor]:
    """Full HF weights with the adapters merged, as peft's `merge_and_unload()` computes them in fp32:
    W + (B @ A) * scaling (transposed for GPT-2's Conv1D weights), `modules_to_save` tensors as trained.
    `base_state`: the base model's HF tensors (the Megatron model's `hf_state_dict()`, plain HF names);
    `lora_state`: `lora_hf_state_dict` (peft's names). Returns new tensors, in the base tensors' dtypes."""
    _, table = FAMILY_TARGETS[spec.family]
    out = dict(base_state)
    for key, A in lora_state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        target = next(t for hf, t in table.items() if module.endswith("." + hf))
        B = lora_state[key.replace(".lora_A.", ".lora_B.")]
        w = base_state[module + ".weight"]
        delta = (B.float() @ A.float()) * spec.scaling
        if target.conv1d:
            delta = delta.t()
        out[module + ".weight"] = (w.float() + delta).to(w.dtype)
    for key, t in lora_state.items():
        if ".lora_" not in key:
            out[key[len(PEFT_PREFIX):]] = t
    return out
