"""Device memory out and back: parameters, gradients and optimizer state parked in host memory.

Works storage by storage, the way FSDP frees and refills its flat parameters: every tensor (and every
view: mcore's DDP keeps parameters and gradients as views of contiguous buffers) keeps its storage
object, whose bytes are copied to host memory and then resized to zero; reload resizes it back and
copies the bytes in. Nothing holding a tensor notices, and what comes back is bit for bit what left.

The host buffers are kept after reload and reused by the next offload: pinning memory costs about a
second per GB, copying into pinned memory a few milliseconds (RL loops offload every iteration).
"""

from __future__ import annotations

from typing import Dict, List

import torch


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def unique_storages(tensors, device: torch.device) -> List[torch.UntypedStorage]:
    """The storages behind `tensors` on `device`, each once (views of one buffer share it)."""
    seen, out = set(), []
    for t in tensors:
        if t.device != device:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen or not storage.resizable():
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


class WeightSnapshot:
    """A host copy of the model's parameters as they were when taken (e.g. the reference policy of a KL
    term). `swap()` exchanges the live parameters with it byte for byte: swapping twice restores both."""

    def __init__(self, tensors, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.storages = unique_storages(tensors, device)
        self.spare = None
        self.host = []
        with torch.no_grad():
            for storage in self.storages:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin)
                host.copy_(_as_bytes(storage), non_blocking=self.pin)
                self.host.append(host)
        if self.pin:
            torch.cuda.synchronize(device)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host)

    @torch.no_grad()
    def swap(self):
        if self.spare is None:  # a second set of host buffers, allocated once: the live bytes go there
            self.spare = [torch.empty(h.numel(), dtype=torch.uint8, pin_memory=self.pin) for h in self.host]
        for storage, host, spare in zip(self.storages, self.host, self.spare):
            live = _as_bytes(storage)
            spare.copy_(live, non_blocking=self.pin)  # same stream: read before the next copy writes
            live.copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(self.device)
        self.host, self.spare = self.spare, self.host


class Offload:
    def __init__(self, device: torch.device):
        self.device = device
        self.parked: List[tuple] = []  # (storage, host copy, kind)
        self.spare: List[torch.Tensor] = []  # the last cycle's host buffers, in the order they were used

    @property
    def active(self) -> bool:
        return bool(self.parked)

    @torch.no_grad()
    def offload(self, groups: Dict[str, List[torch.Tensor]]) -> Dict[str, int]:
        seen = set()
        moved = {kind: 0 for kind in groups}
        pin = self.device.type == "cuda"
        for kind, tensors in groups.items():
            for storage in unique_storages(tensors, self.device):
                if storage.data_ptr() in seen:  # in an earlier kind's list (optimizer param_groups: the params)
                    continue
                seen.add(storage.data_ptr())
                n = storage.nbytes()
                i = len(self.parked)
                reuse = i < len(self.spare) and self.spare[i].numel() == n
                host = self.spare[i] if reuse else torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                host.copy_(_as_bytes(storage), non_blocking=pin)
                self.parked.append((storage, host, kind))
                moved[kind] += n
        if pin:
            torch.cuda.synchronize(self.device)  # the copies are done before the memory is handed back
        for storage, _, _ in self.parked:
            if storage.nbytes():
                storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        return moved

    @torch.no_grad()
    def reload(self) -> Dict[str, int]:
        moved: Dict[str, int] = {}
        pin = self.device.type == "cuda"
        for storage, host, kind in self.parked:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=pin)
            moved[kind] = moved.get(kind, 0) + host.numel()
        if pin:
            torch.cuda.synchronize(self.device)
        self.spare = [host for _, host, _ in self.parked]
        self.parked = []
        return moved
