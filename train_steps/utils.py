import torch
import torch.distributed as dist
from accelerate.utils.operations import recursively_apply
from megatron.core import parallel_state


def avg_losses_across_data_parallel_group(losses):
    """Average a list of scalar losses over the data-parallel group (detached, for logging)."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group)


def sum_across_data_parallel_group(pairs):
    """Per-token logging (calculate_per_token_loss): each (sum, count) of a micro-batch, summed over the
    data-parallel (and context-parallel) ranks, as a [sum, count] tensor (detached) in one all-reduce. The engine
    adds the micro-batches' pairs and logs sum / count: the value over every token of the global batch, as
    Megatron-LM's training loop does with the [loss, tokens] its loss functions report."""
    stacked = torch.stack([torch.stack([s.detach().float().reshape(()), c.detach().to(s.device).float().reshape(())])
                           for s, c in pairs])
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(stacked, group=group)
    return list(stacked.unbind(0))


def per_token_loss_result(total, count, logs):
    """What a loss function returns under calculate_per_token_loss, Megatron-LM's contract: (the sum of the
    micro-batch's token losses, how many tokens it has as an int tensor, logs); the engines divide the
    gradients by the global batch's token count."""
    return total, count.detach().to(torch.int).reshape(()), logs


def gather_across_data_parallel_groups(tensor):
    """Concatenate (along dim 0) the tensors of every data-parallel rank, nested structures too."""
    group = parallel_state.get_data_parallel_group()

    def _gather(t):
        if t.ndim == 0:
            t = t.clone()[None]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    return recursively_apply(_gather, tensor, error_on_other_type=True)


def shift_to_tokens(values, shift: int):
    """Move per-position values [b, s] computed at the positions that score a token to the token's own
    position (`shift` places later); the first `shift` positions, which no position scores, get 0."""
    if not shift:
        return values
    return torch.cat([values.new_zeros(values.shape[0], shift), values[:, :-shift]], dim=1)


def per_token_log_probs(logits, targets, shift: int, true_vocab: int, temperature: float = 1.0, entropy: bool = False):
    """Log-probabilities of the target tokens, token-aligned: out[:, t] = log p(token t | what precedes it),
    0 where the target is -100 and at the first `shift` positions; with `entropy`, also the entropy of
    the distribution that scores token t. Computed on this TP rank's vocabulary slice (`logits` [b, s,
    vocab / tp]), differentiable, fp32. Use it in custom RL losses."""
    from megatron_plugin.layers.cross_entropy import vocab_parallel_entropy, vocab_parallel_log_probs

    log_probs = shift_to_tokens(vocab_parallel_log_probs(logits, targets, true_vocab, temperature), shift)
    if not entropy:
        return log_probs
    return log_probs, shift_to_tokens(vocab_parallel_entropy(logits, true_vocab, temperature), shift)
