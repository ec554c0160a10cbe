"""`TrainingState`: the one view of a run that checkpoint formats save and restore.

A format sees this object, never the engine: the model chunks of this rank, optimizer, scheduler,
random streams, iteration, the few settings a checkpoint records, and the user's registered objects.
It is built once per save or load (`TrainingState.of_engine`), so what a format may touch is listed
here, and a new format (Megatron-LM's torch_dist) needs nothing else.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.random import convert_cuda_rng_state

from ...layout import Layout, current_layout
from .layout import chunk_key, is_expert_key


@dataclass(frozen=True)
class ExpertPlace:
    """Where this process sits in megatron-core's expert grid (expert TP x EP x expert DP x PP), which is laid
    over the ranks apart from the dense TP x DP grid: a routed expert's shard is chosen by these ranks."""

    ep_size: int
    ep_rank: int
    etp_size: int
    etp_rank: int
    edp_rank: int

    @classmethod
    def current(cls) -> "ExpertPlace":
        ps = parallel_state
        return cls(ep_size=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
                   etp_size=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
                   edp_rank=ps.get_expert_data_parallel_rank())


@dataclass
class TrainingState:
    chunks: Sequence[Any]  # MegatronModel per virtual stage of this rank; chunks[0] knows the HF model
    optimizer: Any
    scheduler: Optional[Any]
    rng: Any  # the model's own random stream (ModelRNG): state_dict / load_state_dict
    iteration: int
    on_iteration: Callable[[int], None]  # writes a loaded iteration back into the run
    make_vocab_size_divisible_by: int
    distributed_optimizer: bool  # this run's optimizer shards its state over data-parallel ranks
    device: torch.device
    layout: Layout  # this process's place in the TP x PP x DP grid
    custom_objects: Sequence[Any] = ()
    save_optimizer: bool = True  # False under the plugin's no_save_optim: no optimizer state is written
    load_optimizer: bool = True  # False under no_load_optim: weights, scheduler, RNG and iteration only
    plugin: Any = None  # the run's resolved plugin, read only: the settings a Megatron-LM checkpoint records

    @classmethod
    def of_engine(cls, engine, custom_objects=(), distributed_optimizer: Optional[bool] = None) -> "TrainingState":
        """The engine's state; `distributed_optimizer` defaults to the engine's plugin setting."""
        if distributed_optimizer is None:
            distributed_optimizer = engine.plugin.use_distributed_optimizer
        return cls(
            chunks=list(engine.chunks), optimizer=engine.optimizer, scheduler=engine.scheduler, rng=engine.rng,
            iteration=engine.iteration, on_iteration=lambda i: setattr(engine, "iteration", i),
            make_vocab_size_divisible_by=engine.plugin.make_vocab_size_divisible_by,
            distributed_optimizer=distributed_optimizer, device=engine.device,
            layout=current_layout(engine.device), custom_objects=tuple(custom_objects),
            save_optimizer=not getattr(engine.plugin, "no_save_optim", False),
            load_optimizer=not getattr(engine.plugin, "no_load_optim", False), plugin=engine.plugin,
        )

    @property
    def model(self):
        """The first chunk: family, variant, HF config, plan and dims of this rank's model."""
        return self.chunks[0]

    @property
    def vpp(self) -> Optional[int]:
        """Virtual pipeline stages, None without them (as meta.json records it)."""
        return len(self.chunks) if len(self.chunks) > 1 else None

    @property
    def torch_optimizer(self) -> bool:
        """A plain torch optimizer (the CPU engine), not megatron-core's."""
        return isinstance(self.optimizer, torch.optim.Optimizer)

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.on_iteration(iteration)

    def named_tensors(self, experts: Optional[bool] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(name in the model file, live tensor) for every chunk's weights: what save writes and load fills.
        `experts`: True for the routed experts' tensors only (their own files), False for all others."""
        n = len(self.chunks)
        for i, chunk in enumerate(self.chunks):
            for k, v in chunk.module.state_dict().items():
                if not k.endswith("_extra_state") and (experts is None or experts == is_expert_key(k)):
                    yield chunk_key(i, n, k), v

    @property
    def has_experts(self) -> bool:
        """Whether the model has routed experts (an MoE model), whose tensors the native format files apart."""
        return bool(getattr(self.model.config, "num_moe_experts", None))

    @property
    def experts(self) -> ExpertPlace:
        return ExpertPlace.current()

    def model_fields(self) -> dict:
        """What a checkpoint records about the model, in meta.json's names."""
        model = self.model
        return dict(family=model.family.name, variant=model.variant,
                    make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
                    hf_config=model.hf_config.to_dict())

    def optimizer_param_names(self) -> List[str]:
        """The Megatron name of each parameter of a torch optimizer (CPU engine), in state-dict index order."""
        names = {id(p): n for n, p in self.model.module.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def rng_state(self) -> dict:
        """This process's random streams: Python, NumPy, torch, CUDA and megatron-core's tracker, the model's."""
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                 "model": self.rng.state_dict()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
            # as tensors, whichever kind the tracker is: a checkpoint loads into a run with or without CUDA graphs
            state["tracker"] = {k: convert_cuda_rng_state(v, to_graphable=False)
                                for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
        return state

    def set_rng_state(self, state: dict) -> None:
        """`state` as `rng_state` gives it; without "model" (a checkpoint Megatron-LM wrote) the model's
        own stream keeps its state."""
        if "model" in state:
            self.rng.load_state_dict(state["model"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if torch.cuda.is_available() and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])
            tracker = tensor_parallel.get_cuda_rng_tracker()
            saved = {k: convert_cuda_rng_state(v, to_graphable=False) for k, v in state["tracker"].items()}
            if getattr(tracker, "use_cudagraphable_rng", False):
                # into the generators themselves: a captured CUDA graph holds them (engine/full_graph.py)
                generators = tracker.get_states()
                for name, value in saved.items():
                    generators[name].set_state(value)
            else:
                tracker.set_states(saved)

    def load_scheduler(self, saved: dict) -> None:
        """megatron-core's scheduler loads by stepping `num_steps` on from where it is, right for a run that
        has not stepped yet: from 0 here, so a load mid-run lands on the saved step too."""
        if hasattr(self.scheduler, "num_steps"):
            self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(saved)

    def optimizer_follows_weights(self) -> None:
        """After weights were loaded without the optimizer state: megatron-core's mixed-precision optimizer
        keeps fp32 main copies of the weights, which its next step would copy back over the loaded ones, so
        they are refreshed from the model (Megatron-LM does the same). A torch optimizer holds no copy."""
        if not self.torch_optimizer and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()

    def restore(self, saved: dict, ckpt: str, saved_world_size: int, saved_cp: int = 1) -> None:
        """After the model and optimizer: the scheduler, RNG states (`saved["rng"]`; absent or None: the
        run's random streams stay as seeded, with a warning) and registered objects, as a format read them.
        `saved_world_size` / `saved_cp`: the processes and context-parallel size the checkpoint was saved with."""
        if self.scheduler is not None:
            self.load_scheduler(saved["scheduler"])
        if saved.get("rng") is not None:
            self.set_rng_state(saved["rng"])
        else:
            cp = "" if saved_cp == 1 == self.layout.cp_size else (
                f" at context_parallel_size={saved_cp} (this run: {self.layout.world_size} processes at "
                f"context_parallel_size={self.layout.cp_size})")
            warnings.warn(f"load_state: {ckpt} holds RNG states of {saved_world_size} processes{cp}; this run's "
                          "random streams (dropout) start from the plugin's seed")
        for obj, state in zip(self.custom_objects, saved["custom"]):
            obj.load_state_dict(state)
