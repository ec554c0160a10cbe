"""Train steps: how a batch becomes Megatron inputs, what the model returns, and the loss.

The API is accelerate's (`AbstractTrainStep`, `GPTTrainStep`, `get_batch_func`, `get_forward_step_func`,
`get_loss_func`), so custom steps written for accelerate's Megatron-LM integration run unchanged.
"""

from .base import AbstractTrainStep
from .bert import BertTrainStep
from .dpo import DPOTrainStep
from .gpt import GPTTrainStep
from .policy import PolicyGradientTrainStep, PolicyOutput
from .t5 import T5TrainStep
from .utils import (avg_losses_across_data_parallel_group, gather_across_data_parallel_groups, per_token_log_probs,
                    per_token_loss_result, sum_across_data_parallel_group)

__all__ = [
    "AbstractTrainStep",
    "BertTrainStep",
    "DPOTrainStep",
    "GPTTrainStep",
    "PolicyGradientTrainStep",
    "PolicyOutput",
    "T5TrainStep",
    "avg_losses_across_data_parallel_group",
    "gather_across_data_parallel_groups",
    "per_token_log_probs",
    "per_token_loss_result",
    "sum_across_data_parallel_group",
]
