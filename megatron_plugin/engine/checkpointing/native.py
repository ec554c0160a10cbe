"""`NativeFormat`: this package's own checkpoint format, `megatron_plugin/1` (see `layout` for the
files). Saving is crash-safe (`native_save`); a load first checks that the checkpoint is of this run's
model (`same_model`), then at this run's layout checks and copies each rank's files (`native_load`), or
at another layout reshards them through HF names (`native_reshard`)."""

from __future__ import annotations

from ...errors import MegatronPluginConfigError
from .collective import agree
from .formats import CheckpointFormat
from .layout import FORMAT, is_checkpoint_dir, read_meta, resolve_checkpoint
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
        return save(output_dir, state)  # uneven stages are refused by plugin.validate (ckpt_format)

    def load(self, input_dir: str, state: TrainingState) -> dict:
        """Every file is checked against the checksum saved with it before anything is loaded. A
        checkpoint of another TP/PP layout is resharded; one of another model is refused."""
        ckpt, meta = agree(lambda: _locate_for_even_stages(input_dir, state))
        grid = state.layout
        if (meta["tp"], meta["pp"], meta.get("vpp")) != (grid.tp_size, grid.pp_size, state.vpp):
            return load_resharded(ckpt, meta, state)
        return load_same_layout(ckpt, meta, state)


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
