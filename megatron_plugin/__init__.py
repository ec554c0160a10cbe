"""Run Hugging Face / Accelerate training scripts on Megatron-Core parallelism.

The public names load on first use, so `megatron-plugin --help` and the questionnaire start in a
fraction of a second instead of importing torch and megatron-core first.
"""

import importlib

from .errors import MegatronPluginConfigError
from .plugin import MegatronLMPlugin
from . import quiet as _quiet

_EXPORTS = {
    "Accelerator": ".accelerator",
    "MegatronLMDummyScheduler": ".engine.scheduler",
    "MegatronLMDummyDataLoader": ".data.indexed",
    "AbstractTrainStep": "train_steps",
    "GPTTrainStep": "train_steps",
    "BertTrainStep": "train_steps",
    "T5TrainStep": "train_steps",
    "PolicyGradientTrainStep": "train_steps",
    "DPOTrainStep": "train_steps",
    "avg_losses_across_data_parallel_group": "train_steps",
    "gather_across_data_parallel_groups": "train_steps",
}

__all__ = sorted([*_EXPORTS, "MegatronLMPlugin", "MegatronPluginConfigError"])
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_plugin' has no attribute {name!r}")
    module = _EXPORTS[name]
    with _quiet.quiet(_quiet.QUIET_IMPORT):
        value = getattr(importlib.import_module(module, __name__ if module.startswith(".") else None), name)
    from . import patches

    # the script may build accelerate's own Accelerator next: patches.py says why this one comes here
    patches.install("accelerate_megatron_hint")
    globals()[name] = value
    return value
