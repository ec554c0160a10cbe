"""`CheckpointFormat`: how one on-disk format saves and loads a `TrainingState`.

`save_state` / `load_state` (engine/checkpoint.py) only choose a format and call it: for a save, by
name; for a load, the first registered format that `recognizes` the folder. Two are registered:
`native.NativeFormat` (`megatron_plugin/1`) and `megatron_lm.TorchDistFormat` (Megatron-LM's layout,
megatron-core's torch_dist; it also reads Megatron-LM's legacy torch checkpoints).
"""

from __future__ import annotations

from .state import TrainingState


class CheckpointFormat:
    """One checkpoint format. `save` and `load` are collective: every rank calls them, and an error on
    one rank is raised on all (see `collective.agree`), so no rank waits for one that stopped."""

    name: str = ""

    def recognizes(self, path: str) -> bool:
        """Whether `path` (an existing folder) holds a checkpoint of this format; cheap, reads no weights."""
        raise NotImplementedError

    def save(self, output_dir: str, state: TrainingState) -> str:
        """Write `state` into `output_dir`; returns the folder of the checkpoint written."""
        raise NotImplementedError

    def load(self, input_dir: str, state: TrainingState) -> dict:
        """Fill `state` (weights, optimizer, scheduler, RNG, registered objects, iteration) from the
        checkpoint in `input_dir`; returns its metadata (at least `iteration`)."""
        raise NotImplementedError
