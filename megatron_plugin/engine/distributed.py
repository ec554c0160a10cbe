"""Process groups and seeding: torch.distributed (gloo on CPU, NCCL on GPU) and mcore's parallel state."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import random
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from .. import patches
from ..layout import Layout, current_layout
from ..models import check_model
from ..placement import machine_names, placement
from ..plugin import MegatronLMPlugin, full_iteration_graph
from .full_graph import release_all

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(timeout_minutes: int = 30) -> torch.device:
    """Start torch.distributed from the launcher's environment (a world of one when there is none; the
    environment is left as it was)."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        from datetime import timedelta

        alone = {} if "RANK" in os.environ else dict(
            init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(minutes=timeout_minutes),
            device_id=device if use_cuda else None,
            **alone,
        )
    return device


def initialize(plugin: MegatronLMPlugin, hf_config=None) -> Layout:
    """Validate the plugin against the launch (and the model, when given: then also install the patches
    its models need), then `start`: for scripts and tests that build models themselves (`prepare` checks
    once, in `resolve`, installs, then starts).

    All checks happen before the first collective, so a bad layout raises on every rank instead of
    leaving some ranks waiting for others.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    plugin.validate(world_size=world_size)
    num_layers = None
    if hf_config is not None:
        family = check_model(plugin, hf_config)
        num_layers = family.num_layers(hf_config)
        patches.install(*patches.for_run("cuda" if torch.cuda.is_available() else "cpu", rotary=family.rotary,
                                         wgrad_fusion=bool(plugin.gradient_accumulation_fusion)))
    return start(plugin, num_layers)


def start(plugin: MegatronLMPlugin, num_layers=None, timeout_minutes: int = 30) -> Layout:
    """Collective: torch.distributed, mcore's TP x CP x PP x DP groups and the seeds, from checked settings.
    `timeout_minutes`: of megatron-core's groups (and of the world group when it is started here; under
    accelerate, accelerate starts it, with InitProcessGroupKwargs(timeout=...))."""
    device = init_process_group(timeout_minutes)
    _destroy_gloo_groups_at_exit()
    if not parallel_state.model_parallel_is_initialized():
        vpp = plugin.virtual_pipeline_stages(num_layers) if num_layers else None
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=plugin.tp_degree,
            pipeline_model_parallel_size=plugin.pp_degree,
            virtual_pipeline_model_parallel_size=vpp,
            # megatron-core's default order tp-cp-ep-dp-pp: a CP group's ranks are TP-size apart, as
            # placement.rank_groups reports them
            context_parallel_size=plugin.context_parallel_size or 1,
            expert_model_parallel_size=plugin.expert_model_parallel_size,
            # None: megatron-core's default, the tensor-parallel size
            expert_tensor_parallel_size=plugin.expert_tensor_parallel_size,
            distributed_timeout_minutes=timeout_minutes,
            # mcore's optimizer (its distributed-optimizer checkpointing) wants gloo side-groups next to
            # NCCL; on a CPU run the main groups already are gloo.
            create_gloo_process_groups=torch.cuda.is_available(),
        )
        report_layout(plugin)
    set_seed(plugin.seed, graph_safe=full_iteration_graph(plugin) is not None)
    return current_layout(device)


def report_layout(plugin: MegatronLMPlugin) -> None:
    """Collective, once per start: rank 0 logs which ranks form each TP / CP / PP / DP (/ EP) group and on which
    machine (INFO), and warns when TP groups span machines. A world of one has nothing to place."""
    world = dist.get_world_size()
    if world == 1:
        return
    node = os.environ.get("GROUP_RANK")  # torchrun's machine rank: tells apart launches sharing a hostname
    here = (socket.gethostname(), int(node) if node is not None and node.isdigit() else None)
    everyone = [None] * world
    dist.all_gather_object(everyone, here)
    if dist.get_rank() != 0:
        return
    machines = machine_names([h for h, _ in everyone], [n for _, n in everyone])
    cp = plugin.context_parallel_size or 1
    where = placement(world, plugin.tp_degree, plugin.pp_degree, cp, machines, plugin.expert_model_parallel_size,
                      plugin.expert_tensor_parallel_size)
    logger.info("%s", where.table(plugin.tp_degree, plugin.pp_degree, cp))
    if where.warning:
        logger.warning("%s", where.warning)


def set_seed(seed: int, graph_safe: bool = False) -> None:
    """Same seed on every rank for data order and replicated init; on GPU, mcore's tracker gives TP
    ranks their own stream for dropout inside tensor-parallel regions. `graph_safe`: the tracker's streams are
    generators that a captured CUDA graph advances on each replay (engine/full_graph.py), the same numbers."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mcore_random

        current = mcore_random._CUDA_RNG_STATE_TRACKER  # a tracker of the other kind is made anew
        before = dict(getattr(current, "states_", None) or {})
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, use_cudagraphable_rng=graph_safe,
            force_reset_rng=getattr(current, "use_cudagraphable_rng", graph_safe) != graph_safe)
        keep_generators(before, mcore_random._CUDA_RNG_STATE_TRACKER)


def keep_generators(before: dict, tracker) -> None:
    """A graph-safe tracker seeded again (a second `prepare`) makes new generator objects, while an engine's
    captured CUDA graph keeps advancing the ones it registered (engine/full_graph.py): its replays and its eager
    steps would then draw from two streams, the new one repeating the old one's numbers. So each stream keeps
    its object, re-seeded in place as the new one was (`manual_seed` keeps the state a graph registered). A tracker
    of the other kind (a second prepare without the graph) holds state tensors: nothing is kept, and an earlier
    engine's graph draws from generators the tracker no longer reports (nor checkpoints)."""
    states = getattr(tracker, "states_", None) or {}
    for name, new in list(states.items()):
        old = before.get(name)
        if isinstance(old, torch.Generator) and isinstance(new, torch.Generator) and old is not new:
            old.manual_seed(new.initial_seed())
            states[name] = old


_AT_EXIT = []


def _destroy_gloo_groups_at_exit() -> None:
    """Register, once, `_exit_destroy` to run while the interpreter is still whole."""
    if not _AT_EXIT:
        _AT_EXIT.append(atexit.register(_exit_destroy))


def _exit_destroy() -> None:
    """A script that ends without `accelerator.end_training()` leaves gloo's groups to the interpreter's
    finalization, where their worker threads can abort the process after the run succeeded ("terminate called
    without an active exception", pytorch/pytorch#179291; seen once in CI). Destroyed here instead, and collected,
    so that the groups nothing else holds have joined their threads (a group a live object holds, as our layers hold
    their TP group, keeps its threads until that object goes). Not after an uncaught exception (`sys.last_value`
    set; `sys.exit(n)` counts as a clean exit): a peer may still be inside a collective with this rank, and joining
    gloo's threads would then wait for it instead of exiting. NCCL runs are left to NCCL's own teardown."""
    if hasattr(sys, "last_value") or not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    destroy()
    gc.collect()


def release_model_parallel() -> None:
    """megatron-core's `destroy_model_parallel`, and the group it forgets: 0.16.1 never resets
    `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` (the data-parallel-with-CP group under one optimizer instance),
    which would keep that group, and its gloo threads, alive after the process groups are destroyed."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
        if getattr(parallel_state, name, None) is not None:
            setattr(parallel_state, name, None)


def destroy() -> None:
    release_all()  # before any NCCL group goes (full_graph.release_all)
    release_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
