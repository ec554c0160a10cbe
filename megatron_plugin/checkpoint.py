"""`save_state` / `load_state` for Megatron runs.

Layout of a checkpoint folder:

    <dir>/latest                         name of the complete checkpoint below (replaced atomically)
    <dir>/iter_0000010/meta.json         layout, iteration, model config (written last)
    <dir>/iter_0000010/model/tp00_pp000.safetensors
    <dir>/iter_0000010/optimizer/tp00_pp000_dp000.pt
    <dir>/iter_0000010/scheduler.pt
    <dir>/iter_0000010/rng/rank00000.pt
    <dir>/iter_0000010/custom/<i>.pt     objects registered with `register_for_checkpointing`

Every rank writes into a staging folder; only when all are done does rank 0 rename it into place and
then point `latest` at it. A crash at any moment leaves `latest` naming a complete checkpoint (the
previous one), and a half-written staging folder is never what `load_state` reads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from safetensors.torch import load_file, save_file

from .errors import MegatronPluginConfigError

LATEST = "latest"
FORMAT = "megatron_plugin/1"


def shard_name(tp_rank: int, pp_rank: int) -> str:
    """The stem of one model-parallel rank's files (model/<stem>.safetensors, optimizer/<stem>_...)."""
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}"


def model_file(ckpt_dir: str, tp_rank: int, pp_rank: int) -> str:
    """One model-parallel rank's weights inside a checkpoint folder."""
    return os.path.join(ckpt_dir, "model", f"{shard_name(tp_rank, pp_rank)}.safetensors")


def chunk_key(chunk: int, num_chunks: int, name: str) -> str:
    """A tensor's name in a model file: chunk i's names get `chunk{i}.` when a rank holds several."""
    return f"chunk{chunk}.{name}" if num_chunks > 1 else name


def checkpoint_meta(*, iteration, tp, pp, dp, vpp, distributed_optimizer, model_only, family, lm_head,
                    make_vocab_size_divisible_by, hf_config) -> dict:
    """meta.json, the same keys for checkpoints of runs and of checkpoint_utils."""
    return {
        "format": FORMAT, "iteration": iteration, "tp": tp, "pp": pp, "dp": dp, "world_size": tp * pp * dp,
        "vpp": vpp, "distributed_optimizer": distributed_optimizer, "model_only": model_only, "family": family,
        "lm_head": lm_head, "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "hf_config": hf_config,
    }


def _rank():
    """(tp rank, pp rank, dp rank) of this process."""
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())


def _vpp(engine):
    return len(engine.chunks) if len(engine.chunks) > 1 else None


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _chunk_tensors(engine):
    """(name in the model file, live tensor) for every chunk's weights: what save writes and load fills."""
    n = len(engine.chunks)
    for i, chunk in enumerate(engine.chunks):
        for k, v in chunk.module.state_dict().items():
            if not k.endswith("_extra_state"):
                yield chunk_key(i, n, k), v


def _rng_state(engine) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "model": engine.rng.state_dict()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict, engine) -> None:
    engine.rng.load_state_dict(state["model"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def write_meta(path: str, meta: dict) -> None:
    _atomic_write_text(path, json.dumps(meta, indent=2))


def point_latest(output_dir: str, tag: str) -> None:
    _atomic_write_text(os.path.join(output_dir, LATEST), tag)


def save_state(output_dir: str, engine, custom_objects=(), distributed_optimizer: bool = False) -> str:
    """Collective: every rank calls it. Returns the checkpoint's folder."""
    rank = dist.get_rank()
    output_dir = os.path.abspath(output_dir)
    tag = [None]
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        base, k = f"iter_{engine.iteration:07d}", 0
        tag[0] = base
        while os.path.exists(os.path.join(output_dir, tag[0])):
            k += 1
            tag[0] = f"{base}_{k}"
        staging = os.path.join(output_dir, f".{tag[0]}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        for sub in ("model", "optimizer", "rng", "custom"):
            os.makedirs(os.path.join(staging, sub))
    dist.broadcast_object_list(tag, src=0)
    tag = tag[0]
    staging = os.path.join(output_dir, f".{tag}.partial")
    dist.barrier()

    tp_rank, pp_rank, dp_rank = _rank()
    name = shard_name(tp_rank, pp_rank)
    if dp_rank == 0:
        tensors = {k: v.detach().contiguous().cpu() for k, v in _chunk_tensors(engine)}
        save_file(tensors, model_file(staging, tp_rank, pp_rank))
        torch.save(engine.optimizer.state_dict(), os.path.join(staging, "optimizer", f"{name}_dp000.pt"))
    if distributed_optimizer:
        # mcore gathers the DP-sharded optimizer state onto DP rank 0 of each model-parallel rank
        engine.optimizer.save_parameter_state(os.path.join(staging, "optimizer", f"{name}_param_state.pt"))
    torch.save(_rng_state(engine), os.path.join(staging, "rng", f"rank{rank:05d}.pt"))
    if rank == 0 and engine.scheduler is not None:
        torch.save(engine.scheduler.state_dict(), os.path.join(staging, "scheduler.pt"))
    if rank == 0:
        for i, obj in enumerate(custom_objects):
            torch.save(obj.state_dict(), os.path.join(staging, "custom", f"{i}.pt"))
    dist.barrier()

    final = os.path.join(output_dir, tag)
    if rank == 0:
        write_meta(os.path.join(staging, "meta.json"), checkpoint_meta(
            iteration=engine.iteration,
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            dp=parallel_state.get_data_parallel_world_size(),
            vpp=_vpp(engine),
            distributed_optimizer=distributed_optimizer,
            model_only=False,
            family=engine.model.family.name,
            lm_head=engine.model.lm_head,
            make_vocab_size_divisible_by=engine.plugin.make_vocab_size_divisible_by,
            hf_config=engine.model.hf_config.to_dict(),
        ))
        os.replace(staging, final)
        previous = read_latest(output_dir)
        point_latest(output_dir, tag)
        if previous and previous != tag:
            shutil.rmtree(os.path.join(output_dir, previous), ignore_errors=True)
    dist.barrier()
    return final


def read_latest(output_dir: str) -> Optional[str]:
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def resolve_checkpoint(input_dir: str) -> str:
    """A folder with `latest`, or a checkpoint folder itself (with meta.json)."""
    if os.path.exists(os.path.join(input_dir, "meta.json")):
        return input_dir
    tag = read_latest(input_dir)
    if tag is None or not os.path.exists(os.path.join(input_dir, tag, "meta.json")):
        raise MegatronPluginConfigError(
            "load_state input_dir", input_dir,
            "no complete checkpoint there (no 'latest' file naming a folder with meta.json): pass the folder "
            "given to accelerator.save_state",
        )
    return os.path.join(input_dir, tag)


def load_state(input_dir: str, engine, custom_objects=()) -> dict:
    """Collective. Loads model shards, optimizer, scheduler, RNG and iteration; returns meta.json."""
    ckpt = resolve_checkpoint(input_dir)
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = _vpp(engine)
    if (meta["tp"], meta["pp"], meta.get("vpp")) != (tp, pp, vpp):
        raise MegatronPluginConfigError(
            "tp_degree/pp_degree/virtual stages", f"{tp}/{pp}/{vpp}",
            f"the checkpoint {ckpt} was saved with tp={meta['tp']}, pp={meta['pp']}, virtual stages="
            f"{meta.get('vpp')}: run with that layout, or reshape it with `python -m checkpoint_utils.convert`",
        )
    tp_rank, pp_rank, _ = _rank()
    name = shard_name(tp_rank, pp_rank)
    tensors = load_file(model_file(ckpt, tp_rank, pp_rank))
    with torch.no_grad():
        for key, dest in _chunk_tensors(engine):
            if key not in tensors:
                raise KeyError(f"checkpoint {ckpt} lacks model tensor {key}")
            dest.copy_(tensors[key])
    if meta.get("model_only"):
        # written by checkpoint_utils: weights only; optimizer, scheduler and RNG start fresh
        engine.iteration = meta["iteration"]
        dist.barrier()
        return meta
    if meta["distributed_optimizer"] != engine.plugin.use_distributed_optimizer:
        raise MegatronPluginConfigError(
            "use_distributed_optimizer", engine.plugin.use_distributed_optimizer,
            f"{ckpt} was saved with use_distributed_optimizer={meta['distributed_optimizer']}: resume with the same",
        )
    engine.optimizer.load_state_dict(
        torch.load(os.path.join(ckpt, "optimizer", f"{name}_dp000.pt"), map_location=engine.device, weights_only=False)
    )
    if meta["distributed_optimizer"]:
        engine.optimizer.load_parameter_state(os.path.join(ckpt, "optimizer", f"{name}_param_state.pt"))
    if engine.scheduler is not None:
        engine.scheduler.load_state_dict(torch.load(os.path.join(ckpt, "scheduler.pt"), weights_only=False))
    rng_path = os.path.join(ckpt, "rng", f"rank{dist.get_rank():05d}.pt")
    if not os.path.exists(rng_path):
        raise MegatronPluginConfigError(
            "world size", dist.get_world_size(),
            f"{ckpt} holds RNG states for {meta['world_size']} ranks; resume with the same number of processes",
        )
    _set_rng_state(torch.load(rng_path, weights_only=False), engine)
    for i, obj in enumerate(custom_objects):
        obj.load_state_dict(torch.load(os.path.join(ckpt, "custom", f"{i}.pt"), weights_only=False))
    engine.iteration = meta["iteration"]
    dist.barrier()
    return meta
