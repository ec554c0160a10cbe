"""Megatron-LM's manual garbage collection (`manual_gc`, `manual_gc_interval`, `manual_gc_eval`).

Python's collector runs when allocation counters cross a threshold: at a point of the step that differs from
rank to rank and run to run, and a full collection of a process holding torch, transformers and compiled graphs
takes tens of milliseconds. On one GPU that is a slow step; across ranks every other rank waits for it at the next
collective. With `manual_gc` the collector is off from the first training step and runs at points every rank
reaches together: every `manual_gc_interval` steps, and (`manual_gc_eval`) where evaluation starts and ends.
Written here because accelerate has no such switch and Megatron-LM's lives in its training loop.
"""

from __future__ import annotations

import contextlib
import gc


class ManualGC:
    def __init__(self, plugin):
        self.on = bool(getattr(plugin, "manual_gc", False))
        self.interval = int(getattr(plugin, "manual_gc_interval", 0) or 0)
        self.at_eval = bool(getattr(plugin, "manual_gc_eval", True))
        self.started = False
        self._quiet = 0

    def before_train_step(self) -> None:
        """At the first training step: the threshold collector off, and one collection (Megatron-LM's start)."""
        if self.on and not self.started:
            gc.disable()
            gc.collect()
            self.started = True

    def after_train_step(self, iteration: int) -> None:
        if self.started and self.interval and iteration % self.interval == 0:
            gc.collect()

    def mode_changed(self) -> None:
        """The model moved between train() and eval(): where a script's evaluation starts or ends."""
        if self.started and self.at_eval and not self._quiet:
            gc.collect()

    @contextlib.contextmanager
    def quiet(self):
        """Mode switches of the engine's own (compute_log_probs runs in eval mode and switches back): not an
        evaluation's start or end, so no collection."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def stop(self) -> None:
        """The threshold collector back on (the run has ended: `Accelerator.end_training`)."""
        if self.started:
            gc.enable()
            self.started = False
