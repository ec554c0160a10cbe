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
            for t in tensors:
                if t.device != self.device:
                    continue
                storage = t.untyped_storage()
                n = storage.nbytes()
                if n == 0 or storage.data_ptr() in seen or not storage.resizable():
                    continue
                seen.add(storage.data_ptr())
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
