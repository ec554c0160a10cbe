"""megatron-core's `dist_checkpointing` save and load, usable on CPU with gloo as well as on CUDA.

megatron-core 0.16.1's torch_dist save strategy is asynchronous by design: it stages tensors with
`torch.cuda.synchronize()` and starts a spawn-context `multiprocessing.Manager` for its write queue
(which re-imports the user's `__main__`). On CPU both fail. The synchronous strategy below writes the
same format (megatron-core's keys and ShardedTensor metadata through its own save planner, in a
torch.distributed.checkpoint folder with `metadata.json` and `common.pt`) with torch's plain
`FileSystemWriter`, so what it writes is what `dist_checkpointing.load` (and Megatron-LM) reads.

`save_sharded` is `dist_checkpointing.save`'s steps (factories applied, sharding validated, rank 0's
common.pt, the sharded part, metadata.json), with the two steps where only rank 0 can fail (the
validation, common.pt) told to every rank: there mcore raises on rank 0 alone and leaves the others
waiting in the next collective.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

from .collective import broadcast_error

BACKEND, VERSION = "torch_dist", 1
# where dist_checkpointing keeps the metadata that says how a state dict was sharded (`save(content_metadata=)`)
CONTENT_METADATA = "content_metadata"


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
    entries are written by rank 0 into common.pt. A sharding that does not cover every tensor exactly
    once, or a common.pt that cannot be written, raises on every rank."""
    sharded_part, common = save_preprocess(sharded_state_dict, validate_access_integrity=False)
    problem = None
    try:
        validate_sharding_integrity(determine_global_metadata(sharded_part)[1])  # raises on rank 0 only
    except Exception as err:
        problem = ("save_state", checkpoint_dir, f"the checkpoint's sharding is inconsistent ({type(err).__name__}: {err})")
    broadcast_error(problem)
    if dist.get_rank() == 0:
        try:
            torch.save(common, os.path.join(checkpoint_dir, COMMON_STATE_FNAME))
        except Exception as err:
            problem = ("save_state(output_dir)", checkpoint_dir,
                       f"rank 0 could not write {COMMON_STATE_FNAME} ({type(err).__name__}: {err})")
    broadcast_error(problem)
    SyncTorchDistSaveStrategy(BACKEND, VERSION).save(sharded_part, checkpoint_dir)
    if dist.get_rank() == 0:
        save_config(CheckpointingConfig(BACKEND, VERSION), checkpoint_dir)
    dist.barrier()


def load_sharded(sharded_state_dict: dict, checkpoint_dir: str) -> dict:
    """Collective: the tensors `sharded_state_dict` asks for (this rank's shards, any saved layout)."""
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir)
