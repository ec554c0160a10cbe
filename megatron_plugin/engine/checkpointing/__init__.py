"""Checkpoint formats: the interface (`formats.CheckpointFormat`), what a format saves and restores
(`state.TrainingState`), the native format (`native*`, laid out as `layout` says) and Megatron-LM's
(`megatron_lm*`: torch_dist through `torch_dist_io`, and its legacy torch layout).

`engine/checkpoint.py` picks a format and calls it. This file imports nothing, so that `hf_io` can
read the native layout without loading the formats (which read through `hf_io` when they reshard).
"""
