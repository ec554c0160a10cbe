"""Train steps: how a batch becomes Megatron inputs, what the model returns, and the loss.

The API is accelerate's (`AbstractTrainStep`, `GPTTrainStep`, `get_batch_func`, `get_forward_step_func`,
`get_loss_func`), so custom steps written for accelerate's Megatron-LM integration run unchanged.
"""

from .base import AbstractTrainStep
from .gpt import GPTTrainStep
from .utils import avg_losses_across_data_parallel_group, gather_across_data_parallel_groups

__all__ = [
    "AbstractTrainStep",
    "GPTTrainStep",
    "avg_losses_across_data_parallel_group",
    "gather_across_data_parallel_groups",
]
