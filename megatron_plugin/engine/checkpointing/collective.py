"""Raising an error on every rank at once, so that no rank is left waiting in a collective for one that
stopped. Checkpoints need it most (a damaged file may be read by some ranks only), `prepare` and
`save_model` use it too."""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from ...errors import MegatronPluginConfigError


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


def broadcast_error(problem: Optional[tuple]) -> None:
    """Rank 0 found `problem` (setting, value, fix) or None: every rank raises it, so none waits in a
    collective."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        setting, value, fix = box[0]
        raise MegatronPluginConfigError(setting, value, fix)


def commit_on_rank0(is_rank0: bool, output_dir: str, commit: Callable[[], None], kept: Callable[[str], str]) -> None:
    """Rank 0 runs `commit` (a save's last step); whatever it raises, every rank raises, saying what the
    folder still holds (`kept`), rather than wait in a collective. Also what keeps the other ranks until
    rank 0 has committed."""
    problem = None
    if is_rank0:
        try:
            commit()
        except Exception as err:  # whatever it is, every rank hears of it
            problem = ("save_state(output_dir)", output_dir,
                       f"the checkpoint could not be committed ({type(err).__name__}: {err}); {kept(output_dir)}")
    broadcast_error(problem)
