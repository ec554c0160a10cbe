"""What a torch_dist checkpoint holds, as Megatron-LM's `generate_state_dict` lays it out:

    model / model0, model1, ...   each chunk's `module.sharded_state_dict()` (mcore's keys, global layers)
    optimizer                     mcore's `optimizer.sharded_state_dict` (GPU engine), or the CPU engine's
                                  torch optimizer the way mcore's FP32Optimizer writes it:
                                  `optimizer.state.<exp_avg|...>.<model key>` sharded like the weight
    rng_state                     ShardedObject over (pp, tp), one list per data-parallel group
    args, checkpoint_version, iteration, opt_param_scheduler, num_floating_point_operations_so_far
    megatron_plugin               ours: the model (family, variant, HF config), layout and what was saved
    megatron_plugin.custom_objects  ShardedObject of the registered objects' states, written by rank 0

Everything but ShardedTensors/ShardedObjects ends up in rank 0's common.pt, which megatron-core and
Megatron-LM read with `torch.load(weights_only=True)`: it holds only numbers, strings, tensors and
argparse.Namespace (a safe global megatron-core registers). That is why registered objects, whose states
may hold anything, are a ShardedObject (read through torch.distributed.checkpoint's own unpickler).

`model_sharded_state_dict` is public: checkpoint_utils builds the same model part offline.
"""

from __future__ import annotations

import copy
import re
from argparse import Namespace
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor

from ...errors import MegatronPluginConfigError
from .state import TrainingState
from .torch_dist_io import CONTENT_METADATA

CHECKPOINT_VERSION = 3.0  # Megatron-LM's: fused QKV rows grouped per query group, as mcore lays them out
ENTRY = "megatron_plugin"
CUSTOM_OBJECTS = "megatron_plugin.custom_objects"
RNG = "rng_state"
MODEL_RNG = "megatron_plugin_model_rng"  # the model's own dropout stream (engine/rng.py), beside Megatron-LM's
# the distributed optimizer's sharding types whose checkpoints reshard across TP, PP and DP (megatron-core's
# DistributedOptimizer.checkpoint_fully_reshardable_formats); 0.16.1 writes only the first (its
# `fully_sharded_model_space` builds flattened ShardedTensors, which its own validation refuses)
RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")


def model_key(chunk: int, num_chunks: int) -> str:
    """Megatron-LM's name of a model chunk in the state dict: `model`, or `model0`, `model1`, ... with
    virtual pipeline stages."""
    return "model" if num_chunks == 1 else f"model{chunk}"


def sharding_metadata(distributed_optimizer: bool) -> dict:
    """The `metadata` that decides how model and optimizer describe their sharding, and that the checkpoint
    records as its content metadata: Megatron-LM reads it back to build the state dict to load into.
    The distributed optimizer writes one tensor per parameter and state in the model's shape
    (`fully_reshardable`, Megatron-LM's --dist-ckpt-optim-fully-reshardable: gathered over the data-parallel
    ranks at save), which reshards across TP, PP and DP like the weights."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        meta.update(distrib_optim_sharding_type=RESHARDABLE[0], distrib_optim_fully_reshardable_mem_efficient=False)
    return meta


def model_sharded_state_dict(chunks: Sequence[Any], metadata: Optional[dict] = None) -> Dict[str, dict]:
    """{`model` or `model<i>`: the chunk's sharded state dict}: mcore's own keys (layer norms under the names
    Megatron-LM's TE layers give them, see layers/spec.checkpoint_keys_map), global layer numbers (each
    chunk's offset from its pipeline and virtual stage), TP shards as ShardedTensors. `chunks`: this rank's
    `MegatronModel`s (or bare mcore modules)."""
    out = {}
    for i, chunk in enumerate(chunks):
        module = getattr(chunk, "module", chunk)
        out[model_key(i, len(chunks))] = module.sharded_state_dict(metadata=dict(metadata or {}))
    return out


def without_extra_state(model_sd: Dict[str, dict]) -> Dict[str, dict]:
    """The model part minus `_extra_state` entries (TE's fp8 metadata; None for mcore's own linears):
    nothing to restore here, and a checkpoint of other layers may lack them."""
    return {k: {n: v for n, v in sd.items() if not n.endswith("_extra_state")} for k, sd in model_sd.items()}


# -- the CPU engine's torch optimizer --------------------------------------------------------------------
def _sharded_params(state: TrainingState, model_sd: dict) -> Dict[int, Any]:
    """{index of a parameter in the optimizer's state dict: its ShardedTensor (or factory) in `model_sd`}."""
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    by_index = get_param_id_to_sharded_param_map(model_sd, params)
    missing = [i for i in range(len(params)) if i not in by_index]
    if missing:
        names = state.optimizer_param_names()
        raise MegatronPluginConfigError(
            "save_state", names[missing[0]], "this parameter of the optimizer is in no model chunk's sharded state "
            "dict: pass the model's own parameters to the optimizer")
    return by_index


def torch_optimizer_state(state: TrainingState, model_sd: dict) -> Tuple[dict, Optional[dict]]:
    """The torch optimizer's state as mcore's FP32Optimizer writes it: one ShardedTensor per state tensor,
    sharded like its weight (so it reshards across TP/DP), and the step count once (`common_step`) when all
    parameters share it; param groups without their `params` (indices of this run) go to common.pt.
    Returns it and, when the step counts differ (a parameter that got no gradient in some step), them by
    parameter name for common.pt, which mcore's single step cannot hold."""
    sd = state.optimizer.state_dict()
    by_index = _sharded_params(state, model_sd)
    sharded, steps = {}, {}
    for i, param_state in sd["state"].items():
        sharded[i] = {}
        for k, v in param_state.items():
            if k == "step":
                steps[i] = v
            elif torch.is_tensor(v) and v.dim() > 0:
                sharded[i][k] = make_sharded_optimizer_tensor(by_index[i], v, prefix=f"optimizer.state.{k}")
            else:
                raise MegatronPluginConfigError(
                    "save_state", f"optimizer state {k!r}", "is neither a tensor of its parameter's shape nor the step "
                    "count: use torch.optim.AdamW, Adam or SGD")
    values = {float(s) for s in steps.values()}
    if len(values) == 1:
        step = next(iter(steps.values()))
        sharded["common_step"] = step.clone() if torch.is_tensor(step) else torch.tensor(float(step))
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])
    for g, real in zip(groups, sd["param_groups"]):
        g["params"] = LocalNonpersistentObject(real["params"])
    by_name = None
    if len(values) > 1:
        names = state.optimizer_param_names()
        by_name = {names[i]: float(s) for i, s in steps.items()}
    return {"state": sharded, "param_groups": groups}, by_name


def torch_optimizer_request(state: TrainingState, model_sd: dict, saved_dtypes: Dict[str, torch.dtype]) -> dict:
    """What to load into for the torch optimizer: for each parameter, a fresh tensor per state tensor the
    checkpoint holds for its weight (`optimizer.state.<k>.<model key>`), in the dtype it was saved in."""
    by_index = _sharded_params(state, model_sd)
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    request = {}
    prefix = "optimizer.state."
    for i, sh in by_index.items():
        kinds = {key[len(prefix):-len(sh.key) - 1]: dtype for key, dtype in saved_dtypes.items()
                 if key.startswith(prefix) and key.endswith("." + sh.key)}
        kinds = {k: dtype for k, dtype in kinds.items() if k and "." not in k}  # exp_avg, not a longer key's tail
        if kinds:
            request[i] = {k: make_sharded_optimizer_tensor(sh, torch.empty_like(params[i], dtype=dtype),
                                                           prefix=f"optimizer.state.{k}")
                          for k, dtype in sorted(kinds.items())}
    return {"state": request}


def _groups_signature(groups: list) -> list:
    """Per parameter group, its parameter names with routed experts' indices left out: each expert-parallel
    rank names its experts by their local index, so a run of another EP holds the same groups under other
    names (the experts' states themselves are ShardedTensors over the global expert axis)."""
    return [list(dict.fromkeys(re.sub(r"(^|\.)local_experts\.\d+\.", r"\1local_experts.*.", n) for n in g))
            for g in groups]


def torch_optimizer_loaded(state: TrainingState, loaded: dict, entry: dict) -> dict:
    """The torch optimizer's state dict from what was loaded: the saved step counts and param groups with
    this run's parameter indices. A clear error when the saved groups differ from this run's."""
    saved_names = (entry.get("optimizer") or {}).get("param_names")
    mine = state.optimizer.state_dict()["param_groups"]
    names = state.optimizer_param_names()
    mine_names, at = [], 0
    for g in mine:
        mine_names.append(names[at:at + len(g["params"])])
        at += len(g["params"])
    groups = loaded.get("param_groups") or []
    if len(groups) != len(mine) or (saved_names is not None and _groups_signature(saved_names) != _groups_signature(mine_names)):
        raise MegatronPluginConfigError(
            "load_state", "optimizer", "the optimizer state does not fit this run's optimizer (other parameter groups "
            "or frozen parameters): load with no_load_optim=True to start the optimizer fresh")
    by_name = (entry.get("optimizer") or {}).get("steps")
    common = loaded["state"].get("common_step")
    out_state = {}
    for i, tensors in loaded["state"].items():
        if not isinstance(i, int) or not tensors:
            continue
        step = common if by_name is None else torch.tensor(by_name[names[i]])
        if step is None:
            raise MegatronPluginConfigError(
                "load_state", "optimizer", "the checkpoint's optimizer state has no step count: load with "
                "no_load_optim=True to start the optimizer fresh")
        out_state[i] = dict(tensors, step=step.clone() if torch.is_tensor(step) else torch.tensor(float(step)))
    return {"state": out_state,
            "param_groups": [dict(saved, params=g["params"]) for saved, g in zip(groups, mine)]}


# -- the GPU engine's megatron-core optimizer -----------------------------------------------------------------
@torch.no_grad()
def mcore_optimizer_ready_to_load(optimizer) -> None:
    """megatron-core 0.16.1's DistributedOptimizer over torch's own Adam (no TE, no apex) reads the step count
    from every parameter's state when it describes itself for a load, which a run that has not stepped yet
    lacks (an AssertionError). One step of the inner torch optimizer with zero gradients at learning rate 0
    creates that state without moving a weight (mcore's `_init_optimizer_states_with_dummy_values` does the
    same for FSDP, at the run's learning rate); the load then overwrites all of it."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if (not isinstance(inner, torch.optim.Optimizer) or inner.state
                or not type(inner).__module__.startswith("torch.optim")):
            continue
        rates = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for g, lr in zip(inner.param_groups, rates):
            g["lr"] = lr


def mcore_optimizer_load(optimizer, loaded) -> None:
    """`optimizer.load_state_dict(loaded)` for megatron-core's optimizer, chained or not. For a
    DistributedOptimizer's `fully_reshardable` state, megatron-core 0.16.1 copies into every entry of a
    parameter's optimizer state, including torch Adam's `step`, which the checkpoint's per-parameter tensors
    leave out (a KeyError; TE's and apex's Adam keep no `step` there). So there the param groups and step
    counts load first, then the per-parameter tensors with the step counts held aside."""
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if len(subs) == 1:
        parts = [loaded]
    else:
        parts = [v for _, v in sorted(loaded.items())] if isinstance(loaded, dict) else list(loaded)
    for opt, part in zip(subs, parts):
        inner = getattr(opt, "optimizer", None)
        if not (isinstance(part, dict) and part.get("param_state_sharding_type") == "fully_reshardable"
                and isinstance(inner, torch.optim.Optimizer)):
            opt.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        part.pop("param_state_sharding_type")
        opt.load_state_dict(part)
        steps = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                inner.state[p]["step"] = step


# -- RNG -----------------------------------------------------------------------------------------------
def _to_megatron_rng(ours: dict) -> dict:
    out = {"random_rng_state": ours["python"], "np_rng_state": ours["numpy"], "torch_rng_state": ours["torch"],
           MODEL_RNG: ours["model"]}
    if "cuda" in ours:
        out.update(cuda_rng_state=ours["cuda"], rng_tracker_states=ours["tracker"])
    return out


def from_megatron_rng(saved: dict) -> dict:
    """Megatron-LM's names -> `TrainingState.rng_state`'s (a checkpoint of Megatron-LM has no model stream)."""
    out = {"python": saved["random_rng_state"], "numpy": saved["np_rng_state"], "torch": saved["torch_rng_state"]}
    if MODEL_RNG in saved:
        out["model"] = saved[MODEL_RNG]
    if "cuda_rng_state" in saved:
        out.update(cuda=saved["cuda_rng_state"], tracker=saved["rng_tracker_states"])
    return out


def _rng_place():
    ps = parallel_state
    return ((ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            ps.get_data_parallel_rank(with_context_parallel=True))


def rng_object(state: TrainingState) -> ShardedObject:
    """Collective over the data-parallel group: Megatron-LM's `rng_state` ShardedObject at (pp, tp), the
    list of every data-parallel rank's streams (its `data_parallel_random_init` layout; Megatron-LM without it
    reads entry 0), so that each rank of a run of the same layout resumes its own."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _to_megatron_rng(state.rng_state()), group=group)
    shape, offset, dp_rank = _rng_place()
    return ShardedObject(RNG, everyone, shape, offset, replica_id=dp_rank)


def rng_request() -> ShardedObject:
    shape, offset, dp_rank = _rng_place()
    return ShardedObject(RNG, None, shape, offset, replica_id=dp_rank)


def custom_objects_object(objects: Sequence[Any], data=None) -> ShardedObject:
    """The registered objects' states, one object written by rank 0 (every rank reads it back)."""
    states = [obj.state_dict() for obj in objects] if data is None else data
    return ShardedObject(CUSTOM_OBJECTS, states, (1,), (0,), replica_id=dist.get_rank())


# -- common.pt -----------------------------------------------------------------------------------------
# Megatron-LM's MoE arguments that its loaders and converters read, by TransformerConfig field (the same names)
_MOE_FIELDS = ("moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
               "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function", "moe_aux_loss_coeff",
               "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_dispatcher_type",
               "moe_router_load_balancing_type")


def moe_args(get, ep: int, etp: int) -> dict:
    """The MoE part of Megatron-LM's args: `num_experts` (Megatron-LM's name of `num_moe_experts`), the
    `moe_*` settings through `get(field)` (a TransformerConfig's or a family's fields), the expert layout;
    `moe_grouped_gemm` False: the experts are megatron-core's SequentialMLP parameters, one tensor per expert."""
    experts = get("num_moe_experts")
    out = dict(num_experts=experts, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if experts:
        out.update({k: get(k) for k in _MOE_FIELDS}, moe_grouped_gemm=False)
    return out


def megatron_args(state: TrainingState, iteration: int) -> Namespace:
    """The `args` Megatron-LM saves, with the fields its readers use (load_args_from_checkpoint,
    check_checkpoint_args, NeMo/Bridge/verl converters): model shape, parallel layout, vocabulary padding,
    batch geometry and what was saved."""
    model, c, grid, plugin = state.model, state.model.config, state.layout, state.plugin
    hf = model.hf_config
    heads = c.num_attention_heads
    groups = c.num_query_groups or heads
    rotary = bool(model.family.rotary)
    position = "rope" if rotary else getattr(model.module, "position_embedding_type", "learned_absolute")
    micro = getattr(plugin, "micro_batch_size", None)
    global_batch = getattr(plugin, "global_batch_size", None)
    return Namespace(
        num_layers=c.num_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.ffn_hidden_size,
        num_attention_heads=heads, num_query_groups=groups, group_query_attention=groups != heads,
        kv_channels=c.kv_channels, max_position_embeddings=model.family.max_positions(hf),
        seq_length=getattr(plugin, "seq_length", None) or model.family.max_positions(hf),
        position_embedding_type=position, add_position_embedding=position == "learned_absolute",
        use_rotary_position_embeddings=rotary, rotary_base=getattr(hf, "rope_theta", 10000),
        rotary_percent=1.0, rotary_interleaved=False,
        add_bias_linear=c.add_bias_linear, add_qkv_bias=c.add_qkv_bias,
        swiglu=bool(c.gated_linear_unit) and c.activation_func is torch.nn.functional.silu, squared_relu=False,
        untie_embeddings_and_output_weights=not model.family.tied_embeddings(hf),
        normalization=c.normalization, norm_epsilon=c.layernorm_epsilon, qk_layernorm=c.qk_layernorm,
        apply_layernorm_1p=False, apply_query_key_layer_scaling=c.apply_query_key_layer_scaling,
        attention_dropout=c.attention_dropout, hidden_dropout=c.hidden_dropout,
        tensor_model_parallel_size=grid.tp_size, pipeline_model_parallel_size=grid.pp_size,
        virtual_pipeline_model_parallel_size=state.vpp,
        num_layers_per_virtual_pipeline_stage=getattr(plugin, "num_layers_per_virtual_pipeline_stage", None),
        context_parallel_size=grid.cp_size,  # Megatron-LM's data_parallel_size excludes it, as grid.dp_size does
        **moe_args(lambda k: getattr(c, k, None), parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size()),
        sequence_parallel=bool(c.sequence_parallel), data_parallel_size=grid.dp_size, world_size=grid.world_size,
        vocab_size=hf.vocab_size, padded_vocab_size=model.dims.padded_vocab,
        make_vocab_size_divisible_by=state.make_vocab_size_divisible_by,
        micro_batch_size=micro, global_batch_size=global_batch,
        iteration=iteration, consumed_train_samples=iteration * (global_batch or 0), consumed_valid_samples=0,
        skipped_train_samples=0, train_iters=getattr(plugin, "train_iters", None),
        bf16=bool(c.bf16), fp16=bool(c.fp16), params_dtype=c.params_dtype, seed=getattr(plugin, "seed", None),
        use_distributed_optimizer=state.distributed_optimizer, ckpt_format="torch_dist", use_dist_ckpt=True,
        no_save_optim=not state.save_optimizer, no_save_rng=False, data_parallel_random_init=False,
    )


def plugin_entry(state: TrainingState, optimizer_steps: Optional[dict] = None) -> dict:
    """Ours in common.pt: the model to convert back to HF without flags, the layout, what was saved."""
    grid = state.layout
    entry = dict(state.model_fields(), tp=grid.tp_size, pp=grid.pp_size, dp=grid.dp_size, cp=grid.cp_size, vpp=state.vpp,
                 world_size=grid.world_size, engine="cpu" if state.torch_optimizer else "mcore",
                 distributed_optimizer=state.distributed_optimizer, custom_objects=len(state.custom_objects),
                 optimizer=None, ep=state.experts.ep_size, etp=state.experts.etp_size)
    if state.save_optimizer:
        entry["optimizer"] = {"steps": optimizer_steps}
        if state.torch_optimizer:
            names, at = state.optimizer_param_names(), 0
            entry["optimizer"]["param_names"] = []
            for g in state.optimizer.param_groups:
                entry["optimizer"]["param_names"].append(names[at:at + len(g["params"])])
                at += len(g["params"])
    return entry


def save_state_dict(state: TrainingState) -> dict:
    """Collective (RNG over data-parallel ranks, gathered first: nothing before it can fail on one rank
    alone): this rank's whole state dict for `torch_dist_io.save_sharded`."""
    rng = rng_object(state)
    metadata = sharding_metadata(state.distributed_optimizer)
    sd = model_sharded_state_dict(state.chunks, metadata)
    steps = None
    if state.save_optimizer:
        if state.torch_optimizer:
            sd["optimizer"], steps = torch_optimizer_state(state, sd)
        else:
            sd["optimizer"] = state.optimizer.sharded_state_dict(sd, is_loading=False, metadata=dict(metadata))
    if state.scheduler is not None:
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd[RNG] = rng
    if state.custom_objects:
        sd[CUSTOM_OBJECTS] = custom_objects_object(state.custom_objects)
    sd.update(args=megatron_args(state, state.iteration), checkpoint_version=CHECKPOINT_VERSION,
              iteration=state.iteration, num_floating_point_operations_so_far=0)
    sd[ENTRY] = plugin_entry(state, steps)
    sd[CONTENT_METADATA] = metadata
    return sd


def tensor_dtypes(dcp_metadata) -> Dict[str, torch.dtype]:
    """{key: dtype} of every tensor a torch_dist checkpoint holds."""
    out = {}
    for key, md in dcp_metadata.state_dict_metadata.items():
        props = getattr(md, "properties", None)
        if props is not None and getattr(md, "size", None) is not None:
            out[key] = props.dtype
    return out


def has_object(dcp_metadata, key: str) -> bool:
    """Whether the checkpoint holds a ShardedObject `key` (stored as `<key>/shard_<offset>_<shape>`)."""
    return any(k.startswith(key + "/shard_") for k in dcp_metadata.state_dict_metadata)


def object_shape(dcp_metadata, key: str) -> Optional[tuple]:
    """The global shape of ShardedObject `key` in the checkpoint (from its stored name), None without it."""
    for k in dcp_metadata.state_dict_metadata:
        if k.startswith(key + "/shard_"):
            return tuple(int(x) for x in k.rsplit("_", 1)[1].split("."))
    return None


__all__ = [
    "CHECKPOINT_VERSION", "CUSTOM_OBJECTS", "ENTRY", "RNG", "custom_objects_object", "from_megatron_rng",
    "has_object", "megatron_args", "moe_args", "model_key", "model_sharded_state_dict", "object_shape", "plugin_entry",
    "rng_object", "rng_request", "save_state_dict", "sharding_metadata", "tensor_dtypes",
    "torch_optimizer_loaded", "torch_optimizer_request", "torch_optimizer_state", "without_extra_state",
]


def args_differences(config, args) -> list:
    """How the shape settings a Megatron-LM checkpoint's args record differ from this run's TransformerConfig
    (for checkpoints without our entry): ['name: checkpoint X, this model Y', ...]. Megatron-LM records
    num_query_groups only with --group-query-attention; without it every head is its own group."""
    mine = {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "ffn_hidden_size": config.ffn_hidden_size,
            "num_query_groups": config.num_query_groups or config.num_attention_heads,
            # Megatron-LM's `num_experts` is `num_moe_experts`; None on both sides for a dense model
            "num_experts": getattr(config, "num_moe_experts", None)}
    if mine["num_experts"]:
        mine.update(moe_ffn_hidden_size=config.moe_ffn_hidden_size,
                    moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)
    differ = []
    for name, value in mine.items():
        saved = getattr(args, name, None)
        if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
            saved = getattr(args, "num_attention_heads", None)
        if name == "num_experts" and (saved or None) != (value or None):
            differ.append(f"num_experts: checkpoint {saved}, this model {value}")
            continue
        if saved is not None and saved != value:
            differ.append(f"{name}: checkpoint {saved}, this model {value}")
    return differ


def another_model(ckpt: str, differ: list) -> MegatronPluginConfigError:
    return MegatronPluginConfigError(
        "load_state", ckpt, f"the checkpoint is of another model ({'; '.join(differ)}): load it into a model built "
        "from the checkpoint's config, or pass a checkpoint saved from this model")
