"""Run Hugging Face / Accelerate training scripts on Megatron-Core parallelism."""

import warnings

# megatron-core warns at import that TE/apex are absent; they are optional accelerators here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

from .errors import MegatronPluginConfigError  # noqa: E402
from .plugin import MegatronLMPlugin  # noqa: E402
from .scheduler import MegatronLMDummyScheduler  # noqa: E402
from .accelerator import Accelerator  # noqa: E402
from train_steps import (  # noqa: E402
    AbstractTrainStep,
    GPTTrainStep,
    avg_losses_across_data_parallel_group,
    gather_across_data_parallel_groups,
)

__all__ = [
    "AbstractTrainStep",
    "Accelerator",
    "GPTTrainStep",
    "MegatronLMDummyScheduler",
    "MegatronLMPlugin",
    "MegatronPluginConfigError",
    "avg_losses_across_data_parallel_group",
    "gather_across_data_parallel_groups",
]
__version__ = "0.1.0"
