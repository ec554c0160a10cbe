"""Checkpoint conversion and reshaping between HF and Megatron layouts (see `convert.py`).

The functions load on first use, so `python -m checkpoint_utils.convert` runs its module once (no
runpy warning) and `--help` answers without importing torch and megatron-core.
"""

_EXPORTS = ("convert_hf_to_megatron", "convert_megatron_to_hf", "reshape_megatron", "main")
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'checkpoint_utils' has no attribute {name!r}")
    from . import convert

    return getattr(convert, name)
