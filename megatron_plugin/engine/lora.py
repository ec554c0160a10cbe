"""LoRA runs (issue 29): a peft `PeftModel` handed to `prepare`, on the engine's side.

`peft_inputs` takes the PeftModel out of prepare's arguments before anything else looks at them: its
adapters are checked (models/lora.lora_spec_of refuses what we do not map, by name, before any process
group) and the rest of prepare sees the HF model inside it, as for full fine-tuning. `build` then builds
the Megatron chunks from the base weights (plain HF names), attaches and loads this rank's adapter shards
(`lora_chunks`), and the CPU engine's optimizer holds the adapters only (`lora_optimizer`). The frozen base
therefore has no gradient, no fp32 master copy and no optimizer state on either engine: the CPU optimizer is
built over trainable parameters only, and megatron-core's DDP and optimizer skip `requires_grad=False`
parameters (distributed_data_parallel.py and optimizer/__init__.py's _get_param_groups in 0.16.1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import MegatronPluginConfigError
from ..models.lora import is_peft_model


@dataclass(frozen=True)
class LoraRun:
    """What a LoRA prepare carries from the PeftModel to the engine."""

    spec: object  # models.lora.LoraSpec
    peft_model: Optional[torch.nn.Module]  # None once the engine is built (`built`)
    base_state: Dict[str, torch.Tensor]  # the base model's weights under plain HF names
    adapter_state: Dict[str, torch.Tensor]  # get_peft_model_state_dict's names
    trainable: Tuple[str, ...]  # the PeftModel's trainable parameter names

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model inside the PeftModel: config, variant and family come from it."""
        return self.peft_model.get_base_model()

    def built(self) -> "LoraRun":
        """What the engine keeps once its chunks and optimizer exist: the spec. The PeftModel and its
        tensors are let go, so the HF weights are not held in host memory for the whole run."""
        return dataclasses.replace(self, peft_model=None, base_state={}, adapter_state={})


def peft_inputs(args) -> Tuple[tuple, Optional[LoraRun]]:
    """prepare's arguments with a PeftModel replaced by its transformers model, and the LoraRun (None without
    one). Refuses what the Megatron adapters do not do, before any collective."""
    compiled = [a for a in args if is_peft_model(getattr(a, "_orig_mod", None))]
    if compiled:
        raise MegatronPluginConfigError(
            "model", "torch.compile(PeftModel)", "pass the PeftModel itself: prepare compiles the Megatron layers "
            "(torch_compile=True or accelerate's dynamo settings)")
    found = [i for i, a in enumerate(args) if is_peft_model(a)]
    if not found:
        return args, None
    from ..models.lora import base_state_dict, lora_spec_of

    peft_model = args[found[0]]
    spec = lora_spec_of(peft_model)
    from peft import get_peft_model_state_dict

    adapter_state = {k: v.detach()
                     for k, v in get_peft_model_state_dict(peft_model, adapter_name=spec.adapter_name).items()}
    run = LoraRun(spec=spec, peft_model=peft_model, base_state=base_state_dict(peft_model),
                  adapter_state=adapter_state,
                  trainable=tuple(n for n, p in peft_model.named_parameters() if p.requires_grad))
    args = tuple(run.hf_model if i == found[0] else a for i, a in enumerate(args))
    return args, run


def check_lora_run(run: LoraRun, plugin, optimizer) -> None:
    """What a LoRA run cannot be combined with, and an optimizer that misses the adapters: before any
    collective."""
    if plugin.custom_model_provider_function is not None:
        raise MegatronPluginConfigError(
            "custom_model_provider_function", getattr(plugin.custom_model_provider_function, "__qualname__", "set"),
            "a PeftModel's adapters are attached to the module prepare builds from the HF model: leave "
            "custom_model_provider_function unset, or pass the model without peft",
        )
    from ..models.lora import check_lora_layout
    from ..plugin import refuse_with_full_iteration_graph

    refuse_with_full_iteration_graph(plugin, "a PeftModel", "LoRA is not tested under a CUDA graph's capture: train "
                                     "the adapters without the graph")
    check_lora_layout(run.spec, run.hf_model.config, plugin.tp_degree)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    params = dict(run.peft_model.named_parameters())
    missing = [n for n in run.trainable if id(params[n]) not in in_optimizer]
    if missing:
        raise MegatronPluginConfigError(
            "optimizer", f"parameter {missing[0]} missing",
            "build the optimizer over peft_model.parameters() (or its trainable ones) after get_peft_model: "
            f"{missing[0]} trains but is in no optimizer group",
        )


def lora_chunks(spec, run: LoraRun) -> list:
    """This rank's model chunks: the base weights, every parameter frozen, then this stage's adapters
    attached (trainable) and filled from the peft model's."""
    from ..models.lora import attach_lora, load_lora
    from ..models.modeling import MegatronModel

    chunks = MegatronModel.chunks_from_hf(run.hf_model, spec.plugin, params_dtype=spec.params_dtype,
                                          reader=spec.reader, state=None if spec.reader is not None else run.base_state)
    for chunk in chunks:
        attach_lora(chunk, run.spec)
        load_lora(chunk, run.adapter_state)
    return chunks


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)\.lora_adapters\.([^.]+)\.(lora_[AB])$")


def peft_name_of(chunk, name: str, run: LoraRun) -> Optional[str]:
    """The PeftModel parameter a trainable Megatron parameter of `chunk` comes from (for its optimizer group):
    an adapter's by layer, target and A/B; a modules_to_save tensor's by the mapping table's HF name."""
    m = _LAYER.match(name)
    if m is not None:
        layer = int(m.group(1)) + chunk.plan.layer_offset
        target, ab = m.group(3), m.group(4)
        tail = f".{target}.{ab}.{run.spec.adapter_name}.weight"
        found = [n for n in run.trainable if n.endswith(tail) and re.search(rf"\.{layer}\.", n)]
        if len(found) > 1:  # GPT-2's c_proj: attention's and the MLP's
            where = "attn" if "self_attention" in m.group(2) else "mlp"
            found = [n for n in found if f".{where}." in n]
        return found[0] if len(found) == 1 else None
    from ..models.convert import mcore_to_hf_sources

    sources = mcore_to_hf_sources(chunk.family, chunk.hf_config, chunk.plan, chunk.variant).get(name, ())
    for hf_name in sources:
        stem, _, leaf = hf_name.rpartition(".")
        wanted = f"{stem}.modules_to_save.{run.spec.adapter_name}.{leaf}"
        found = [n for n in run.trainable if n.endswith(wanted)]
        if found:
            return found[0]
    return None


def lora_optimizer(user_opt: torch.optim.Optimizer, run: LoraRun, chunk, plugin=None) -> torch.optim.Optimizer:
    """The CPU engine's optimizer: the user's class and per-group hyper-parameters over this rank's trainable
    Megatron parameters (adapters, modules_to_save), each in the group its peft parameter was in."""
    from .optimizer import SUPPORTED, check_optimizer, check_optimizer_fields, group_settings

    check_optimizer(user_opt)
    if plugin is not None:
        check_optimizer_fields(plugin, user_opt, "cpu")
    params = dict(run.peft_model.named_parameters())
    group_of = {id(p): gi for gi, g in enumerate(user_opt.param_groups) for p in g["params"]}
    used = sorted({group_of[id(params[n])] for n in run.trainable if id(params[n]) in group_of})
    keys = SUPPORTED[type(user_opt)]
    split: Dict[Tuple[int, float, float], List[torch.nn.Parameter]] = {}
    for name, param in chunk.module.named_parameters():
        if not param.requires_grad:
            continue
        peft_name = peft_name_of(chunk, name, run)
        if peft_name is not None:
            gi = group_of[id(params[peft_name])]
        elif len(used) == 1:
            gi = used[0]
        else:
            raise MegatronPluginConfigError(
                "optimizer", f"{len(used)} parameter groups",
                f"the trainable Megatron parameter {name} has no PeftModel parameter to take its group from: put "
                "the adapters in one optimizer group",
            )
        mult, wd = group_settings(plugin, user_opt, gi, name, param)
        split.setdefault((gi, mult, wd), []).append(param)
    groups = []
    for (gi, mult, wd), plist in sorted(split.items(), key=lambda kv: kv[0]):
        g = {"params": plist, **{k: user_opt.param_groups[gi][k] for k in keys if k in user_opt.param_groups[gi]}}
        if "weight_decay" in g or wd:
            g["weight_decay"] = wd
        if mult != 1.0:
            g["lr"], g["lr_mult"] = g["lr"] * mult, mult
        groups.append(g)
    return type(user_opt)(groups)


@contextlib.contextmanager
def adapters_disabled(chunks):
    """peft's `disable_adapter()` on the prepared model: every chunk runs its base weights inside the block."""
    from ..layers.lora import lora_disabled

    with contextlib.ExitStack() as stack:
        for chunk in chunks:
            stack.enter_context(lora_disabled(chunk.module))
        yield


def adapter_tensors(engine, masters: bool = True) -> Dict[str, torch.Tensor]:
    """The adapters as peft names them (get_peft_model_state_dict), whole, on global rank 0 at least; with
    `masters`, the optimizer's fp32 master values where the model holds bf16/fp16 copies (`fp32_masters`).
    Collective: every rank walks every chunk (TP gathers, pipeline stages sent to rank 0, with the distributed
    optimizer the masters' shards summed over its data-parallel group)."""
    from ..models.lora import lora_hf_state_dict

    return lora_hf_state_dict(list(engine.chunks), value_of=fp32_masters(engine) if masters else None)


def fp32_masters(engine):
    """`value(model_param) -> fp32 tensor` reading megatron-core's fp32 master of a bf16/fp16 parameter, or None
    when the parameters are their own masters (the CPU engine, fp32 runs). peft keeps adapters in fp32, and a
    bf16 copy would lose the last 16 bits of what training reached.

    megatron-core 0.16.1 hangs each master on its model parameter as `main_param`: the whole fp32 copy for
    Float16OptimizerWithFloat16Params; for the DistributedOptimizer this data-parallel rank's shard (the
    parameter's elements `_get_model_param_range_map(p)['param']` of its flattened self, `main_param_sharded`),
    None on ranks holding none of it, None under the precision-aware optimizer (FusedAdam holds the masters:
    `_get_main_param_and_optimizer_states`). A sharded master is put back whole by summing the ranks' disjoint
    parts over the optimizer's data-parallel group: collective, so every rank of that group must call `value`
    for the same parameters in the same order (`lora_hf_state_dict` walks them so)."""
    if getattr(engine, "dtype", None) not in (torch.bfloat16, torch.float16):
        return None
    distributed = _distributed_optimizers(engine)

    def value(p: torch.nn.Parameter) -> torch.Tensor:
        if p.dtype == torch.float32 or not p.requires_grad:  # no master: the parameter itself
            return p.detach()
        # param_index_map is keyed by parameter; `in` on the buffer's params list would compare tensors by value
        owner = next((o for o in distributed if any(p in b.param_index_map for b in o.buffers)), None)
        if owner is None:
            main = getattr(p, "main_param", None)
            return (p.detach().float() if main is None else main.detach()).view(p.shape)
        whole = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if p in owner.model_param_gbuf_map:  # this rank holds a part
            part = owner._get_model_param_range_map(p)["param"]
            main = getattr(p, "main_param", None)
            if main is None:
                try:
                    main = owner._get_main_param_and_optimizer_states(p)["param"]
                except KeyError:  # precision-aware before the first step: the masters are the model's values
                    main = p.detach().view(-1)[part.start:part.end]
            whole[part.start:part.end] = main.detach().view(-1).float()
        dist.all_reduce(whole, group=owner.data_parallel_group)
        return whole.view(p.shape)

    return value


def _distributed_optimizers(engine) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    return [o for o in optimizers if isinstance(o, DistributedOptimizer) and not o.is_stub_optimizer]


@torch.no_grad()
def load_fp32_masters(engine, run: LoraRun) -> None:
    """Set the fp32 masters of this rank's adapters to the PeftModel's own (fp32) values. megatron-core's
    optimizers copy their masters from the bf16/fp16 parameters, so without this a bf16 run would start from
    adapters rounded to bf16, not peft's. Call once the engine and its optimizer exist, before `run.built()` lets
    the peft tensors go. No collectives: each rank writes the master (or the distributed optimizer's part of it)
    it holds. Under the precision-aware optimizer (masters inside FusedAdam, `main_param` None) nothing is set."""
    if getattr(engine, "dtype", None) not in (torch.bfloat16, torch.float16):
        return
    from ..models.lora import lora_param_values

    distributed = _distributed_optimizers(engine)
    for chunk in engine.chunks:
        for p, value in lora_param_values(chunk, run.adapter_state, run.spec):
            main = getattr(p, "main_param", None)
            if main is None:  # an fp32 parameter (its own master, loaded whole), or masters held by FusedAdam
                continue
            value = value.to(device=main.device, dtype=torch.float32).reshape(-1)
            if getattr(p, "main_param_sharded", False):
                owner = next(o for o in distributed if p in o.model_param_gbuf_map)
                part = owner._get_model_param_range_map(p)["param"]
                value = value[part.start:part.end]
            main.copy_(value.view_as(main))


def save_adapter_folder(engine, directory: str) -> str:
    """peft's adapter folder (adapter_config.json, adapter_model.safetensors), written by global rank 0.
    Collective."""
    import torch.distributed as dist

    from ..models.lora import save_adapter

    tensors = adapter_tensors(engine)
    if dist.get_rank() == 0:
        save_adapter(directory, engine.lora.spec, tensors,
                     base_name_or_path=getattr(engine.model.hf_config, "name_or_path", None) or None)
    dist.barrier()
    return directory


def lora_merger(engine, masters: bool = False):
    """`merge(hf_name, base_tensor) -> merged tensor`: peft's merge_and_unload (W + scaling * B A, in the HF
    layout: GPT-2's Conv1D stores W as [in, out]) for the tensors the adapters sit on, the others as they
    are. With `masters`, the adapters' fp32 masters (`fp32_masters`; save_model's export), else the model's
    values (bf16 under bf16 mixed precision: a weight push to a rollout engine). Collective: gathers the whole
    adapters onto every rank of the replica, each of which then merges what it yields (with `masters` and the
    distributed optimizer: over every data-parallel rank too)."""
    from ..models.lora_targets import FAMILY_TARGETS

    tensors = adapter_tensors(engine, masters=masters)
    spec, family = engine.lora.spec, engine.model.family
    conv1d = tuple(t.hf for t in FAMILY_TARGETS.get(family.name, ("", {}))[1].values() if t.conv1d)

    def merge(name: str, tensor: torch.Tensor) -> torch.Tensor:
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        a = tensors.get(f"base_model.model.{stem}.lora_A.weight") if stem else None
        b = tensors.get(f"base_model.model.{stem}.lora_B.weight") if stem else None
        if a is None or b is None:
            return tensor
        # peft's order of operations (LoraLayer.get_delta_weight in the adapters' fp32, then W += delta: a bf16
        # W takes the fp32 sum rounded once), so merges agree bit for bit
        delta = b.float() @ a.float()
        if conv1d and stem.endswith(conv1d):
            delta = delta.T
        return (tensor.float() + delta * spec.scaling).to(tensor.dtype)

    return merge
