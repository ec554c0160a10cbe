"""HF `Trainer` (and, through `trl.py`, TRL's trainers) on Megatron-Core parallelism.

`from megatron_plugin.integrations import Trainer` needs only transformers; TRL's trainers are imported on
first use, so a script that never names them does not need trl installed.
"""

from .trainer import MegatronTrainerMixin, Trainer

__all__ = ["MegatronTrainerMixin", "Trainer", "SFTTrainer", "DPOTrainer"]

_TRL_NAMES = ("SFTTrainer", "DPOTrainer")


def __getattr__(name):
    if name in _TRL_NAMES:
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
