"""The expert load of MoE models, logged with every step: how many tokens each layer's router sent to each
expert over the step's global batch, and with a capacity factor the fraction of expert assignments dropped.

The engine reads every router's statistics (`layers.moe.RouterStats`, this micro-batch's, already summed
over the TP group under sequence parallelism) right after each micro-batch's forward, whatever the train
step, so a custom step's loads are logged too. After the step the sums go over the data-parallel ranks
(and the pipeline stages, which hold different layers) in one collective; on one stage they stay on the
device, so logging them costs no host sync.

Logged as `tokens per expert/layer {n}` ([num_experts] fp32, n the global 1-based layer number, as
Megatron-LM numbers layers) and `dropped fraction` (scalar, only with `moe_expert_capacity_factor`): in the
step's `metrics`, `engine.metrics`, and TensorBoard (one scalar per expert).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..layers.moe import Router, moe_routers

LOAD_KEY = "tokens per expert"
DROPPED_KEY = "dropped fraction"


class ExpertLoad:
    def __init__(self, routers: List[Router], num_experts: int, capacity: bool, device: torch.device):
        self.routers = routers
        self.num_experts = num_experts
        self.capacity = capacity
        self.device = device
        self.slot = {id(r): i for i, r in enumerate(routers)}
        numbers = [r.layer_number for r in routers]
        self.layer_numbers = numbers if None not in numbers and len(set(numbers)) == len(numbers) else \
            list(range(1, len(routers) + 1))
        self.recording = False
        self._by_model: Dict[int, List[Router]] = {}
        self._counts: Optional[torch.Tensor] = None  # [layers, experts]
        self._dropped: Optional[torch.Tensor] = None  # [dropped, assignments]

    @classmethod
    def of(cls, chunks, device: torch.device) -> Optional["ExpertLoad"]:
        """None for a model without MoE layers (nothing is logged, nothing costs)."""
        routers = [r for chunk in chunks for r in moe_routers(chunk.module)]
        configs = [chunk.config for chunk in chunks]
        experts = next((c.num_moe_experts for c in configs if getattr(c, "num_moe_experts", None)), None)
        if experts is None:
            return None
        capacity = any(getattr(c, "moe_expert_capacity_factor", None) is not None for c in configs)
        return cls(routers, int(experts), capacity, device)

    def start(self) -> None:
        self._counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float32, device=self.device)
        self._dropped = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    @contextlib.contextmanager
    def recorded(self):
        """Record the micro-batches of one step (training or evaluation; not log-probs or generation)."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def add(self, model) -> None:
        """Add the statistics of `model`'s routers (the chunk that just ran a micro-batch forward)."""
        if not self.recording:
            return
        routers = self._by_model.get(id(model))
        if routers is None:
            routers = self._by_model[id(model)] = moe_routers(model)
        for r in routers:
            stats = r.stats
            if stats is None or id(r) not in self.slot:
                continue
            # the statistics hold their autograd graph (the router losses backpropagate through them): a train
            # step has taken what it needs when its forward_step returned, and without this the last
            # micro-batch's graph would stay alive until the next step's forward
            r.stats = None
            counts = stats.counts.detach().float()
            self._counts[self.slot[id(r)]] += counts
            if self.capacity:
                self._dropped += torch.stack([stats.dropped.detach().float().reshape(()), counts.sum()])

    def counting(self, forward_step):
        """`forward_step` that adds the routers' statistics after each micro-batch's forward."""

        @functools.wraps(forward_step)  # mcore reads the signature (checkpoint_activations_microbatch)
        def counted(data_iterator, model, *args, **kwargs):
            out = forward_step(data_iterator, model, *args, **kwargs)
            self.add(model)
            return out

        return counted

    @torch.no_grad()
    def logs(self) -> Dict[str, torch.Tensor]:
        """The step's loads over the global batch, the same on every rank. Collective over the data-parallel
        (and context-parallel) group, and with pipeline stages over the pipeline group."""
        if self._counts is None:
            return {}
        packed = torch.cat([self._counts.reshape(-1), self._dropped])
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(dp) > 1:
            dist.all_reduce(packed, group=dp)
        e = self.num_experts
        counts = packed[: len(self.routers) * e].reshape(len(self.routers), e)
        dropped, assigned = packed[-2], packed[-1]
        rows = dict(zip(self.layer_numbers, counts.unbind(0)))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # each stage holds its own layers: every stage gets all of them (a host round trip, once a step)
            gathered = [None] * parallel_state.get_pipeline_model_parallel_world_size()
            dist.all_gather_object(gathered, {n: row.cpu() for n, row in rows.items()},
                                   group=parallel_state.get_pipeline_model_parallel_group())
            rows = {n: row.to(self.device) for part in gathered for n, row in part.items()}
            if self.capacity:
                both = torch.stack([dropped, assigned])
                dist.all_reduce(both, group=parallel_state.get_pipeline_model_parallel_group())
                dropped, assigned = both[0], both[1]
        out = {f"{LOAD_KEY}/layer {n}": rows[n] for n in sorted(rows)}
        if self.capacity:
            out[DROPPED_KEY] = dropped / assigned.clamp_min(1.0)
        self._counts = self._dropped = None
        return out
