"""The checkpoint format seam: save_state / load_state go through `CheckpointFormat`s. A format
registered here (one torch file) is what save_state writes when named and what load_state picks for its
folder; the native format (`ckpt_format="megatron_plugin"`) and Megatron-LM's torch_dist (the default) still
load their own folders; a folder no format knows is refused clearly."""

import os

import pytest
import torch

from checkpoint_utils import convert_hf_to_megatron
from megatron_plugin import MegatronPluginConfigError
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import model_weights, prepared_gpt2


def _one_file_format():
    """A trivial format: weights, optimizer and iteration in one torch file. It sees only the
    TrainingState it is handed."""
    from megatron_plugin.engine.checkpointing.formats import CheckpointFormat

    class OneFile(CheckpointFormat):
        name = "test/one_file"
        seen = []

        def recognizes(self, path):
            return os.path.exists(os.path.join(path, "state.pt"))

        def save(self, output_dir, state):
            self.seen.append(type(state))
            os.makedirs(output_dir, exist_ok=True)
            torch.save({"weights": {k: v.clone() for k, v in state.named_tensors()},
                        "optimizer": state.optimizer.state_dict(), "iteration": state.iteration},
                       os.path.join(output_dir, "state.pt"))
            return output_dir

        def load(self, input_dir, state):
            self.seen.append(type(state))
            saved = torch.load(os.path.join(input_dir, "state.pt"), weights_only=False)
            with torch.no_grad():
                for key, dest in state.named_tensors():
                    dest.copy_(saved["weights"][key])
            state.optimizer.load_state_dict(saved["optimizer"])
            state.set_iteration(saved["iteration"])
            return {"format": self.name, "iteration": saved["iteration"]}

    return OneFile()


def _round_trip_worker(root):
    from megatron_plugin.engine import checkpoint
    from megatron_plugin.engine.checkpointing.state import TrainingState

    acc, engine, batches = prepared_gpt2(steps_before=1, ckpt_format="megatron_plugin")
    fmt = checkpoint.register_format(_one_file_format())
    try:
        one_dir, native_dir = os.path.join(root, "one"), os.path.join(root, "native")
        dist_dir = os.path.join(root, "torch_dist")
        saved, iteration = model_weights(engine), engine.iteration
        written = checkpoint.save_state(one_dir, engine, format_name=fmt.name)
        acc.save_state(native_dir)  # the plugin's ckpt_format: the native format
        checkpoint.save_state(dist_dir, engine)  # the default: Megatron-LM's torch_dist
        engine(**next(batches))
        engine(**next(batches))
        moved = any(not torch.equal(v, saved[k]) for k, v in model_weights(engine).items())
        meta = acc.load_state(one_dir)  # found by the registered format's `recognizes`
        one = {"meta": meta, "iteration": engine.iteration,
               "equal": all(torch.equal(v, saved[k]) for k, v in model_weights(engine).items())}
        engine(**next(batches))
        meta = acc.load_state(native_dir)
        native = {"format": meta["format"], "iteration": engine.iteration,
                  "equal": all(torch.equal(v, saved[k]) for k, v in model_weights(engine).items())}
        picked = {d: checkpoint.format_for(d).name for d in (one_dir, native_dir, dist_dir)}
        views = sorted({t.__name__ for t in type(fmt).seen})
    finally:
        checkpoint.FORMATS.pop(fmt.name)
    return {"written": written == one_dir, "iteration": iteration, "moved": moved, "one": one, "native": native,
            "picked": picked, "views": views, "view_type": TrainingState.__name__,
            "files": sorted(os.listdir(one_dir)), "left": sorted(checkpoint.FORMATS)}


def test_a_registered_format_round_trips_bit_exact_and_native_still_loads(tmp_path):
    (res,) = run_on_ranks(_round_trip_worker, 1, str(tmp_path))
    assert res["written"] and res["files"] == ["state.pt"]
    assert res["iteration"] == 1 and res["moved"]
    assert res["one"] == {"meta": {"format": "test/one_file", "iteration": 1}, "iteration": 1, "equal": True}
    assert res["native"] == {"format": "megatron_plugin/1", "iteration": 1, "equal": True}
    assert res["picked"] == {str(tmp_path / "one"): "test/one_file", str(tmp_path / "native"): "megatron_plugin/1",
                             str(tmp_path / "torch_dist"): "torch_dist"}
    assert res["views"] == [res["view_type"]]  # the format was handed a TrainingState, never the engine
    assert res["left"] == ["megatron_plugin/1", "torch_dist"]


def test_format_for_picks_native_and_refuses_unknown_folders(tmp_path):
    from megatron_plugin.engine.checkpoint import FORMATS, format_for, format_named

    tiny_gpt2("tied").save_pretrained(tmp_path / "hf")
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"), checkpoint_format="megatron_plugin",
                           progress=False)
    assert format_for(str(tmp_path / "mg")) is FORMATS["megatron_plugin/1"]  # the save folder (`latest`)
    assert format_for(str(tmp_path / "mg" / "iter_0000000")) is FORMATS["megatron_plugin/1"]  # one checkpoint
    convert_hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "dist"), checkpoint_format="torch_dist",
                           progress=False)
    assert format_for(str(tmp_path / "dist")) is FORMATS["torch_dist"]  # the tracker names `release`
    assert format_for(str(tmp_path / "dist" / "release")) is FORMATS["torch_dist"]
    with pytest.raises(MegatronPluginConfigError, match="no complete checkpoint there"):
        format_for(str(tmp_path / "hf"))  # an HF folder is no checkpoint of any format
    with pytest.raises(MegatronPluginConfigError, match="no such folder"):
        format_for(str(tmp_path / "nowhere"))
    # the plugin's ckpt_format names: "megatron_plugin" is the native format
    assert format_named("megatron_plugin") is FORMATS["megatron_plugin/1"]
    assert format_named("torch_dist") is FORMATS["torch_dist"]
    with pytest.raises(MegatronPluginConfigError, match="use one of"):
        format_named("zarr")
