"""The user's torch optimizer, rebuilt over the Megatron parameters, and its accelerate-facing adapter."""

from __future__ import annotations

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
                      sources: Dict[str, Tuple[str, ...]], mcore_params: Dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Same class, same per-group hyper-parameters, over the trainable Megatron parameters of this rank.

    Each Megatron parameter joins the group its HF source parameter was in, so the usual
    "no weight decay for biases and LayerNorm" groups of HF scripts carry over.
    Frozen Megatron parameters (`requires_grad=False`, see `trainable_flags`) are left out.
    """
    check_optimizer(user_opt)
    hf_name_of = {id(p): n for n, p in hf_model.named_parameters()}
    group_of_hf: Dict[str, int] = {}
    for gi, group in enumerate(user_opt.param_groups):
        for p in group["params"]:
            if id(p) in hf_name_of:
                group_of_hf[hf_name_of[id(p)]] = gi
    groups: List[List[torch.nn.Parameter]] = [[] for _ in user_opt.param_groups]
    for name, param in mcore_params.items():
        if param.requires_grad:
            groups[group_of_hf[sources[name][0]]].append(param)
    keys = SUPPORTED[type(user_opt)]
    param_groups = [
        {"params": params, **{k: g[k] for k in keys if k in g}}
        for params, g in zip(groups, user_opt.param_groups) if params
    ]
    return type(user_opt)(param_groups)


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
