"""The user's torch optimizer, rebuilt over the Megatron parameters, and its accelerate-facing adapter."""

from __future__ import annotations

import importlib.util
from typing import Dict, List, Tuple

import torch

from ..errors import MegatronPluginConfigError

# optimizer class -> hyper-parameters copied per param group
SUPPORTED = {
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay", "amsgrad"),
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}


def check_optimizer(optimizer) -> None:
    if type(optimizer) not in SUPPORTED:
        raise MegatronPluginConfigError(
            "optimizer", type(optimizer).__name__,
            "Megatron runs support torch.optim.AdamW, Adam and SGD: build one of those over model.parameters()",
        )


def trainable_flags(hf_model: torch.nn.Module, user_opt: torch.optim.Optimizer,
                    sources: Dict[str, Tuple[str, ...]]) -> Dict[str, bool]:
    """Megatron parameter name -> trainable?, following the HF model's `requires_grad`, after checking
    that the optimizer holds every trainable parameter. Both HF idioms work: an optimizer over all
    parameters (frozen ones are then skipped, as torch skips parameters without gradients) or over the
    trainable ones only. Pure: call it before any process group exists to validate, and again per
    model chunk to apply. `sources`: Megatron name -> the HF names it is made from."""
    hf_params = dict(hf_model.named_parameters(remove_duplicate=False))
    in_optimizer = {id(p) for g in user_opt.param_groups for p in g["params"]}
    flags = {}
    for name, hf_names in sources.items():
        srcs = [(n, hf_params[n]) for n in hf_names if n in hf_params]
        trainable = {p.requires_grad for _, p in srcs}
        if len(trainable) > 1:
            raise MegatronPluginConfigError(
                "requires_grad", f"{[n for n, p in srcs if not p.requires_grad]} frozen, "
                f"{[n for n, p in srcs if p.requires_grad]} not",
                f"Megatron fuses these HF tensors into one ({name}): freeze all of them or none",
            )
        flags[name] = trainable != {False}
        missing = [n for n, p in srcs if flags[name] and id(p) not in in_optimizer]
        if missing:
            raise MegatronPluginConfigError(
                "optimizer", f"parameter {missing[0]} missing",
                f"{missing[0]} is trainable (requires_grad=True) but in no optimizer group: pass it to the "
                "optimizer, or freeze it with requires_grad_(False) before prepare",
            )
    if not any(flags.values()):
        raise MegatronPluginConfigError("requires_grad", False,
                                        "every parameter of the model is frozen: unfreeze what should train")
    return flags


def rebuild_optimizer(user_opt: torch.optim.Optimizer, hf_model: torch.nn.Module,
                      sources: Dict[str, Tuple[str, ...]], mcore_params: Dict[str, torch.nn.Parameter],
                      plugin=None) -> torch.optim.Optimizer:
    """Same class, same per-group hyper-parameters, over the trainable Megatron parameters of this rank.

    Each Megatron parameter joins the group its HF source parameter was in, so the usual
    "no weight decay for biases and LayerNorm" groups of HF scripts carry over.
    Frozen Megatron parameters (`requires_grad=False`, see `trainable_flags`) are left out.
    The plugin's `scale_lr_cond`/`lr_mult` and `no_wd_decay_cond` (called with the Megatron parameter
    names, e.g. 'decoder.layers.0.mlp.linear_fc1.bias') split groups further (`group_settings`).
    """
    check_optimizer(user_opt)
    if plugin is not None:
        check_optimizer_fields(plugin, user_opt, "cpu")
    hf_name_of = {id(p): n for n, p in hf_model.named_parameters()}
    group_of_hf: Dict[str, int] = {}
    for gi, group in enumerate(user_opt.param_groups):
        for p in group["params"]:
            if id(p) in hf_name_of:
                group_of_hf[hf_name_of[id(p)]] = gi
    keys = SUPPORTED[type(user_opt)]
    # (HF group, lr multiplier, weight decay) -> parameters: the conditions split HF groups, in their order
    split: Dict[Tuple[int, float, float], List[torch.nn.Parameter]] = {}
    for name, param in mcore_params.items():
        if param.requires_grad:
            gi = group_of_hf[sources[name][0]]
            mult, wd = group_settings(plugin, user_opt, gi, name, param)
            split.setdefault((gi, mult, wd), []).append(param)
    param_groups = []
    for (gi, mult, wd), params in sorted(split.items(), key=lambda kv: kv[0][0]):
        g = {"params": params, **{k: user_opt.param_groups[gi][k] for k in keys if k in user_opt.param_groups[gi]}}
        if "weight_decay" in g or wd:
            g["weight_decay"] = wd
        if mult != 1.0:  # Megatron's group flag; the scheduler scales this group's min_lr by it too
            g["lr"], g["lr_mult"] = g["lr"] * mult, mult
        param_groups.append(g)
    return type(user_opt)(param_groups)


def _decay_of(user_opt: torch.optim.Optimizer) -> float:
    """Megatron's one weight_decay: the largest of the HF groups' (their no-decay groups hold 0)."""
    return max(g.get("weight_decay", 0.0) for g in user_opt.param_groups)


def group_settings(plugin, user_opt: torch.optim.Optimizer, gi: int, name: str, param) -> Tuple[float, float]:
    """(lr multiplier, weight decay) of Megatron parameter `name` from HF group `gi`. Without conditions,
    the HF group's own. `scale_lr_cond(name, param)` picks the parameters whose lr is times `lr_mult`;
    `no_wd_decay_cond(name, param)`, when given, decides decay for every parameter, as in Megatron-LM:
    those it picks get none, the others the optimizer's weight decay."""
    scale = getattr(plugin, "scale_lr_cond", None)
    mult = float(plugin.lr_mult) if scale is not None and scale(name, param) else 1.0
    no_wd = getattr(plugin, "no_wd_decay_cond", None)
    if no_wd is None:
        wd = user_opt.param_groups[gi].get("weight_decay", 0.0)
    else:
        wd = 0.0 if no_wd(name, param) else _decay_of(user_opt)
    return mult, wd


def check_optimizer_fields(plugin, optimizer: torch.optim.Optimizer, device_type: str) -> None:
    """The plugin's optimizer fields against the device and the optimizer, before any distributed work.

    megatron-core 0.16.1 (optimizer/__init__.py, optimizer_config.py, distrib_optimizer.py): the CPU
    offload builds its HybridDeviceOptimizer for AdamW only (it asserts decoupled weight decay), and only
    the distributed optimizer hands it the fp32 main parameters (the Float16 optimizer would leave its
    sub-optimizers on the bf16 weights, whose .grad is never set); the precision-aware optimizer asserts
    Adam and the distributed optimizer, and reads Transformer Engine's version in OptimizerConfig."""
    offload = bool(getattr(plugin, "optimizer_cpu_offload", False))
    aware = bool(getattr(plugin, "use_precision_aware_optimizer", False))
    if getattr(plugin, "overlap_cpu_optimizer_d2h_h2d", False) and not offload:
        raise MegatronPluginConfigError(
            "overlap_cpu_optimizer_d2h_h2d", True,
            "it overlaps the copies of the CPU-offloaded optimizer: set optimizer_cpu_offload=True too, or leave it False",
        )
    if device_type != "cuda":
        if aware:
            raise MegatronPluginConfigError(
                "use_precision_aware_optimizer", True,
                "Megatron-Core's precision-aware optimizer runs on CUDA (Transformer Engine's FusedAdam): for a CPU "
                "run set use_precision_aware_optimizer=False",
            )
        return  # the CPU engine's optimizer already lives on the CPU: optimizer_cpu_offload is satisfied
    if offload or aware:
        setting = "optimizer_cpu_offload" if offload else "use_precision_aware_optimizer"
        wanted = (torch.optim.AdamW,) if offload else (torch.optim.AdamW, torch.optim.Adam)
        if type(optimizer) not in wanted:
            raise MegatronPluginConfigError(
                setting, True,
                f"Megatron-Core's {'CPU-offloaded' if offload else 'precision-aware'} optimizer is Adam"
                f"{'W (decoupled weight decay)' if offload else ''}, not {type(optimizer).__name__}: build a "
                f"torch.optim.AdamW, or set {setting}=False",
            )
        if not getattr(plugin, "use_distributed_optimizer", False):
            raise MegatronPluginConfigError(
                setting, True,
                "Megatron-Core runs it inside its distributed optimizer: set use_distributed_optimizer=True too",
            )
    if offload and not getattr(plugin, "no_save_optim", False):
        # measured on an H100: megatron-core 0.16.1's HybridDeviceOptimizer state neither round-trips through
        # torch_dist (its common part pickles torch.optim.AdamW, which dist_checkpointing's weights-only load
        # refuses) nor through the megatron_plugin format; refused here rather than at the first load
        raise MegatronPluginConfigError(
            "optimizer_cpu_offload", True,
            "checkpoints of the CPU-offloaded optimizer's state do not load back yet: set no_save_optim=True too "
            "(save_state then keeps weights, scheduler, RNG and iteration; the optimizer restarts on resume), or "
            "turn optimizer_cpu_offload off",
        )
    if aware and importlib.util.find_spec("transformer_engine") is None:
        raise MegatronPluginConfigError(
            "use_precision_aware_optimizer", True,
            "Megatron-Core's precision-aware optimizer needs Transformer Engine (its FusedAdam keeps the master "
            "weights; megatron-core 0.16.1 reads TE's version for it even with optimizer_cpu_offload), which is not "
            "installed: pip install transformer-engine, or set use_precision_aware_optimizer=False",
        )


class MegatronLMOptimizerWrapper:
    """What `accelerator.prepare` returns for the optimizer: the engine steps the real optimizer inside
    `model(**batch)`, so `step` and `zero_grad` here do nothing."""

    def __init__(self, optimizer, engine):
        self.optimizer = optimizer
        self._engine = engine

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, *args, **kwargs):
        pass

    def zero_grad(self, set_to_none=None):
        pass

    @property
    def step_was_skipped(self) -> bool:
        """True when the last step was skipped (non-finite gradients, e.g. an fp16 loss-scale overflow)."""
        return self._engine.last_step_skipped

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


def inner_torch_optimizers(megatron_optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron-Core optimizer (chained or not)."""
    subs = getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer])
    return [o.optimizer for o in subs if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer)]


def use_fused_adam(megatron_optimizer) -> int:
    """Switch torch Adam/AdamW inside mcore's optimizer to torch's fused (single-kernel) update.

    Without TE/apex mcore builds `torch.optim.AdamW` without `fused=`, so torch takes its foreach
    implementation, several passes over parameters and states. The fused kernel computes the same
    update. Only before the first step (state is created per the group's `fused` flag) and only
    when every parameter is on CUDA. Returns how many optimizers were switched."""
    switched = 0
    for opt in inner_torch_optimizers(megatron_optimizer):
        params = [p for g in opt.param_groups for p in g["params"]]
        if type(opt) not in (torch.optim.AdamW, torch.optim.Adam) or opt.state or not params:
            continue
        if not all(p.is_cuda and p.dtype == torch.float32 for p in params):
            continue
        for group in [opt.defaults, *opt.param_groups]:
            group.update(fused=True, foreach=None)
        opt._step_supports_amp_scaling = True
        switched += 1
    return switched
