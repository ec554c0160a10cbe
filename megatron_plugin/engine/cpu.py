"""`CPUEngine`: the engine built from torch.distributed collectives alone, so it runs on CPU (gloo).

Its training step runs the micro-batches forward and backward one by one, averages the gradients over
data-parallel ranks, clips them to the global norm and steps the torch optimizer the user passed
(rebuilt over the Megatron parameters) and the LR scheduler. Everything else is `MegatronEngine`'s.

Under context parallelism the gradients are averaged over the data- and context-parallel ranks together, and a
mean loss is first multiplied by the CP size, as megatron-core's schedules and DDP do (the train steps make
each CP rank's loss its part of the whole sequences' loss: train_steps/gpt.py, train_steps/utils.py).

With calculate_per_token_loss it does what megatron-core's schedules and finalize_model_grads do: each
micro-batch's backward runs on its loss sum, the gradients are summed over data-parallel ranks and divided
by the step's token count over all of them, so they are those of the mean over the global batch's tokens.

Expert parameters of MoE layers (`allreduce = False`, set when the experts are laid out apart from the dense
layers: expert_model_parallel_size > 1 or expert_tensor_parallel_size != tp_degree) are reduced as
megatron-core's DDP reduces its expert buffers: summed over the expert-data-parallel group, then divided by
the dense data-parallel size (or by the step's token count). Each expert-parallel rank's expert already saw
the tokens of every rank of its expert-parallel group (the dispatcher gathered them), so that sum covers
every data-parallel rank's loss once. The gradient norm counts each expert tensor once: dense tensors over
the model-parallel group, expert tensors over the expert tensor x expert x pipeline group.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.comm import all_reduce_in_place
from .base import MegatronEngine, average_logs


class CPUEngine(MegatronEngine):
    def _train_step(self, micro_batches):
        collected = self.accumulate_gradients(micro_batches)
        self.last_grad_norm = self.clip_gradients()
        self.last_step_skipped = not math.isfinite(self.last_grad_norm)
        if not self.last_step_skipped:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step(1)
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return average_logs(collected)

    def accumulate_gradients(self, micro_batches) -> List[Dict[str, torch.Tensor]]:
        """Forward and backward of every micro-batch, the gradients reduced (`reduce_gradients`), before
        clipping: each micro-batch's logs. A mean loss is scaled as megatron-core's schedules scale it:
        divided by the micro-batch count and, a (loss, logs) result, multiplied by the context-parallel size
        (the reduction averages over DP x CP ranks, whose parts of a sequence add up to its loss)."""
        n = len(micro_batches)
        per_token = bool(getattr(self.plugin, "calculate_per_token_loss", False))
        cp = parallel_state.get_context_parallel_world_size()
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        collected: List[Dict[str, torch.Tensor]] = []
        for i, mb in enumerate(micro_batches):
            _, result = self.forward_micro_batch(mb)
            if i == 0 and self._pending_check is not None:
                self._pending_check.raise_if_no_loss()
            loss, logs = result[0], result[-1]
            if per_token:
                if len(result) != 3:
                    raise MegatronPluginConfigError(
                        "calculate_per_token_loss", True,
                        f"the train step's loss function ({type(self.train_step_handler).__name__}) returns (loss, logs); "
                        "per-token loss needs Megatron-LM's (loss sum, token count, logs): return those, or set "
                        "calculate_per_token_loss=False",
                    )
                tokens += result[1]
            elif len(result) == 3:  # Megatron-LM's contract without per-token loss: the micro-batch's mean
                loss = loss / result[1].clamp(min=1)
            elif cp > 1:
                loss = loss * cp
            (loss if per_token else loss / n).backward()
            collected.append(logs)
        self.reduce_gradients(tokens if per_token else None)
        return collected

    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def reduce_gradients(self, tokens=None):
        """Average the gradients over data-parallel (x context-parallel) ranks, and sum those TP ranks computed apart. With
        `tokens` (this rank's loss tokens, calculate_per_token_loss) sum them, and divide by the tokens of
        every data-parallel rank (megatron-core's finalize_model_grads with num_tokens). Expert parameters
        are summed over the expert-data-parallel group and divided like the dense ones (module docstring)."""
        params = [p for p in self._params() if p.grad is not None]
        grads = [p.grad for p in params if is_dense(p)]
        expert_grads = [p.grad for p in params if not is_dense(p)]
        # the CP ranks of a replica hold parts of the same sequences: their gradients are reduced with the DP ranks'
        cp = parallel_state.get_context_parallel_world_size()
        dp = parallel_state.get_data_parallel_group(with_context_parallel=tokens is not None or cp > 1)
        dp_size = dist.get_world_size(dp)
        _sum_over(grads, dp)
        if expert_grads:
            _sum_over(expert_grads, parallel_state.get_expert_data_parallel_group())
        if tokens is None:
            if dp_size > 1 and params:
                torch._foreach_div_([p.grad for p in params], dp_size)
        else:
            total = tokens.clone()
            if dp_size > 1:
                dist.all_reduce(total, group=dp)
            if total > 0 and params:
                torch._foreach_mul_([p.grad for p in params], 1.0 / float(total))
        tp = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(tp) > 1:
            summed = [p.grad for name, p in self.model.module.named_parameters()
                      if p.grad is not None and summed_over_tensor_parallel(name, p, self.model.config)]
            _sum_over(summed, tp)

    @torch.no_grad()
    def clip_gradients(self) -> float:
        """Global L2 norm over the whole model (TP shards counted once, replicated tensors once), and
        clipping to the plugin's `gradient_clipping` the way torch.nn.utils.clip_grad_norm_ does."""
        params = [p for p in self._params() if p.grad is not None]
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        counted = [p.grad for p in params if is_dense(p) and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
        sq = _squares(counted, self.device)
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        experts = [p for p in params if not is_dense(p)]
        if experts:
            # distinct on every rank of the expert tensor x expert x pipeline group (as mcore's expert optimizer
            # counts them); an expert tensor not split over expert-TP ranks is counted on the first of them
            etp_rank = parallel_state.get_expert_tensor_parallel_rank()
            expert_sq = _squares([p.grad for p in experts if getattr(p, "tensor_model_parallel", False) or etp_rank == 0],
                                 self.device)
            dist.all_reduce(expert_sq, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
            sq = sq + expert_sq
        norm = sq.sqrt().item()
        clip = self.plugin.gradient_clipping
        if clip and math.isfinite(norm):
            coef = min(clip / (norm + 1e-6), 1.0)
            for p in params:
                p.grad.mul_(coef)
        return norm


def is_dense(param) -> bool:
    """megatron-core's convention: expert parameters reduced over the expert-data-parallel group carry
    `allreduce = False`; everything else is reduced over the data-parallel group."""
    return getattr(param, "allreduce", True)


def summed_over_tensor_parallel(name: str, param, config) -> bool:
    """Replicated over TP ranks but computed from each rank's own part: per-head q/k norms (Qwen3), and under
    sequence parallelism the parameters marked `sequence_parallel` (norms, an MoE router, a shared expert's
    gate), each rank having seen only its part of the sequence. mcore's finalize_model_grads sums the same."""
    if "q_layernorm" in name or "k_layernorm" in name:
        return True
    return bool(getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False))


def _sum_over(grads, group) -> None:
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    all_reduce_in_place(grads, group)


def _squares(grads, device) -> torch.Tensor:
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.float().pow(2).sum()
    return sq
