"""`CPUEngine`: the engine built from torch.distributed collectives alone, so it runs on CPU (gloo).

Its training step runs the micro-batches forward and backward one by one, averages the gradients over
data-parallel ranks, clips them to the global norm and steps the torch optimizer the user passed
(rebuilt over the Megatron parameters) and the LR scheduler. Everything else is `MegatronEngine`'s.

With calculate_per_token_loss it does what megatron-core's schedules and finalize_model_grads do: each
micro-batch's backward runs on its loss sum, the gradients are summed over data-parallel ranks and divided
by the step's token count over all of them, so they are those of the mean over the global batch's tokens.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from .base import MegatronEngine, average_logs


class CPUEngine(MegatronEngine):
    def _train_step(self, micro_batches):
        n = len(micro_batches)
        per_token = bool(getattr(self.plugin, "calculate_per_token_loss", False))
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
            (loss if per_token else loss / n).backward()
            collected.append(logs)
        self.reduce_gradients(tokens if per_token else None)
        self.last_grad_norm = self.clip_gradients()
        self.last_step_skipped = not math.isfinite(self.last_grad_norm)
        if not self.last_step_skipped:
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step(1)
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return average_logs(collected)

    def _params(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    @torch.no_grad()
    def reduce_gradients(self, tokens=None):
        """Average the gradients over data-parallel ranks, and sum those TP ranks computed apart. With
        `tokens` (this rank's loss tokens, calculate_per_token_loss) sum them, and divide by the tokens of
        every data-parallel rank (megatron-core's finalize_model_grads with num_tokens)."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        dp = parallel_state.get_data_parallel_group(with_context_parallel=tokens is not None)
        if dist.get_world_size(dp) > 1 and grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=dp)
            if tokens is None:
                flat /= dist.get_world_size(dp)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        if tokens is not None:
            total = tokens.clone()
            if dist.get_world_size(dp) > 1:
                dist.all_reduce(total, group=dp)
            if total > 0 and grads:
                torch._foreach_mul_(grads, 1.0 / float(total))
        # per-head q/k norms (Qwen3) are replicated, but each TP rank saw only its own heads: sum them, as
        # mcore's finalize_model_grads does
        tp = parallel_state.get_tensor_model_parallel_group()
        if dist.get_world_size(tp) > 1:
            for name, p in self.model.module.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=tp)

    @torch.no_grad()
    def clip_gradients(self) -> float:
        """Global L2 norm over the whole model (TP shards counted once, replicated tensors once), and
        clipping to the plugin's `gradient_clipping` the way torch.nn.utils.clip_grad_norm_ does."""
        params = [p for p in self._params() if p.grad is not None]
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        counted = [p.grad for p in params if getattr(p, "tensor_model_parallel", False) or tp_rank == 0]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in counted:
            sq += g.float().pow(2).sum()
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = sq.sqrt().item()
        clip = self.plugin.gradient_clipping
        if clip and math.isfinite(norm):
            coef = min(clip / (norm + 1e-6), 1.0)
            for p in params:
                p.grad.mul_(coef)
        return norm

