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


def context_parallel_size() -> int:
    return parallel_state.get_context_parallel_world_size()


def _data_parallel_group(with_context_parallel: bool):
    """The data-parallel group, with the context-parallel ranks only when there are several: at CP=1 the
    plain group (the same ranks) keeps the communicators a run without CP always used."""
    return parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel and context_parallel_size() > 1)


def avg_context_parallel_parts_across_data_parallel_group(losses):
    """Like `avg_losses_across_data_parallel_group`, for values each context-parallel rank holds a part of
    (a local token sum over the CP-wide token count): summed over the CP ranks of a replica, then averaged
    over the data-parallel ranks (detached, for logging). At CP=1 the same as the plain average."""
    summed = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = _data_parallel_group(with_context_parallel=True)
    dist.all_reduce(summed, group=group)
    return summed / dist.get_world_size(parallel_state.get_data_parallel_group())


def sum_across_data_parallel_group(pairs, replicated_over_context_parallel: bool = False):
    """Per-token logging (calculate_per_token_loss): each (sum, count) of a micro-batch, summed over the
    data-parallel (and context-parallel) ranks, as a [sum, count] tensor (detached) in one all-reduce. The engine
    adds the micro-batches' pairs and logs sum / count: the value over every token of the global batch, as
    Megatron-LM's training loop does with the [loss, tokens] its loss functions report.
    `replicated_over_context_parallel`: every CP rank holds the whole pair (computed from values gathered over
    the sequence), so only the data-parallel ranks are summed."""
    stacked = torch.stack([torch.stack([s.detach().float().reshape(()), c.detach().to(s.device).float().reshape(())])
                           for s, c in pairs])
    if replicated_over_context_parallel:
        group = parallel_state.get_data_parallel_group()
    else:
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


# -- context parallelism: a loss over the whole sequence from this rank's part of it ---------------------------
# Under CP each rank holds two chunks of every sequence (layers/context_parallel.py). A loss that is a sum
# over tokens stays a sum of per-rank parts (GPTTrainStep: the local sum over the CP-wide count). One that
# needs whole sequences (token-aligned values shifted across chunk edges, per-sequence sums inside a
# non-linear function: policy and DPO losses) is computed identically on every CP rank from gathered values:
# each rank's backward then reaches only its own tokens, so the CP ranks' gradients add up to the whole
# one, as they do for the summed kind; the engines scale both alike (x CP, averaged over DP x CP).


def whole_sequence(values, dim: int = 1):
    """This CP rank's per-position `values` (e.g. log-probs [b, 2L]) -> the whole sequence [b, s] in sequence
    order, with a backward that keeps this rank's positions of the gradient: for losses every CP rank
    computes identically from the result. CP=1: `values` itself."""
    from megatron_plugin.layers.context_parallel import gather_sequence

    return gather_sequence(values, context_parallel_size(), dim, reduce_grad=False)


def whole_sequence_no_grad(values, dim: int = 1):
    """The same without autograd: targets and batch tensors (old log-probs, advantages) split by the engine."""
    from megatron_plugin.layers.context_parallel import unshard

    return unshard(values, dim) if context_parallel_size() > 1 else values


class _SumOverContextParallel(torch.autograd.Function):
    """All-reduce (sum) over the CP group; the backward passes the gradient through unchanged, right when
    every CP rank computes the same loss from the sum (each rank's part then gets that loss's gradient)."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out, group=parallel_state.get_context_parallel_group())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


def sum_over_context_parallel(values):
    """Per-row sums of this CP rank's tokens -> the whole rows' sums (identical on every CP rank), for a loss
    every CP rank computes identically from them (DPO's per-sequence log-probs). CP=1: `values` itself."""
    if context_parallel_size() == 1:
        return values
    return _SumOverContextParallel.apply(values)


def count_on_first_context_parallel_rank(count):
    """A count that every CP rank holds whole, kept on CP rank 0 only (0 elsewhere): Megatron's per-token
    contract sums counts over DP x CP, which would otherwise count it once per CP rank."""
    if context_parallel_size() == 1 or parallel_state.get_context_parallel_rank() == 0:
        return count
    return torch.zeros_like(count)
