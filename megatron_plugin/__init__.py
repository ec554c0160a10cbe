"""Run Hugging Face / Accelerate training scripts on Megatron-Core parallelism.

The public names load on first use, so `megatron-plugin --help` and the questionnaire start in a
fraction of a second instead of importing torch and megatron-core first.
"""

import importlib
import warnings

# megatron-core warns at import that TE/apex are absent; they are optional accelerators here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
# mcore 0.16's TransformerConfig warns about its own default cuda_graph_scope on every construction.
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

from .errors import MegatronPluginConfigError  # noqa: E402
from .plugin import MegatronLMPlugin  # noqa: E402

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
    value = getattr(importlib.import_module(module, __name__ if module.startswith(".") else None), name)
    _explain_accelerate_megatron_error()
    globals()[name] = value
    return value


def _explain_accelerate_megatron_error():
    """A script that builds `accelerate.Accelerator` under a MEGATRON_LM config gets accelerate's
    "Megatron is not installed. please build it from source." Our package is what it should use."""
    import accelerate

    original = accelerate.Accelerator.__init__
    if getattr(original, "_megatron_plugin_wrapped", False):
        return

    def __init__(self, *args, **kwargs):
        try:
            original(self, *args, **kwargs)
        except ImportError as err:
            if "Megatron is not installed" not in str(err):
                raise
            raise ImportError(
                "accelerate.Accelerator was asked for a MEGATRON_LM run, which accelerate only runs on a "
                "Megatron-LM source checkout. Use this package's Accelerator instead: replace "
                "`from accelerate import Accelerator` with `from megatron_plugin import Accelerator`."
            ) from None

    __init__._megatron_plugin_wrapped = True
    accelerate.Accelerator.__init__ = __init__
