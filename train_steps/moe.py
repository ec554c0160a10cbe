"""The router losses of MoE models, added to a train step's loss per micro-batch.

HF's MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) with `output_router_logits` add
`router_aux_loss_coef * load_balancing_loss_func(all layers' router logits, ...)` to the LM loss of every
forward. Here each micro-batch is such a forward: its loss gets `moe_aux_loss_coeff *
hf_load_balancing_loss(this micro-batch's router statistics of every layer)` (layers/moe.py; one loss over
all layers together, as HF's), and `moe_z_loss_coeff * z_loss(...)` (megatron-core's z-loss) when set.
The engines then average micro-batches and data-parallel ranks as they average the LM loss, which is what
HF DDP with gradient accumulation does with its per-forward losses.

With `calculate_per_token_loss` the loss function returns a sum over the micro-batch's loss tokens; the
router terms are multiplied by the micro-batch's token count before they join it, so that after the
division by the global batch's tokens each micro-batch's router loss weighs as many times as it has loss
tokens, and the step's router loss is their token-weighted mean.

Logged apart from the LM loss (which keeps its 'lm loss' key): 'load_balancing_loss' and 'z_loss' (without
their coefficients, as Megatron-LM logs them) and 'loss', the objective the step minimised, which is then
the step's returned loss. The load-balancing loss needs every layer's statistics in one place, so it is
computed when one stage holds the whole model (prepare refuses an aux-loss coefficient with pipeline
stages).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from .utils import avg_losses_across_data_parallel_group, sum_across_data_parallel_group


def unwrap_model(model):
    """The Megatron GPT module inside DDP / Float16Module wrappers."""
    while not hasattr(model, "compute_language_model_loss") and hasattr(model, "module"):
        model = model.module
    return model


def _coeff(value) -> float:
    if value is None:
        return 0.0
    if isinstance(value, (list, tuple)):  # mcore's per-load-balancing-type list
        return float(sum(value))
    return float(value)


class RouterLosses:
    """One model chunk's routers and the coefficients of the losses on their statistics."""

    def __init__(self, gpt):
        from megatron_plugin.layers.moe import moe_routers

        config = gpt.config
        self.routers = moe_routers(gpt)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.aux_coeff = _coeff(getattr(config, "moe_aux_loss_coeff", None))
        self.z_coeff = _coeff(getattr(config, "moe_z_loss_coeff", None))
        # the load-balancing loss multiplies the statistics of all layers together: one stage must hold them all
        self.whole_model = bool(getattr(gpt, "pre_process", True) and getattr(gpt, "post_process", True))

    def capture(self) -> list:
        """The routers' statistics of the forward that just ran (each forward replaces them)."""
        return [r.stats for r in self.routers]

    def add_to(self, loss_func):
        """`loss_func` with this micro-batch's router losses added (statistics read now, after the forward)."""
        if not self.whole_model or not self.routers:
            return loss_func
        return partial(self._with_router_losses, loss_func, self.capture())

    def terms(self, stats) -> dict:
        """{log name: (coefficient, loss)} of this micro-batch."""
        from megatron_plugin.layers.moe import hf_load_balancing_loss, z_loss

        out = {"load_balancing_loss": (self.aux_coeff, hf_load_balancing_loss(stats, self.num_experts, self.topk))}
        if self.z_coeff:
            out["z_loss"] = (self.z_coeff, z_loss(stats))
        return out

    def _with_router_losses(self, loss_func, stats, output_tensor, *args, **kwargs):
        result = loss_func(output_tensor, *args, **kwargs)
        terms = self.terms(stats)
        extra = sum((c * v for c, v in terms.values() if c), torch.zeros((), device=result[0].device))
        logs = dict(result[-1])
        if len(result) == 3:  # Megatron-LM's (loss sum, token count, logs): token-weighted (module docstring)
            total, count = result[0], result[1]
            weight = count.to(total.dtype) if torch.is_tensor(count) else float(count)
            total = total + extra * weight
            pairs = [(v.detach() * weight, count) for _, v in terms.values()] + [(total.detach(), count)]
            logs.update(zip([*terms, "loss"], sum_across_data_parallel_group(pairs)))
            return total, count, logs
        loss = result[0] + extra
        averaged = avg_losses_across_data_parallel_group([v.detach() for _, v in terms.values()] + [loss.detach()])
        logs.update(zip([*terms, "loss"], averaged))
        return loss, logs


class MoESupport:
    """What a train step needs for MoE models, looked up once per model chunk: the router losses, and the
    padding mask mcore's MoE layers take (padded tokens are routed, as in HF, but left out of the
    statistics, as HF leaves them out of its load-balancing loss)."""

    def __init__(self):
        self._losses = {}

    def losses(self, model) -> Optional[RouterLosses]:
        """None for a chunk without MoE layers."""
        key = id(model)
        if key not in self._losses:
            gpt = unwrap_model(model)
            config = getattr(gpt, "config", None)
            self._losses[key] = RouterLosses(gpt) if getattr(config, "num_moe_experts", None) else None
        return self._losses[key]

    def model_kwargs(self, model, data) -> dict:
        """`padding_mask` for an MoE model's forward when the batch has an HF attention mask."""
        if self.losses(model) is None or not isinstance(data, dict):
            return {}
        from megatron_plugin.layers.moe import padding_mask_from_hf

        mask = padding_mask_from_hf(data.get("attention_mask"))
        if mask is None:
            return {}
        gpt = unwrap_model(model)
        if not getattr(gpt, "pre_process", True) and gpt.config.sequence_parallel:
            # megatron-core splits the mask over the TP ranks only on the first pipeline stage (GPTModel's
            # embedding branch); a later stage's hidden states are this rank's [s/tp, b, H] sequence shard:
            # the same split here
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            mask = scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        return {"padding_mask": mask}

    def add_to(self, model, loss_func):
        losses = self.losses(model)
        return loss_func if losses is None else losses.add_to(loss_func)
