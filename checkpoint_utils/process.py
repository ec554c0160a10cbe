"""A world of one process for the converter: megatron-core's `dist_checkpointing` and its modules'
`sharded_state_dict` want torch.distributed and mcore's parallel state even when one process reads or
writes the whole model, so the converter starts a gloo group of size 1 (TP = PP = DP = 1) and ends what
it started."""

from __future__ import annotations

import contextlib
import socket

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_plugin.errors import MegatronPluginConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_process():
    """Inside: torch.distributed and mcore's groups of one process. Groups that already exist are used
    when they are a world of one (a script that converts after its own setup) and left as they were."""
    started_dist = started_groups = False
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            # the converter writes every tensor from one process; inside a launched job each rank would
            # write the same files at once
            raise MegatronPluginConfigError(
                "checkpoint conversion", f"world size {dist.get_world_size()}",
                "run the converter in one process (python -m checkpoint_utils.convert), not under a launcher",
            )
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        started_dist = True
    try:
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
            started_groups = True
        yield
    finally:
        if started_groups:
            from megatron_plugin.engine.distributed import release_model_parallel

            release_model_parallel()
        if started_dist:
            dist.destroy_process_group()
