"""Checkpoint formats: the interface (`formats.CheckpointFormat`), what a format saves and restores
(`state.TrainingState`), and today's format (`native`, laid out as `layout` says).

`engine/checkpoint.py` picks a format and calls it. This file imports nothing, so that `hf_io` can
read the native layout without loading the formats (which read through `hf_io` when they reshard).
"""
