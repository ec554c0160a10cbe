"""Megatron-LM's `torch_dist` checkpoints (megatron-core `dist_checkpointing`), written and read in one
process.

Writing builds the whole model at TP = PP = 1 with the package's own builders and layer specs, fills it
from HF tensors through the family's mapping table, and saves the module's `sharded_state_dict()` plus
Megatron-LM's common entries (iteration, checkpoint_version, args) and the `megatron_plugin` entry: the
same keys, shapes and metadata as a `save_state` of a run (the format is layout-free; a run at any TP/PP
reads the global tensors it needs). The vocabulary is padded as the target layout pads it
(`make_vocab_size_divisible_by` x target TP), as Megatron-LM expects at that layout.

Reading builds no model: it asks megatron-core for one key's global tensor at a time (all layers of one
weight: in a world of one process, megatron-core's torch_dist reader wants every shard of a key that its
layers were saved in), and hands HF tensors out grouped by key, so memory stays near one key's stack.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_plugin.engine.checkpointing.megatron_lm_state import (
    CHECKPOINT_VERSION,
    ENTRY,
    model_sharded_state_dict,
    sharding_metadata,
)
from megatron_plugin.errors import MegatronPluginConfigError

from .mapped_reader import MappedReader
from .megatron_lm_args import model_of
from .megatron_lm_layout import iteration_of_tag, verify
from .megatron_lm_names import sharded_keys, split_layer


def build_module(reader, tp: int, params_dtype: torch.dtype, make_vocab_size_divisible_by: int) -> torch.nn.Module:
    """The whole Megatron-Core module on CPU carrying `reader`'s weights (inside `process.one_process`),
    its vocabulary padded for `tp` ranks."""
    from megatron_plugin import patches
    from megatron_plugin.models.convert import load_hf_into_mcore, model_dims
    from megatron_plugin.models.gpt import build_model, build_transformer_config
    from megatron_plugin.plugin import MegatronLMPlugin

    cfg, family, variant = reader.config, reader.family, reader.variant
    # one rank pads as `tp` ranks do when it pads to a multiple of divisible_by * tp
    divisible = make_vocab_size_divisible_by * tp
    plugin = MegatronLMPlugin(tp_degree=1, pp_degree=1, make_vocab_size_divisible_by=divisible)
    installed = patches.install(*patches.for_run("cpu", wgrad_fusion=False, rotary=family.rotary))
    try:
        config = build_transformer_config(family, cfg, plugin, params_dtype=params_dtype, device_type="cpu")
        plan = family.whole_plan(cfg)  # every layer and, in one process, every expert
        module = (family.build or build_model)(family, cfg, config, plugin, plan, variant=variant, backend="local")
        load_hf_into_mcore(module, reader.get_slice, reader.names, family, cfg, plan, model_dims(family, cfg, divisible, 1),
                           variant=variant, tp_size=1, tp_rank=0, extra_tensors="warn")
    finally:
        patches.undo(*installed)
    # mcore allocates some tensors (learned position embeddings) in fp32 whatever params_dtype says;
    # Megatron-LM's Float16Module casts the whole model, so its bf16/fp16 checkpoints hold every tensor so
    module.to(params_dtype)
    return module


def sharded_state_dict(module: torch.nn.Module, metadata: dict) -> dict:
    """{'model': the module's sharded state dict}, as save_state builds it. mcore's LanguageModule looks up
    `output_layer.weight` on the last stage unless embeddings are shared; the HF variants without an LM head
    (BertModel, T5Model) have no output layer at all, so for them it is asked as a stage without one (the
    flag is read for nothing else there), then put back."""
    headless = getattr(module, "post_process", False) and not hasattr(module, "output_layer")
    if headless:
        module.post_process = False
    try:
        return model_sharded_state_dict([module], metadata)
    finally:
        if headless:
            module.post_process = True


def write(reader, ckpt: str, *, tp: int, params_dtype: torch.dtype, make_vocab_size_divisible_by: int, iteration: int,
          args, entry: dict, distributed_optimizer: bool = False, print_structure: bool = False) -> None:
    """Write `reader`'s model as a torch_dist checkpoint into the new folder `ckpt` (inside one_process):
    what save_state writes of a model, with no optimizer, scheduler or RNG state."""
    from megatron_plugin.engine.checkpointing.torch_dist_io import CONTENT_METADATA, save_sharded

    module = build_module(reader, tp, params_dtype, make_vocab_size_divisible_by)
    metadata = sharding_metadata(distributed_optimizer)
    state = dict(sharded_state_dict(module, metadata), iteration=iteration, checkpoint_version=CHECKPOINT_VERSION,
                 args=args, num_floating_point_operations_so_far=0)
    state[ENTRY] = entry
    state[CONTENT_METADATA] = metadata
    os.makedirs(ckpt)
    save_sharded(state, ckpt)
    del state, module
    if print_structure:
        print_torch_dist(ckpt)


def _tensors_metadata(ckpt: str, setting: str) -> dict:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_tensors_metadata(ckpt)
    except (Exception, CheckpointException) as err:  # a missing or cut .metadata file (torch's error is a BaseException)
        raise MegatronPluginConfigError(setting, ckpt, f"cannot read its tensor metadata ({err}): is it complete?") from None


def print_torch_dist(ckpt: str) -> None:
    print(f"== {os.path.basename(os.path.normpath(ckpt))} (torch_dist)")
    for key, t in sorted(_tensors_metadata(ckpt, "--save_path").items()):
        print(f"   {key}: {tuple(t.global_shape)} {str(t.dtype).replace('torch.', '')}")


def load_common(ckpt: str, setting: str = "--load_path") -> dict:
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(ckpt)
    except (Exception, CheckpointException) as err:
        raise MegatronPluginConfigError(
            setting, os.path.join(ckpt, "common.pt"), f"cannot read the checkpoint's common state ({err}): is it complete?"
        ) from None
    return common if isinstance(common, dict) else {}


# stacks kept for reads that do not come grouped by key (a reshape of T5, whose table is layer-major);
# beyond this, the least recently used are dropped and read again when asked for
CACHE_BYTES = 1 << 32


class TorchDistReader(MappedReader):
    """A torch_dist checkpoint folder (one iteration's) as HF tensors. Use inside `process.one_process`."""

    def __init__(self, ckpt: str, hf_config: Optional[str] = None, setting: str = "--load_path"):
        verify(ckpt, setting)
        common = load_common(ckpt, setting)
        config, family, variant, self.make_vocab_size_divisible_by = model_of(common, hf_config, ckpt)
        self.ckpt = ckpt
        iteration = common.get("iteration")
        self.meta = {"iteration": int(iteration) if isinstance(iteration, int) else iteration_of_tag(ckpt)}
        self.tensors = _tensors_metadata(ckpt, setting)
        super().__init__(config, family, variant, [(0, 0, family.whole_plan(config))], setting, ckpt)
        self._where: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        layers: Dict[str, int] = {}
        for _, name, *_ in self.sources():
            parts = split_layer(name)
            if parts is not None:
                layers[parts[0]] = max(layers.get(parts[0], 0), parts[1] + 1)
        for _, name, *_ in self.sources():  # every tensor there, of the config's depth, before anything is written
            candidates = sharded_keys(name)
            key, index, axes = next((c for c in candidates if c[0] in self.tensors), (None, (), ()))
            if key is None:
                raise MegatronPluginConfigError(
                    setting, ckpt, f"the checkpoint has no tensor {candidates[0][0]!r} (for {name}): is it of this HF "
                    f"model ({family.name}, variant {variant!r})?")
            shape = tuple(self.tensors[key].global_shape)
            stack = split_layer(name)[0] if split_layer(name) else None
            expected = {"layer": layers.get(stack), "expert": family.num_experts(config)}
            for axis, (what, size) in enumerate(zip(axes, shape)):
                if size != expected[what]:
                    raise MegatronPluginConfigError(
                        setting, ckpt, f"{key} holds {size} {what}s, the HF config {expected[what]}: is the HF config "
                        "this model's?")
            self._where[name] = (key, index)
        first = {}
        for n in self.names:
            first.setdefault(self._where[self._source[n][1]][0], len(first))
        self.names.sort(key=lambda n: first[self._where[self._source[n][1]][0]])  # stable: layers stay in order
        self._stacks: "OrderedDict[str, torch.Tensor]" = OrderedDict()

    def _read(self, rule, mcore_name: str, pp: int, vp: int, ep: int = 0) -> torch.Tensor:
        key, index = self._where[mcore_name]
        stack = self._stack(key)
        return stack[index].clone() if index else stack  # a view would keep the whole stack alive

    def _stack(self, key: str) -> torch.Tensor:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        if key in self._stacks:
            self._stacks.move_to_end(key)
            return self._stacks[key]
        meta = self.tensors[key]
        request = ShardedTensor.from_rank_offsets(key, torch.empty(tuple(meta.global_shape), dtype=meta.dtype), replica_id=0)
        try:
            tensor = dist_checkpointing.load({"tensor": request}, self.ckpt, validate_access_integrity=False)["tensor"]
        except (Exception, CheckpointException) as err:  # a .distcp file cut short or missing (a BaseException)
            raise MegatronPluginConfigError(
                self.setting, self.ckpt, f"cannot read {key} ({type(err).__name__}: {err}): is the checkpoint complete?"
            ) from None
        self._stacks[key] = tensor
        while len(self._stacks) > 1 and sum(t.numel() * t.element_size() for t in self._stacks.values()) > CACHE_BYTES:
            self._stacks.popitem(last=False)
        return tensor
