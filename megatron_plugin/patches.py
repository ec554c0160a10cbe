"""Every change this package makes to megatron-core, accelerate or Python's process-wide state, in one place.

Megatron-Core picks some implementations at import time into module globals (apex's kernels, TE's fused
rope); without TE or apex those globals hold slow loops or nothing. A patch here puts our
implementation into such a global. Each one names the library version it was checked against and
why it exists; `prepare` installs the ones its run needs (`for_run`), by name, once (so does
`engine.distributed.initialize` for scripts that build models themselves); what needs one and finds it
missing says so (`require`); `undo` puts back exactly what was there (tests do). `check_versions` lists
the libraries whose installed version differs from the one the patches were read against (a test fails
on it), so an upgrade is a deliberate re-read, not a silent breakage.

The implementations live with their concern (`layers/foreach_ops.py`, `layers/wgrad.py`,
`layers/rope.py`); this module is the only one that writes into another library's namespace.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from .errors import MegatronPluginConfigError

# the versions every patch below was read against
CHECKED = {"megatron-core": "0.16.1", "accelerate": "1.15.0"}

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    name: str
    library: str  # a key of CHECKED
    why: str
    # -> [(object, attribute, new value)] to set, or [] where the library already has the real thing
    targets: Callable[[], List[Tuple[object, str, object]]]


def _foreach_targets():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from .layers import foreach_ops as ours

    out = []
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        out += [(clip_grads, "multi_tensor_applier", ours.multi_tensor_applier),
                (clip_grads, "l2_norm_impl", ours.multi_tensor_l2norm),
                (clip_grads, "multi_tensor_scale_impl", ours.multi_tensor_scale)]
    if optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        out += [(optimizer, "multi_tensor_applier", ours.multi_tensor_applier),
                (optimizer, "multi_tensor_scale_impl", ours.multi_tensor_scale)]
    return out


def _wgrad_targets():
    from megatron.core.tensor_parallel import layers

    from .layers import wgrad

    if layers._grad_accum_fusion_available and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None:
        return []  # apex's extension is there and stays
    return [(layers, "fused_weight_gradient_mlp_cuda", wgrad), (layers, "_grad_accum_fusion_available", True)]


def _rope_targets():
    from megatron.core.models.common.embeddings import rope_utils

    from .layers import rope

    return [(rope_utils, "fused_apply_rotary_pos_emb", rope.fused_slot(rope_utils.fused_apply_rotary_pos_emb))]


def _cpu_warning_targets():
    from megatron.core.tensor_parallel import layers

    # mcore marks this function once it has warned; marked, it stays quiet
    return [(layers.linear_with_grad_accumulation_and_async_allreduce, "warned", True)]


def _cpu_sequence_parallel_targets():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random

    from .layers import sp_comm

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    fork = mcore_random.CudaRNGStatesTracker.__dict__["fork"]

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if input_.device.type != "cpu" or group is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return sp_comm.all_gather_rows(input_, group, output_split_sizes)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_.device.type != "cpu" or group is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        return sp_comm.reduce_scatter_rows(input_, group, input_split_sizes)

    def cpu_fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:  # no CUDA stream was seeded (engine.distributed.set_seed): nothing to fork
            return contextlib.nullcontext()
        return fork(self, name)

    return [(mappings, "_gather_along_first_dim", _gather_along_first_dim),
            (mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim),
            (mcore_random.CudaRNGStatesTracker, "fork", cpu_fork)]


def _tp_grad_sum_targets():
    import importlib

    # the module, not the function of the same name that megatron.core.distributed exports
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    from .layers import tp_grads

    original = fmg._allreduce_non_tensor_model_parallel_grads

    def _allreduce_non_tensor_model_parallel_grads(model, config, tp_group=None):
        return tp_grads.allreduce_non_tensor_model_parallel_grads(model, config, tp_group, fallback=original)

    return [(fmg, "_allreduce_non_tensor_model_parallel_grads", _allreduce_non_tensor_model_parallel_grads)]


def _accelerate_targets():
    import accelerate

    original = accelerate.Accelerator.__init__

    def __init__(self, *args, **kwargs):
        try:
            original(self, *args, **kwargs)
        except ImportError as err:
            if "Megatron is not installed" not in str(err):
                raise
            raise ImportError(
                "accelerate.Accelerator was asked for a MEGATRON_LM run, which accelerate only runs on a "
                "Megatron-LM source checkout. Use this package's Accelerator instead: replace "
                "`from accelerate import Accelerator` with `from megatron_plugin import Accelerator`."
            ) from None

    return [(accelerate.Accelerator, "__init__", __init__)]


PATCHES: Dict[str, Patch] = {p.name: p for p in (
    Patch("foreach_clip", "megatron-core",
          "mcore's grad norm, clipping and main->model weight copy fall back to per-tensor Python loops (the norm "
          "reads every tensor's norm back to the host) without apex; torch's _foreach kernels do it in a few "
          "launches (layers/foreach_ops.py). CUDA runs.",
          _foreach_targets),
    Patch("wgrad_fusion", "megatron-core",
          "gradient_accumulation_fusion needs apex's fused_weight_gradient_mlp_cuda; layers/wgrad.py is the same "
          "on torch (the weight-gradient GEMM accumulates into fp32 main_grad). CUDA runs with the fusion on.",
          _wgrad_targets),
    Patch("rope_tables", "megatron-core",
          "mcore applies rotary embeddings through its fused-rope slot (TE's kernel) when apply_rope_fusion=True; "
          "our rotary families hand it precomputed [cos | sin] tables (layers/rope.py). Rotary families.",
          _rope_targets),
    Patch("quiet_cuda_connections_warning", "megatron-core",
          "mcore's tensor-parallel linears recommend CUDA_DEVICE_MAX_CONNECTIONS=1, a CUDA stream setting that "
          "means nothing on CPU (gloo). CPU runs.",
          _cpu_warning_targets),
    Patch("cpu_sequence_parallel", "megatron-core",
          "sequence parallelism on CPU (gloo). mcore's sequence-parallel mappings (the embedding's scatter, whose "
          "backward gathers; the gathers and reduce-scatters of Pooler, MoE dispatchers and our models) allocate "
          "their outputs on torch.cuda.current_device(), and gloo has no reduce-scatter: on CPU tensors they run "
          "through layers/sp_comm.py's collectives. mcore's TransformerBlock and LanguageModelEmbedding fork the "
          "CUDA RNG tracker under sequence_parallel, which raises when no CUDA stream was seeded: there the fork "
          "does nothing (the CPU generator draws the dropout, as everywhere on CPU). CPU runs.",
          _cpu_sequence_parallel_targets),
    Patch("tp_grad_sums", "megatron-core",
          "finalize_model_grads sums the gradients each TP rank holds whole (SP's norms and biases, q/k norms) after "
          "walking every parameter to find them, and copies each sum back with its own launch (219 a step at GPT-2 "
          "774M TP = 2 + SP, in a step the host bounds); layers/tp_grads.py finds them once and copies back in one "
          "foreach launch. CUDA runs.",
          _tp_grad_sum_targets),
    Patch("accelerate_megatron_hint", "accelerate",
          "accelerate.Accelerator under a MEGATRON_LM config fails with 'Megatron is not installed. please build "
          "it from source.'; the hint names our Accelerator. The one patch not installed by prepare: it must be "
          "in place before the script builds accelerate's Accelerator, so the package installs it when a "
          "public name is first used.",
          _accelerate_targets),
)}

_installed: Dict[str, List[Tuple[object, str, object]]] = {}  # name -> [(object, attribute, previous value)]


def installed() -> List[str]:
    return sorted(_installed)


def current(obj, attr):
    # a class's own attribute, not one inherited from a base (undo must not copy a base's down)
    return obj.__dict__.get(attr, _MISSING) if isinstance(obj, type) else getattr(obj, attr, _MISSING)


def install(*names: str) -> List[str]:
    """Install the named patches that are not in place yet. Returns the names that changed something."""
    done = []
    for name in names:
        if name in _installed:
            continue
        targets = PATCHES[name].targets()
        _installed[name] = [(obj, attr, current(obj, attr)) for obj, attr, _ in targets]
        for obj, attr, value in targets:
            setattr(obj, attr, value)
        if targets:
            done.append(name)
    return done


def undo(*names: str) -> None:
    """Put back what the named patches replaced (`undo(*installed())` for all of them)."""
    for name in names:
        for obj, attr, value in reversed(_installed.pop(name, [])):
            if value is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, value)


def require(what: str, *names: str) -> None:
    """Raise a clear error when `what` needs patches that are not installed (a model or engine built
    outside `prepare`): without them mcore fails deep inside (rope) or silently runs its slow loops."""
    missing = [n for n in names if n not in _installed]
    if missing:
        raise MegatronPluginConfigError(
            what, f"built without the patches {missing}",
            f"build through accelerator.prepare or engine.distributed.initialize(plugin, hf_config), or call "
            f"megatron_plugin.patches.install({', '.join(repr(n) for n in missing)}) first (patches.py says why)",
        )


def for_run(device_type: str, *, wgrad_fusion: bool, rotary: bool) -> Tuple[str, ...]:
    """The patches one run needs."""
    names = []
    if device_type == "cpu":
        names += ["quiet_cuda_connections_warning", "cpu_sequence_parallel"]
    if device_type == "cuda":
        names += ["foreach_clip", "tp_grad_sums"]
        if wgrad_fusion:
            names.append("wgrad_fusion")
    if rotary:
        names.append("rope_tables")
    return tuple(names)


def check_versions() -> Dict[str, str]:
    """{library: installed version} for every library whose installed version differs from CHECKED."""
    out = {}
    for library, checked in CHECKED.items():
        got = importlib.metadata.version(library)
        if got != checked:
            out[library] = got
    return out
