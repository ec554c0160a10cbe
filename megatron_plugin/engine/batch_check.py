"""The batch check's flags, read without stalling the GPU.

Reading a device value back (`tolist()`) waits for everything queued before it: at the start of a step
that is the whole previous optimizer step, after which the GPU idles while the host launches the new
forward (2-3 ms a step on an H100 at GPT-2 350M and 774M, measured with `.devrun`-style probes). So the
CUDA engine copies the flags to pinned host memory behind the previous step's work, queues the first
micro-batch's forward on a batch made safe to run (ids out of range replaced), and only then waits for
the copy, while the GPU computes. A bad batch still raises before any backward or optimizer update.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch


class NoLossInStep(Exception):
    """No token of the whole step carries a loss: the engine skips the step (raised inside the schedule,
    before any backward)."""


class DeferredCheck:
    def __init__(self, flags: torch.Tensor, verdict: Callable[[list], bool], safe_batch: Dict[str, torch.Tensor]):
        self.safe_batch = safe_batch
        self._verdict = verdict
        self._ok = None
        if flags.is_cuda:
            self._host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._host.copy_(flags, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = flags, None

    def resolve(self) -> bool:
        """Wait for the flags (not for the work queued after them) and judge them once: raises for a bad
        batch, returns False when no token carries a loss."""
        if self._ok is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._ok = False  # judged, even if the verdict raises
            self._ok = self._verdict(self._host.tolist())
        return self._ok

    def raise_if_no_loss(self) -> None:
        if not self.resolve():
            raise NoLossInStep()
