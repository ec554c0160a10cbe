"""`TorchDistFormat`: Megatron-LM's checkpoints (`megatron_lm_layout`), what `save_state` writes by
default (`plugin.ckpt_format="torch_dist"`). It saves megatron-core's torch_dist format
(`megatron_lm_save`), and loads torch_dist checkpoints, ours or Megatron-LM's (`megatron_lm_load`), and
Megatron-LM's legacy torch checkpoints (`megatron_lm_legacy`), at any TP/PP/DP layout.

The public pieces other code builds on (checkpoint_utils writes these checkpoints offline):
`megatron_lm_layout` (names, tracker, `resolve`, checksums) and
`megatron_lm_state.model_sharded_state_dict` / `megatron_args` / `plugin_entry` (what the folder holds).
"""

from __future__ import annotations

from .collective import agree
from .formats import CheckpointFormat
from .megatron_lm_layout import is_checkpoint_dir, kind_of, resolve
from .megatron_lm_legacy import load_legacy
from .megatron_lm_load import load
from .megatron_lm_save import save
from .state import TrainingState

NAME = "torch_dist"


class TorchDistFormat(CheckpointFormat):
    name = NAME

    def recognizes(self, path: str) -> bool:
        return is_checkpoint_dir(path)

    def save(self, output_dir: str, state: TrainingState) -> str:
        return save(output_dir, state)

    def load(self, input_dir: str, state: TrainingState) -> dict:
        """A save folder (its tracker names the checkpoint: `iter_NNNNNNN` or `release`) or a checkpoint folder."""
        ckpt, _, release = agree(lambda: resolve(input_dir))
        if kind_of(ckpt) == "torch":
            return load_legacy(ckpt, release, state)
        return load(ckpt, release, state)
