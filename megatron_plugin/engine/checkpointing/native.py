"""`NativeFormat`: this package's own checkpoint format, `megatron_plugin/1` (see `layout` for the
files). Saving is crash-safe (`native_save`); a load first checks that the checkpoint is of this run's
model (`same_model`), then at this run's layout checks and copies each rank's files (`native_load`), or
at another layout (TP, PP, virtual stages, EP, expert TP) reshards them through HF names (`native_reshard`)."""

from __future__ import annotations

from ...errors import MegatronPluginConfigError
from .collective import agree
from .formats import CheckpointFormat
from .layout import FORMAT, expert_sizes, is_checkpoint_dir, read_meta, resolve_checkpoint
from .native_load import load_same_layout
from .native_reshard import load_resharded
from .native_save import save
from .same_model import check_same_model
from .state import TrainingState


class NativeFormat(CheckpointFormat):
    name = FORMAT

    def recognizes(self, path: str) -> bool:
        return is_checkpoint_dir(path)

    def save(self, output_dir: str, state: TrainingState) -> str:
        _refuse_split_expert_optimizer(output_dir, state, state.save_optimizer)
        return save(output_dir, state)  # uneven stages are refused by plugin.validate (ckpt_format)

    def load(self, input_dir: str, state: TrainingState) -> dict:
        """Every file is checked against the checksum saved with it before anything is loaded. A
        checkpoint of another TP/PP/EP layout is resharded; one of another model is refused."""
        _refuse_split_expert_optimizer(input_dir, state, state.load_optimizer)
        ckpt, meta = agree(lambda: _locate_for_even_stages(input_dir, state))
        if saved_layout(meta) != run_layout(state):
            return load_resharded(ckpt, meta, state)
        return load_same_layout(ckpt, meta, state)


def saved_layout(meta: dict) -> tuple:
    """(tp, pp, virtual stages, (ep, expert tp) or None) of a checkpoint: what decides its files."""
    return meta["tp"], meta["pp"], meta.get("vpp"), expert_sizes(meta)


def run_layout(state: TrainingState) -> tuple:
    grid = state.layout
    experts = (state.experts.ep_size, state.experts.etp_size) if state.has_experts else None
    return grid.tp_size, grid.pp_size, state.vpp, experts


def _refuse_split_expert_optimizer(folder: str, state: TrainingState, with_optimizer: bool) -> None:
    """megatron-core chains two distributed optimizers when experts are split apart from the dense grid (one
    over the expert data-parallel group), and its `save_parameter_state` then writes a file per data-parallel
    rank 0 of either, with the other's part left out: this format's one file per rank cannot hold that.
    Megatron-LM's torch_dist (the default) saves it through the optimizer's sharded state dict."""
    if not (with_optimizer and state.distributed_optimizer and state.has_experts):
        return
    place = state.experts
    if place.ep_size > 1 or place.etp_size != state.layout.tp_size:
        raise MegatronPluginConfigError(
            "ckpt_format", "megatron_plugin",
            f"{folder}: the distributed optimizer's state of an MoE model with expert_model_parallel_size="
            f"{place.ep_size}, expert_tensor_parallel_size={place.etp_size} is saved by the torch_dist format only: "
            "use ckpt_format='torch_dist' (the default), or no_save_optim / no_load_optim")


def _locate_for_even_stages(input_dir: str, state: TrainingState):
    """`_locate`, for a run whose stages are split evenly: this format's files name stages by an even split of
    the layers, so loading into an uneven last stage would put the wrong layers on each stage (a torch_dist
    checkpoint records each layer's global index)."""
    last = getattr(state.model.plugin, "decoder_last_pipeline_num_layers", None)
    if last is not None:
        raise MegatronPluginConfigError(
            "load_state", input_dir,
            f"a checkpoint of the megatron_plugin format loads into evenly split pipeline stages only, and this run has "
            f"decoder_last_pipeline_num_layers={last}: convert it with checkpoint_utils --checkpoint_format torch_dist",
        )
    return _locate(input_dir, state)


def _locate(input_dir: str, state: TrainingState):
    """(checkpoint folder, its meta.json) of a save folder or of a checkpoint folder, once it is known to
    hold a checkpoint of this run's model."""
    ckpt = resolve_checkpoint(input_dir)
    meta = read_meta(ckpt)
    check_same_model(ckpt, meta, state)
    return ckpt, meta
