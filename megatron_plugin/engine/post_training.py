"""Where the model's weights are between training steps: on the device, offloaded to host memory, or
swapped for a snapshot's; and whether a step is running. What each state allows is checked here."""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

from ..errors import MegatronPluginConfigError
from ..layers.moe import release_expert_stacks
from .offload import Offload, WeightSnapshot, unique_storages
from .optimizer import inner_torch_optimizers


class PostTrainingState:
    """Offload / reload, weight snapshots and `use_weights`, for the engine's model chunks and optimizer.

    Post-training loops (RL) interleave these with steps, log-probs and generation; each call names
    itself in the error when the model's state does not allow it, instead of failing somewhere deeper."""

    def __init__(self, chunks, optimizer, device: torch.device):
        self.chunks = chunks
        self.optimizer = optimizer
        self.device = device
        self.in_step = False  # inside model(**batch) / compute_log_probs
        self.swapped = False  # inside use_weights(snapshot)
        self._offload = None  # the Offload holding what offload() moved, once used

    @contextlib.contextmanager
    def busy(self):
        """Marks a running step, which offload, snapshots and weight swaps must wait for."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    @property
    def is_offloaded(self) -> bool:
        return self._offload is not None and self._offload.active

    def check_ready(self, what: str, swapped_ok: bool = False, offloaded_ok: bool = False):
        """Refuse `what` while the weights are offloaded, or (unless `swapped_ok`) swapped for a snapshot's."""
        if self.is_offloaded and not offloaded_ok:
            raise MegatronPluginConfigError(
                what, "called while the model is offloaded",
                "call accelerator.reload() (engine.reload()) first, after accelerator.offload()",
            )
        if self.swapped and not swapped_ok:
            raise MegatronPluginConfigError(
                what, "called inside use_weights(snapshot), where the model holds the snapshot's weights",
                "train, save, offload and snapshot outside the `with` block; inside it, compute log-probs, "
                "generate or evaluate",
            )

    def check_between_steps(self, what: str):
        if self.in_step:
            raise MegatronPluginConfigError(what, "called while a step runs",
                                            "call it between steps: after model(**batch) has returned")

    def snapshot(self) -> WeightSnapshot:
        self.check_ready("snapshot_weights")
        self.check_between_steps("snapshot_weights")
        return WeightSnapshot(self._weight_tensors(), self.device)

    @contextlib.contextmanager
    def use_weights(self, snapshot):
        """The snapshot's bytes in the live parameters inside the block, the model's own after it."""
        if not isinstance(snapshot, WeightSnapshot):
            raise MegatronPluginConfigError("use_weights(snapshot)", type(snapshot).__name__,
                                            "pass what snapshot_weights() returned")
        self.check_ready("use_weights")
        self.check_between_steps("use_weights")
        live = {s.data_ptr() for s in unique_storages(self._weight_tensors(), self.device)}
        if {s.data_ptr() for s in snapshot.storages} != live:
            raise MegatronPluginConfigError("use_weights(snapshot)", "a snapshot of another model",
                                            "take the snapshot with this model's snapshot_weights()")
        snapshot.swap()
        self.swapped = True
        try:
            yield
        finally:
            snapshot.swap()
            self.swapped = False

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> Dict[str, int]:
        for name, value in (("params", params), ("grads", grads), ("optimizer", optimizer)):
            if not isinstance(value, bool):  # offload(params="no") would offload them
                raise MegatronPluginConfigError(f"offload({name}=...)", value, "pass True or False")
        self.check_between_steps("offload")
        self.check_ready("offload", offloaded_ok=True)  # offloading twice is a no-op
        if self._offload is None:
            self._offload = Offload(self.device)
        if params:
            # the MoE layers' stacked copies of the expert weights (layers/moe.py) are device memory the
            # offload would not free; the next forward stacks again
            for c in self.chunks:
                release_expert_stacks(c.module)
        return self._offload.offload(self._offload_groups(params, grads, optimizer))

    def reload(self) -> Dict[str, int]:
        self.check_between_steps("reload")
        if self._offload is None:
            return {}
        return self._offload.reload()

    def _weight_tensors(self) -> List[torch.Tensor]:
        return [p for c in self.chunks for p in c.module.parameters()]

    def _offload_groups(self, params: bool, grads: bool, optimizer: bool) -> Dict[str, List[torch.Tensor]]:
        groups = {}
        if params:
            groups["params"] = [t for c in self.chunks for t in [*c.module.parameters(), *c.module.buffers()]]
        if grads:
            groups["grads"] = [g for c in self.chunks for p in c.module.parameters()
                               for g in (p.grad, getattr(p, "main_grad", None)) if torch.is_tensor(g)]
        if optimizer:
            opts = [self.optimizer] if isinstance(self.optimizer, torch.optim.Optimizer) else inner_torch_optimizers(self.optimizer)
            groups["optimizer"] = [t for o in opts for t in
                                   [*(p for g in o.param_groups for p in g["params"]),
                                    *(v for st in o.state.values() for v in st.values() if torch.is_tensor(v))]]
        return groups
