"""Reading HF folders and Megatron checkpoints one tensor at a time, and writing outputs safely."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import MegatronPluginConfigError
from ..models import get_family
from ..models.convert import model_dims
from ..models.mapping import TRANSFORMS, StagePlan, TensorSlice, expand, unshard
from .checkpointing.layout import (chunk_key, expert_file, expert_sizes, model_file, read_meta, resolve_checkpoint,
                                  verify_file)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def hf_config_from_dict(d: dict):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = d.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise MegatronPluginConfigError("model_type", model_type, "the checkpoint's config names no model type transformers knows")
    return CONFIG_MAPPING[model_type].from_dict(d)


class HFReader:
    """An HF model folder: config.json plus safetensors (single or sharded) or pytorch_model.bin files.
    `get(name)` reads one tensor; safetensors are memory-mapped, so only that tensor is loaded."""

    def __init__(self, path: str, variant: Optional[str] = None, setting: str = "--load_path", config=None):
        """`variant`: read the tensors of this variant (default: the one config.architectures names);
        `setting`: what errors call the folder; `config`: the HF config to use instead of config.json."""
        if not path or not os.path.isdir(path):
            raise MegatronPluginConfigError(setting, path, "no such folder: pass a local HF model folder")
        cfg = os.path.join(path, "config.json")
        if config is None and not os.path.exists(cfg):
            raise MegatronPluginConfigError(setting, path, "no config.json there: pass an HF model folder")
        if config is None:
            with open(cfg) as f:
                config = hf_config_from_dict(json.load(f))
        self.config = config
        self.setting = setting
        self.family = get_family(self.config)
        self.path = path
        self._where: Dict[str, str] = {}
        self._bin_cache: Tuple[str, dict] = ("", {})
        for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                                   ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            index = os.path.join(path, index_name)
            if os.path.exists(index):
                with open(index) as f:
                    self._where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
                break
            if os.path.exists(os.path.join(path, single)):
                file = os.path.join(path, single)
                self._where = {k: file for k in self._keys(file)}
                break
        if not self._where:
            raise MegatronPluginConfigError(
                setting, path, "no model.safetensors(.index.json) or pytorch_model.bin(.index.json) there"
            )
        for file in set(self._where.values()):
            if not os.path.exists(file):
                raise MegatronPluginConfigError(setting, path, f"the index names {os.path.basename(file)}, which is missing")
        # The variant from config.architectures; a base model's tensors (and old GPT-2 checkpoints') lack
        # the prefix the mapping table names them with.
        archs = getattr(self.config, "architectures", None) or [None]
        self.variant = variant or self.family.variant_of_class(archs[0])
        mapped = self.family.mapped_hf_names(self.config, self.variant)
        prefix = self.family.base_prefix
        self._alias = {}
        for k in self._where:
            self._alias[k if k in mapped or not prefix or (prefix + k) not in mapped else prefix + k] = k

    @staticmethod
    def _keys(file: str) -> List[str]:
        if file.endswith(".safetensors"):
            with _open_safetensors(file) as f:
                return list(f.keys())
        return list(_load_bin(file).keys())

    @property
    def names(self) -> List[str]:
        return list(self._alias)

    def _locate(self, name: str):
        if name not in self._alias:
            raise MegatronPluginConfigError(self.setting, self.path, f"the checkpoint lacks tensor {name!r}")
        key = self._alias[name]
        return key, self._where[key]

    def get(self, name: str) -> torch.Tensor:
        key, file = self._locate(name)
        if file.endswith(".safetensors"):
            with _open_safetensors(file, self.setting) as f:
                return _checked(f.get_tensor, key, file, self.setting)
        if self._bin_cache[0] != file:  # .bin shards load whole; keep one at a time
            self._bin_cache = (file, _load_bin(file, self.setting))
        return self._bin_cache[1][key]

    def get_slice(self, name: str):
        """A lazily read view of one tensor: `.get_shape()`, and indexing (`[a:b]`, `[:, a:b]`) reads
        only those elements from the file (safetensors); .bin files are read whole."""
        key, file = self._locate(name)
        if file.endswith(".safetensors"):
            with _open_safetensors(file, self.setting) as f:
                return _CheckedSlice(f.get_slice(key), key, file, self.setting)
        return TensorSlice(self.get(name))


class _CheckedSlice:
    def __init__(self, inner, key, file, setting):
        self.inner, self.key, self.file, self.setting = inner, key, file, setting

    def get_shape(self):
        return list(self.inner.get_shape())

    def __getitem__(self, index):
        return _checked(self.inner.__getitem__, index, self.file, self.setting, self.key)


def _checked(read, arg, file, setting, key=None):
    try:
        return read(arg)
    except Exception as err:  # a shard cut short fails only when the missing bytes are read
        raise MegatronPluginConfigError(
            setting, file, f"cannot read tensor {key or arg!r} from it ({err}): is the file complete?") from None


@contextlib.contextmanager
def _open_safetensors(file: str, setting: str = "--load_path"):
    try:
        handle = safe_open(file, framework="pt")
    except Exception as err:
        raise MegatronPluginConfigError(setting, file, f"cannot read this safetensors file ({err}); is it complete?") from None
    yield handle


def _load_bin(file: str, setting: str = "--load_path") -> dict:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:
        raise MegatronPluginConfigError(setting, file, f"cannot read this .bin file ({err}); is it complete?") from None


class MegatronReader:
    """A checkpoint written by `accelerator.save_state` or by this package, at any TP/PP/virtual stages and,
    for an MoE model, any expert-parallel / expert tensor-parallel layout. `get(name)` rebuilds one HF
    tensor from the shards of the stage (and expert-parallel rank) that holds it."""

    def __init__(self, path: str, setting: str = "--load_path"):
        self.setting = setting
        self.ckpt = resolve_checkpoint(path)
        self.meta = read_meta(self.ckpt)
        self.config = hf_config_from_dict(self.meta["hf_config"])
        self.family = get_family(self.config)
        self.variant = self.meta["variant"]
        tp = self.meta["tp"]
        self.ep, self.etp = expert_sizes(self.meta) or (1, tp)
        self.dims = model_dims(self.family, self.config, self.meta["make_vocab_size_divisible_by"], tp)
        rules = self.family.table(self.config, self.variant)
        num_layers = self.family.num_layers(self.config)
        vpp = self.meta.get("vpp") or 1
        self._source: Dict[str, tuple] = {}
        for pp in range(self.meta["pp"]):
            for vp in range(vpp):
                stage = StagePlan.for_rank(num_layers, self.meta["pp"], pp, vp, vpp)
                for ep_rank in range(self.ep):
                    plan = self.family.plan_with_experts(self.config, stage, self.ep, ep_rank)
                    for rule, hf_names, mcore_name in expand(rules, plan):
                        if rule.stage == "tied_output" or (ep_rank and not rule.per_expert):
                            continue
                        for i, n in enumerate(hf_names):
                            self._source[n] = (rule, chunk_key(vp, vpp, mcore_name), pp,
                                               ep_rank if rule.per_expert else None, i)
        self.names = list(self._source)
        self._cache: Tuple[str, List[torch.Tensor]] = ("", [])
        for pp in range(self.meta["pp"]):  # every shard complete and undamaged before anything is written
            files = [self._file(t, pp) for t in range(tp)]
            if expert_sizes(self.meta) is not None:
                files += [self._expert_file(t, e, pp) for e in range(self.ep) for t in range(self.etp)]
            for file in files:
                verify_file(self.ckpt, os.path.relpath(file, self.ckpt), self.meta)

    def _file(self, tp_rank: int, pp_rank: int) -> str:
        return model_file(self.ckpt, tp_rank, pp_rank)

    def _expert_file(self, etp_rank: int, ep_rank: int, pp_rank: int) -> str:
        return expert_file(self.ckpt, etp_rank, ep_rank, pp_rank)

    def get_slice(self, name: str):
        return TensorSlice(self.get(name))

    def get(self, name: str) -> torch.Tensor:
        rule, mcore_name, pp, ep_rank, index = self._source[name]
        key = f"{pp}/{ep_rank}/{mcore_name}"
        if self._cache[0] != key:  # q/k/v of one fused tensor are asked for in turn: rebuild it once
            if ep_rank is None:
                files = [self._file(t, pp) for t in range(self.meta["tp"])]
            else:
                files = [self._expert_file(t, ep_rank, pp) for t in range(self.etp)]
            shards = []
            for file in files:
                with _open_safetensors(file) as f:
                    shards.append(f.get_tensor(mcore_name))
            self._cache = (key, TRANSFORMS[rule.transform].to_hf(unshard(shards, rule), self.dims))
        return self._cache[1][index]


@contextlib.contextmanager
def staged_output(save_path: str, overwrite: bool):
    """Yield a temporary folder beside `save_path`; on success it replaces `save_path`, on failure it
    is removed, so `save_path` is never left half-written."""
    save_path = os.path.abspath(save_path)
    if os.path.exists(save_path) and (not os.path.isdir(save_path) or os.listdir(save_path)) and not overwrite:
        raise MegatronPluginConfigError("--save_path", save_path, "exists and is not empty: choose another, or pass --overwrite")
    parent = os.path.dirname(save_path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save_path)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private (0700); the result is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(save_path):
        shutil.rmtree(save_path)
    os.replace(tmp, save_path)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MegatronPluginConfigError("--max_shard_size", text, "use a size such as 200MB or 5GB")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[unit])


WEIGHTS_PATTERN = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


class HFShardWriter:
    """Writes HF weights tensor by tensor into `out`: safetensors shards of at most `max_shard_size`,
    named and indexed as `save_pretrained` names them. At most one shard is held in memory. Shards go
    to temporary files first; `finish` renames them, writes the index and removes weight files of an
    earlier save that the new index does not name."""

    def __init__(self, out: str, max_shard_size="10GB", on_shard=None):
        self.out, self.limit, self.on_shard = out, parse_size(max_shard_size), on_shard
        self.shards, self.current, self.size, self.total = [], {}, 0, 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.limit:
            self._flush()
        self.current[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def _flush(self):
        if self.current:
            file = os.path.join(self.out, f".shard-{len(self.shards):05d}.tmp")
            save_file(self.current, file, metadata={"format": "pt"})
            self.shards.append((file, list(self.current)))
            if self.on_shard is not None:
                self.on_shard(file, self.current)
            self.current, self.size = {}, 0

    def finish(self) -> list:
        """The final file names."""
        self._flush()
        n = len(self.shards)
        weight_map, finals = {}, []
        for i, (file, names) in enumerate(self.shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(file, os.path.join(self.out, final))
            weight_map.update(dict.fromkeys(names, final))
            finals.append(final)
        if n > 1:
            finals.append("model.safetensors.index.json")
            with open(os.path.join(self.out, finals[-1]), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        for old in os.listdir(self.out):
            if WEIGHTS_PATTERN.match(old) and old not in finals:
                os.remove(os.path.join(self.out, old))
        return finals
