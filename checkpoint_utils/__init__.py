"""Checkpoint conversion and reshaping between HF and Megatron layouts (see `convert.py`)."""

from .convert import convert_hf_to_megatron, convert_megatron_to_hf, main, reshape_megatron

__all__ = ["convert_hf_to_megatron", "convert_megatron_to_hf", "reshape_megatron", "main"]
