"""megatron-core's `dist_checkpointing` save and load, usable on CPU with gloo as well as on CUDA.

megatron-core 0.16.1's torch_dist save strategy is asynchronous by design: it stages tensors with
`torch.cuda.synchronize()` and starts a spawn-context `multiprocessing.Manager` for its write queue
(which re-imports the user's `__main__`). On CPU both fail. The synchronous strategy below writes the
same format (megatron-core's keys and ShardedTensor metadata through its own save planner, in a
torch.distributed.checkpoint folder with `metadata.json` and `common.pt`) with torch's plain
`FileSystemWriter`, so what it writes is what `dist_checkpointing.load` (and Megatron-LM) reads.
"""

from __future__ import annotations

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

BACKEND, VERSION = "torch_dist", 1


class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's torch_dist save without its async machinery: one writer thread, no CUDA."""

    def save(self, sharded_state_dict, checkpoint_dir):
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        dcp_save(pyt_state_dict, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                          flatten_state_dict=False))


def save_sharded(sharded_state_dict: dict, checkpoint_dir: str) -> None:
    """Collective over the default group: every rank passes its sharded state dict; common (non-sharded)
    entries are written by rank 0 into common.pt."""
    dist_checkpointing.save(sharded_state_dict, checkpoint_dir,
                            sharded_strategy=SyncTorchDistSaveStrategy(BACKEND, VERSION))


def load_sharded(sharded_state_dict: dict, checkpoint_dir: str) -> dict:
    """Collective: the tensors `sharded_state_dict` asks for (this rank's shards, any saved layout)."""
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir)
