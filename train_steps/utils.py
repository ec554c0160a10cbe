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
