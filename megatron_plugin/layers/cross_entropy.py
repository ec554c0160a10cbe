"""Vocab-parallel cross-entropy that leaves the padded vocabulary rows out of the softmax.

Megatron pads the vocabulary (50257 -> 50304 for GPT-2) so the embedding splits evenly over TP ranks.
HF's loss has no such rows, so they must not enter the softmax. Masking the logits first and then
running mcore's cross-entropy costs several extra passes over the largest tensor of the step
(tokens x vocab); here the mask is part of the loss, and on GPU each piece is one compiled kernel:

  forward: max over the vocabulary; sum of exp and the target's logit; (all-reduces over TP between)
  backward: softmax - one-hot, written straight in the logits' dtype.

Only the logits (in their own dtype) are kept for backward, not an fp32 softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _vocab_ids(logits: torch.Tensor, start: int) -> torch.Tensor:
    return torch.arange(logits.shape[-1], device=logits.device) + start


def _local_max(logits, start: int, true_vocab: int):
    valid = _vocab_ids(logits, start) < true_vocab
    return torch.where(valid, logits.float(), float("-inf")).amax(-1)


def _sum_exp_and_target(logits, logits_max, target, start: int, true_vocab: int):
    shifted = logits.float() - logits_max.unsqueeze(-1)
    valid = _vocab_ids(logits, start) < true_vocab
    sum_exp = torch.where(valid, shifted.exp(), 0.0).sum(-1)
    local = target - start
    here = (local >= 0) & (local < logits.shape[-1])
    picked = torch.gather(shifted, -1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return sum_exp, torch.where(here, picked, 0.0)


def _grad_logits(logits, logits_max, sum_exp, target, grad_loss, start: int, true_vocab: int):
    ids = _vocab_ids(logits, start)
    softmax = (logits.float() - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    softmax = torch.where(ids < true_vocab, softmax, 0.0)
    one_hot = (ids == target.unsqueeze(-1)).float()
    return ((softmax - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)


class _Compiled:
    """Each piece compiled on first use with CUDA tensors; eager on CPU (no compiler needed there)."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    def __call__(self, logits, *args):
        if not logits.is_cuda:
            return self.fn(logits, *args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn)
        return self.compiled(logits, *args)


local_max = _Compiled(_local_max)
sum_exp_and_target = _Compiled(_sum_exp_and_target)
grad_logits = _Compiled(_grad_logits)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, true_vocab: int):
        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        logits_max = local_max(logits, start, true_vocab)
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp, picked = sum_exp_and_target(logits, logits_max, target, start, true_vocab)
        if tp > 1:
            both = torch.stack([sum_exp, picked])
            dist.all_reduce(both, group=group)
            sum_exp, picked = both[0], both[1]
        ctx.save_for_backward(logits, logits_max, sum_exp, target)
        ctx.start, ctx.true_vocab = start, true_vocab
        return torch.log(sum_exp) - picked

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, target = ctx.saved_tensors
        grad = grad_logits(logits, logits_max, sum_exp, target, grad_loss.contiguous(), ctx.start, ctx.true_vocab)
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Per-token loss (fp32) of logits [..., local vocab] (this TP rank's slice) against target [...]
    (global ids; ids outside this rank's slice are handled by the other ranks). Vocabulary ids at or
    past `true_vocab` are padding and get probability zero."""
    return _VocabParallelCrossEntropy.apply(logits, target, true_vocab)


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, true_vocab: int,
                             temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position (fp32, differentiable) of softmax(logits / temperature), from this TP
    rank's vocabulary slice, without gathering the vocabulary. Targets of -100 give 0 (and no gradient)."""
    if temperature != 1.0:
        logits = logits.float() / temperature
    ignored = target < 0
    log_probs = -vocab_parallel_cross_entropy(logits, target.clamp_min(0), true_vocab)
    return log_probs.masked_fill(ignored, 0.0)


def _entropy_parts(logits, logits_max, start: int, true_vocab: int, temperature: float):
    z = logits.float() / temperature
    valid = _vocab_ids(logits, start) < true_vocab
    e = torch.where(valid, (z - logits_max.unsqueeze(-1)).exp(), 0.0)
    return e.sum(-1), (e * torch.where(valid, z, 0.0)).sum(-1)


def _grad_entropy(logits, logits_max, sum_exp, mean_z, grad, start: int, true_vocab: int, temperature: float):
    # dH/dz_i = -p_i (z_i - E[z]); z = logits / temperature
    z = logits.float() / temperature
    valid = _vocab_ids(logits, start) < true_vocab
    p = torch.where(valid, (z - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1), 0.0)
    g = -p * (torch.where(valid, z, 0.0) - mean_z.unsqueeze(-1)) * grad.unsqueeze(-1)
    return (g / temperature).to(logits.dtype)


def _local_scaled_max(logits, start: int, true_vocab: int, temperature: float):
    return _local_max(logits, start, true_vocab) / temperature


local_scaled_max = _Compiled(_local_scaled_max)
entropy_parts = _Compiled(_entropy_parts)
grad_entropy = _Compiled(_grad_entropy)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log sum exp z - E_p[z] over the whole (unpadded) vocabulary; the forward all-reduces three
    numbers per position over TP, the backward is local (every rank holds the same H)."""

    @staticmethod
    def forward(ctx, logits, true_vocab: int, temperature: float):
        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
        logits_max = local_scaled_max(logits, start, true_vocab, temperature)
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp, sum_ez = entropy_parts(logits, logits_max, start, true_vocab, temperature)
        if tp > 1:
            both = torch.stack([sum_exp, sum_ez])
            dist.all_reduce(both, group=group)
            sum_exp, sum_ez = both[0], both[1]
        mean_z = sum_ez / sum_exp
        ctx.save_for_backward(logits, logits_max, sum_exp, mean_z)
        ctx.start, ctx.true_vocab, ctx.temperature = start, true_vocab, temperature
        return torch.log(sum_exp) + logits_max - mean_z

    @staticmethod
    def backward(ctx, grad):
        logits, logits_max, sum_exp, mean_z = ctx.saved_tensors
        g = grad_entropy(logits, logits_max, sum_exp, mean_z, grad.contiguous(), ctx.start, ctx.true_vocab,
                         ctx.temperature)
        return g, None, None


def vocab_parallel_entropy(logits: torch.Tensor, true_vocab: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (fp32, differentiable) per position of softmax(logits / temperature) over the true
    vocabulary, from this TP rank's slice [..., local vocab]."""
    return _VocabParallelEntropy.apply(logits, true_vocab, float(temperature))
