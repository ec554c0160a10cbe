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
import logging
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from safetensors.torch import load_file, save_file

from ..errors import MegatronPluginConfigError
from ..fs import atomic_write_text, check_writable, file_checksum

logger = logging.getLogger(__name__)

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


def checkpoint_meta(*, iteration, tp, pp, dp, vpp, distributed_optimizer, model_only, family, variant,
                    make_vocab_size_divisible_by, hf_config) -> dict:
    """meta.json, the same keys for checkpoints of runs and of checkpoint_utils."""
    return {
        "format": FORMAT, "iteration": iteration, "tp": tp, "pp": pp, "dp": dp, "world_size": tp * pp * dp,
        "vpp": vpp, "distributed_optimizer": distributed_optimizer, "model_only": model_only, "family": family,
        "variant": variant, "lm_head": variant != "base", "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "hf_config": hf_config,
    }


def _rank():
    """(tp rank, pp rank, dp rank) of this process."""
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())


def _vpp(engine):
    return len(engine.chunks) if len(engine.chunks) > 1 else None


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
    atomic_write_text(path, json.dumps(meta, indent=2))


def point_latest(output_dir: str, tag: str) -> None:
    atomic_write_text(os.path.join(output_dir, LATEST), tag)


def verify_file(ckpt: str, relpath: str, meta: dict) -> str:
    """The absolute path of a checkpoint file after checking it against meta.json's checksum."""
    path = os.path.join(ckpt, relpath)
    if not os.path.exists(path):
        raise MegatronPluginConfigError("load_state", ckpt, f"the checkpoint lacks {relpath}: it is incomplete")
    expected = (meta.get("files") or {}).get(relpath)
    if expected is not None:
        got = file_checksum(path)
        if got != expected:
            raise MegatronPluginConfigError(
                "load_state", path,
                f"the file is damaged: {got['bytes']} bytes with CRC-32 {got['crc32']}, but it was saved as "
                f"{expected['bytes']} bytes with CRC-32 {expected['crc32']}; restore it or load an older checkpoint",
            )
    return path


def _broadcast_error(message: Optional[str]) -> None:
    """Rank 0 found `message` (or None): every rank raises it, so none waits in a collective."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        setting, value, fix = box[0]
        raise MegatronPluginConfigError(setting, value, fix)


def save_state(output_dir: str, engine, custom_objects=(), distributed_optimizer: bool = False) -> str:
    """Collective: every rank calls it. Returns the checkpoint's folder.

    The folder holds one checkpoint: the previous one (whatever its iteration) is deleted once the new
    one is complete and `latest` names it."""
    rank = dist.get_rank()
    output_dir = os.path.abspath(output_dir)
    tag = [None]
    problem = None
    if rank == 0:
        try:
            check_writable(output_dir, "save_state(output_dir)")
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
        except MegatronPluginConfigError as err:
            problem = (err.setting, err.value, err.fix)
        except OSError as err:
            problem = ("save_state(output_dir)", output_dir, f"cannot write there ({err.strerror}): choose another folder")
    _broadcast_error(problem)
    dist.broadcast_object_list(tag, src=0)
    tag = tag[0]
    staging = os.path.join(output_dir, f".{tag}.partial")
    dist.barrier()

    written = []
    tp_rank, pp_rank, dp_rank = _rank()
    name = shard_name(tp_rank, pp_rank)
    if dp_rank == 0:
        tensors = {k: v.detach().contiguous().cpu() for k, v in _chunk_tensors(engine)}
        save_file(tensors, model_file(staging, tp_rank, pp_rank))
        written.append(model_file(staging, tp_rank, pp_rank))
        written.append(os.path.join(staging, "optimizer", f"{name}_dp000.pt"))
        torch.save(engine.optimizer.state_dict(), written[-1])
        if isinstance(engine.optimizer, torch.optim.Optimizer):
            # which parameter each state index is: what a load into another layout reshards by
            written.append(os.path.join(staging, "optimizer", f"{name}_names.json"))
            atomic_write_text(written[-1], json.dumps(optimizer_param_names(engine)))
    if distributed_optimizer:
        # mcore gathers the DP-sharded optimizer state onto DP rank 0 of each model-parallel rank
        path = os.path.join(staging, "optimizer", f"{name}_param_state.pt")
        engine.optimizer.save_parameter_state(path)
        if dp_rank == 0:
            written.append(path)
    written.append(os.path.join(staging, "rng", f"rank{rank:05d}.pt"))
    torch.save(_rng_state(engine), written[-1])
    if rank == 0 and engine.scheduler is not None:
        written.append(os.path.join(staging, "scheduler.pt"))
        torch.save(engine.scheduler.state_dict(), written[-1])
    if rank == 0:
        for i, obj in enumerate(custom_objects):
            written.append(os.path.join(staging, "custom", f"{i}.pt"))
            torch.save(obj.state_dict(), written[-1])
    sums = {os.path.relpath(p, staging): file_checksum(p) for p in written}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sums)

    final = os.path.join(output_dir, tag)
    if rank == 0:
        files = {k: v for part in everyone for k, v in part.items()}
        write_meta(os.path.join(staging, "meta.json"), dict(checkpoint_meta(
            iteration=engine.iteration,
            tp=parallel_state.get_tensor_model_parallel_world_size(),
            pp=parallel_state.get_pipeline_model_parallel_world_size(),
            dp=parallel_state.get_data_parallel_world_size(),
            vpp=_vpp(engine),
            distributed_optimizer=distributed_optimizer,
            model_only=False,
            family=engine.model.family.name,
            variant=engine.model.variant,
            make_vocab_size_divisible_by=engine.plugin.make_vocab_size_divisible_by,
            hf_config=engine.model.hf_config.to_dict(),
        ), files=dict(sorted(files.items())),
            engine="cpu" if isinstance(engine.optimizer, torch.optim.Optimizer) else "mcore"))
        os.replace(staging, final)
        previous = read_latest(output_dir)
        point_latest(output_dir, tag)
        if previous and previous != tag:
            old = _iteration_of(os.path.join(output_dir, previous))
            if old is not None and old > engine.iteration:
                logger.warning(
                    "save_state: %s held a checkpoint of iteration %d; it is replaced by this one of iteration %d "
                    "(a save_state folder keeps the last checkpoint saved into it)", output_dir, old, engine.iteration)
            shutil.rmtree(os.path.join(output_dir, previous), ignore_errors=True)
    dist.barrier()
    return final


def _iteration_of(ckpt: str) -> Optional[int]:
    try:
        with open(os.path.join(ckpt, "meta.json")) as f:
            return int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_latest(output_dir: str) -> Optional[str]:
    path = os.path.join(output_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def resolve_checkpoint(input_dir: str) -> str:
    """A folder with `latest`, or a checkpoint folder itself (with meta.json)."""
    if input_dir is None or not os.path.isdir(input_dir):
        raise MegatronPluginConfigError(
            "load_state input_dir", input_dir, "no such folder: pass the folder given to accelerator.save_state"
        )
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


def read_meta(ckpt: str) -> dict:
    """meta.json of a checkpoint folder, or a clear error naming it."""
    path = os.path.join(ckpt, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read the checkpoint's metadata ({err})") from None
    needed = ("format", "iteration", "tp", "pp", "dp", "hf_config", "family", "lm_head", "make_vocab_size_divisible_by")
    if isinstance(meta, dict):  # checkpoints written before variants existed say only whether there was an LM head
        meta.setdefault("variant", "lm" if meta.get("lm_head", True) else "base")
    missing = [k for k in needed if k not in meta] if isinstance(meta, dict) else list(needed)
    if missing or meta.get("format") != FORMAT:
        raise MegatronPluginConfigError(
            "load_state", path, f"not a {FORMAT} checkpoint's metadata (missing {missing or 'format'}): is the file damaged?"
        )
    return meta


def _load_model_file(path: str) -> dict:
    try:
        return load_file(path)
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise MegatronPluginConfigError("load_state", path, f"cannot read this model shard ({err}): is it complete?") from None


def _torch_load(path: str, map_location=None):
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:
        raise MegatronPluginConfigError("load_state", path, f"cannot read this file ({err}): is it complete?") from None


def agree(fn):
    """Run `fn` on every rank; if it raised a MegatronPluginConfigError on any rank, raise on all of them
    (the rank's own error where it has one), so no rank is left waiting in a later collective."""
    try:
        result, problem = fn(), None
    except MegatronPluginConfigError as err:
        result, problem = None, (err.setting, err.value, err.fix)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    first = problem or next((p for p in everyone if p is not None), None)
    if first is not None:
        raise MegatronPluginConfigError(*first)
    return result


def optimizer_param_names(engine) -> list:
    """The Megatron name of each parameter of a torch optimizer (CPU engine), in state-dict index order."""
    names = {id(p): n for n, p in engine.model.module.named_parameters()}
    return [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]


def _resharded_optimizer_state(ckpt: str, meta: dict, engine) -> dict:
    """The CPU engine's torch optimizer state saved at another TP layout, moved to this rank's layout
    the way the weights are: per state tensor (exp_avg, ...) all TP shards -> the HF tensor -> this
    rank's shard (mapping.read_shard)."""
    from ..models.convert import model_dims
    from ..models.mapping import TRANSFORMS, expand, read_shard, unshard
    from .hf_io import TensorSlice

    model = engine.model
    old_tp = meta["tp"]
    saved = []
    for t in range(old_tp):
        stem = shard_name(t, 0)
        names = json.loads(open(verify_file(ckpt, os.path.join("optimizer", f"{stem}_names.json"), meta)).read())
        sd = _torch_load(verify_file(ckpt, os.path.join("optimizer", f"{stem}_dp000.pt"), meta), map_location="cpu")
        saved.append({n: sd["state"][i] for i, n in enumerate(names) if i in sd["state"]})
    old_dims = model_dims(model.family, model.hf_config, meta["make_vocab_size_divisible_by"], old_tp)
    rules = model.family.table(model.hf_config, model.variant)
    new_names = optimizer_param_names(engine)
    by_name = {}
    for rule, hf_names, mcore_name in expand(rules, model.plan):
        if mcore_name not in new_names or mcore_name not in saved[0]:
            continue
        entry = {}
        for key, value in saved[0][mcore_name].items():
            if not torch.is_tensor(value) or value.dim() == 0:
                entry[key] = value  # the step count
                continue
            parts = [saved[t][mcore_name][key] for t in range(old_tp)]
            hf = dict(zip(hf_names, TRANSFORMS[rule.transform].to_hf(unshard(parts, rule), old_dims)))
            entry[key] = read_shard(lambda n: TensorSlice(hf[n]), rule, hf_names, model.dims,
                                    parallel_state.get_tensor_model_parallel_world_size(),
                                    parallel_state.get_tensor_model_parallel_rank())
        by_name[mcore_name] = entry
    current = engine.optimizer.state_dict()
    current["state"] = {i: by_name[n] for i, n in enumerate(new_names) if n in by_name}
    return current


def _load_resharded(ckpt: str, meta: dict, engine, custom_objects) -> dict:
    """A checkpoint of another TP/PP/virtual-stage layout: the weights are resharded through HF names
    (the converter's reader); the CPU engine's optimizer state too; mcore's optimizer state, whose
    layout follows the parallel layout, starts fresh (with a warning). RNG states are per rank and
    start fresh when the world size changed."""
    import warnings

    from .hf_io import MegatronReader

    def read():
        reader = MegatronReader(ckpt, setting="load_state")
        for chunk in engine.chunks:
            chunk.load_hf(reader.get_slice, reader.names)
        state = {}
        if meta.get("model_only"):
            return state
        if meta.get("engine") == "cpu" and isinstance(engine.optimizer, torch.optim.Optimizer) and meta["pp"] == 1:
            state["optimizer"] = _resharded_optimizer_state(ckpt, meta, engine)
        if engine.scheduler is not None:
            state["scheduler"] = _torch_load(verify_file(ckpt, "scheduler.pt", meta))
        state["custom"] = [_torch_load(verify_file(ckpt, os.path.join("custom", f"{i}.pt"), meta))
                           for i in range(len(custom_objects))]
        if meta["world_size"] == dist.get_world_size():
            state["rng"] = _torch_load(verify_file(ckpt, os.path.join("rng", f"rank{dist.get_rank():05d}.pt"), meta))
        return state

    with torch.no_grad():
        state = agree(read)
    layout = f"tp={meta['tp']}, pp={meta['pp']}, virtual stages={meta.get('vpp')}"
    if not meta.get("model_only"):
        if "optimizer" in state:
            engine.optimizer.load_state_dict(state["optimizer"])
        else:
            warnings.warn(f"load_state: {ckpt} was saved with {layout}; the weights were resharded to this run's "
                          "layout, the optimizer state could not be and starts fresh")
        if engine.scheduler is not None:
            engine.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            _set_rng_state(state["rng"], engine)
        else:
            warnings.warn(f"load_state: {ckpt} holds RNG states of {meta['world_size']} processes; this run's "
                          "random streams (dropout) start from the plugin's seed")
        for obj, saved in zip(custom_objects, state["custom"]):
            obj.load_state_dict(saved)
    engine.iteration = meta["iteration"]
    dist.barrier()
    return meta


def load_state(input_dir: str, engine, custom_objects=()) -> dict:
    """Collective. Loads model shards, optimizer, scheduler, RNG and iteration; returns meta.json.
    Every file is checked against the checksum saved with it before anything is loaded. A checkpoint of
    another TP/PP layout is resharded (`_load_resharded`)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp_rank, pp_rank, dp_rank = _rank()
    name = shard_name(tp_rank, pp_rank)
    vpp = _vpp(engine)

    located = agree(lambda: (lambda c: (c, read_meta(c)))(resolve_checkpoint(input_dir)))
    if (located[1]["tp"], located[1]["pp"], located[1].get("vpp")) != (tp, pp, vpp):
        return _load_resharded(located[0], located[1], engine, custom_objects)

    def read():
        ckpt, meta = located
        path = verify_file(ckpt, os.path.relpath(model_file(ckpt, tp_rank, pp_rank), ckpt), meta)
        tensors = _load_model_file(path)
        for key, dest in _chunk_tensors(engine):
            if key not in tensors:
                raise MegatronPluginConfigError(
                    "load_state", path, f"the shard lacks tensor {key!r}: it is of another model "
                    f"({meta['hf_config'].get('model_type')}, {meta['hf_config'].get('num_hidden_layers', meta['hf_config'].get('n_layer'))} layers)",
                )
            if tensors[key].shape != dest.shape:
                raise MegatronPluginConfigError(
                    "load_state", path, f"tensor {key!r} has shape {tuple(tensors[key].shape)} in the checkpoint but "
                    f"{tuple(dest.shape)} in this model: the checkpoint is of another model size",
                )
        state = {"ckpt": ckpt, "meta": meta, "tensors": tensors}
        if meta.get("model_only"):
            return state
        rng_rel = os.path.join("rng", f"rank{dist.get_rank():05d}.pt")
        other_dp = meta["world_size"] != dist.get_world_size()  # the same layout, more or fewer replicas
        if other_dp:
            state["rng"] = None
        # the distributed optimizer shards its state over the data-parallel ranks: only the same sharding loads
        sharded = meta["distributed_optimizer"] or engine.plugin.use_distributed_optimizer
        if not (sharded and (other_dp or meta["distributed_optimizer"] != engine.plugin.use_distributed_optimizer)):
            state["optimizer"] = _torch_load(verify_file(ckpt, os.path.join("optimizer", f"{name}_dp000.pt"), meta),
                                             map_location=engine.device)
            if meta["distributed_optimizer"] and dp_rank == 0:
                verify_file(ckpt, os.path.join("optimizer", f"{name}_param_state.pt"), meta)
        if engine.scheduler is not None:
            state["scheduler"] = _torch_load(verify_file(ckpt, "scheduler.pt", meta))
        if "rng" not in state:
            state["rng"] = _torch_load(verify_file(ckpt, rng_rel, meta))
        state["custom"] = [_torch_load(verify_file(ckpt, os.path.join("custom", f"{i}.pt"), meta))
                           for i in range(len(custom_objects))]
        return state

    state = agree(read)
    ckpt, meta = state["ckpt"], state["meta"]
    with torch.no_grad():
        for key, dest in _chunk_tensors(engine):
            dest.copy_(state["tensors"][key])
    if not meta.get("model_only"):
        # model_only checkpoints (checkpoint_utils) are weights: optimizer, scheduler and RNG start fresh
        if "optimizer" not in state:
            import warnings

            warnings.warn(f"load_state: {ckpt} was saved with use_distributed_optimizer={meta['distributed_optimizer']} "
                          f"over {meta['dp']} data-parallel ranks; its optimizer state does not fit this run's and "
                          "starts fresh (the weights are loaded)")
        try:
            if "optimizer" in state:
                engine.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise MegatronPluginConfigError(
                "load_state", os.path.join(ckpt, "optimizer"),
                f"the optimizer state does not fit this run's optimizer ({err}): was it saved with other parameter "
                "groups or frozen parameters?",
            ) from None
        if meta["distributed_optimizer"] and "optimizer" in state:
            engine.optimizer.load_parameter_state(os.path.join(ckpt, "optimizer", f"{name}_param_state.pt"))
        if engine.scheduler is not None:
            engine.scheduler.load_state_dict(state["scheduler"])
        if state["rng"] is not None:
            _set_rng_state(state["rng"], engine)
        else:
            import warnings

            warnings.warn(f"load_state: {ckpt} holds RNG states of {meta['world_size']} processes; this run's "
                          "random streams (dropout) start from the plugin's seed")
        for obj, saved in zip(custom_objects, state["custom"]):
            obj.load_state_dict(saved)
    engine.iteration = meta["iteration"]
    dist.barrier()
    return meta
