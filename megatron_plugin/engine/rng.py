"""The model's own random stream, kept apart from the script's."""

from __future__ import annotations

import contextlib

import torch


class ModelRNG:
    """The model's own random stream (dropout), separate from the script's.

    Each step runs with this stream swapped in for torch's default generator(s) and swapped out after,
    so whatever else the script draws (shuffling, a new dataloader iterator on resume) cannot shift the
    dropout masks, and a checkpoint of this state resumes the exact same masks. Every TP rank of a
    stage starts from the same seed: dropout on replicated activations must agree across TP ranks.
    """

    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.devices = [device] if self.cuda else []
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self):
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if self.cuda else None}

    @contextlib.contextmanager
    def active(self):
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.state["cpu"])
            if self.cuda:
                torch.cuda.set_rng_state(self.state["cuda"])
            try:
                yield
            finally:
                self.state = self._get()

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state = dict(state)
