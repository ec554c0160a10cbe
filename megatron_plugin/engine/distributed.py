"""Process groups and seeding: torch.distributed (gloo on CPU, NCCL on GPU) and mcore's parallel state."""

from __future__ import annotations

import os
import random
import socket
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ..plugin import MegatronLMPlugin


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the TP x PP x DP grid."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(timeout_minutes: int = 30) -> torch.device:
    """Start torch.distributed from the launcher's environment (a world of one when there is none)."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # mcore's linears recommend this CUDA setting on every call; it means nothing on CPU
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        from datetime import timedelta

        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if use_cuda else None,
        )
    return device


def initialize(plugin: MegatronLMPlugin, hf_config=None) -> Layout:
    """Validate the plugin against the launch (and the model, when given), then build
    torch.distributed and mcore's groups.

    All checks happen before the first collective, so a bad layout raises on every rank instead of
    leaving some ranks waiting for others.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    plugin.validate(world_size=world_size)
    num_layers = None
    if hf_config is not None:
        from ..models import check_model

        num_layers = check_model(plugin, hf_config).transformer_config(hf_config)["num_layers"]
    device = init_process_group()
    if not parallel_state.model_parallel_is_initialized():
        vpp = plugin.virtual_pipeline_stages(num_layers) if num_layers else None
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=plugin.tp_degree,
            pipeline_model_parallel_size=plugin.pp_degree,
            virtual_pipeline_model_parallel_size=vpp,
            # mcore's optimizer (its distributed-optimizer checkpointing) wants gloo side-groups next to
            # NCCL; on a CPU run the main groups already are gloo.
            create_gloo_process_groups=torch.cuda.is_available(),
        )
    set_seed(plugin.seed)
    return current_layout(device)


def current_layout(device: torch.device | None = None) -> Layout:
    ps = parallel_state
    return Layout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")),
    )


def set_seed(seed: int) -> None:
    """Same seed on every rank for data order and replicated init; on GPU, mcore's tracker gives TP
    ranks their own stream for dropout inside tensor-parallel regions."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
