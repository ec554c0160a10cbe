"""`megatron_plugin.Accelerator`: accelerate's Accelerator, with Megatron-Core behind `prepare`.

In Megatron mode (a `MegatronLMPlugin` passed in, or `ACCELERATE_USE_MEGATRON_LM=true` as written by
`accelerate launch` for a `distributed_type: MEGATRON_LM` config) it reports
`DistributedType.MEGATRON_LM` like accelerate does, but never enters accelerate's own Megatron code
(which needs a patched Megatron-LM checkout). Outside Megatron mode it is accelerate's Accelerator.
"""

from __future__ import annotations

import contextlib
import os

import accelerate
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from .build import build
from .data.indexed import MegatronLMDummyDataLoader
from .engine import checkpoint
from .engine.data import prepare_megatron_dataloader
from .engine.lora import check_lora_run, peft_inputs
from .engine.optimizer import MegatronLMOptimizerWrapper
from .engine.scheduler import MegatronLMDummyScheduler, MegatronLMSchedulerWrapper
from .errors import MegatronPluginConfigError
from .launch_config import check_launch
from .plugin import FP8_HANDLERS, MegatronLMPlugin, fp8_from_accelerate
from .resolve import Inputs, resolve

_ENV_FLAG = "ACCELERATE_USE_MEGATRON_LM"


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _from_accelerate(obj):
    """accelerate's own MegatronLMDummyScheduler (a script written for its integration) as ours: the same
    arguments. Anything else as it is."""
    from accelerate.utils import MegatronLMDummyScheduler as AccelerateScheduler

    if isinstance(obj, AccelerateScheduler):
        return MegatronLMDummyScheduler(obj.optimizer, obj.total_num_steps, obj.warmup_num_steps, **obj.kwargs)
    return obj


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, megatron_lm_plugin=None, **kwargs):
        """`megatron_lm_plugin`: ours, or accelerate's `accelerate.utils.MegatronLMPlugin` (converted)."""
        use_megatron = megatron_lm_plugin is not None or os.environ.get(_ENV_FLAG, "false").lower() == "true"
        if not use_megatron:
            super().__init__(*args, **kwargs)
            self._megatron = None
            return
        if megatron_lm_plugin is None:
            megatron_lm_plugin = MegatronLMPlugin()
        elif not isinstance(megatron_lm_plugin, MegatronLMPlugin):
            # a script written for accelerate's integration: its plugin, field by field (from_accelerate says how
            # accelerate's filled-in defaults are told from given values)
            megatron_lm_plugin = MegatronLMPlugin.from_accelerate(megatron_lm_plugin)
        steps = kwargs.get("gradient_accumulation_steps", 1)
        plugin_steps = getattr(kwargs.get("gradient_accumulation_plugin"), "num_steps", 1)
        if steps != 1 or plugin_steps != 1:
            raise MegatronPluginConfigError(
                "gradient_accumulation_steps", max(steps, plugin_steps),
                "with Megatron, micro-batches play that role: set gradient_accumulation_steps=1 and "
                "MegatronLMPlugin(num_micro_batches=...) instead",
            )
        precision = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION")
        if str(getattr(precision, "value", precision)).lower() == "fp8":
            # accelerate's own FP8 needs TE / torchao / MS-AMP: ours is bf16 with FP8 GEMMs (layers/fp8.py)
            handlers = list(kwargs.get("kwargs_handlers") or [])
            megatron_lm_plugin, kwargs["mixed_precision"] = fp8_from_accelerate(megatron_lm_plugin, "fp8", handlers)
            kwargs["kwargs_handlers"] = [h for h in handlers if type(h).__name__ not in FP8_HANDLERS]
        megatron_lm_plugin.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
        check_launch()
        if not torch.cuda.is_available():
            # accelerate builds a multi-process CPU (gloo) state only when told it is on CPU
            kwargs["cpu"] = True
        # accelerate would route to its own Megatron-LM code on this flag; build a plain state instead.
        with _env(_ENV_FLAG, "false"):
            super().__init__(*args, **kwargs)
        # Both state objects answer is_main_process (the last rank under Megatron, where losses live).
        self.state.distributed_type = DistributedType.MEGATRON_LM
        PartialState().distributed_type = DistributedType.MEGATRON_LM
        self.state.megatron_lm_plugin = megatron_lm_plugin
        self._megatron = megatron_lm_plugin
        self._engine = None

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """resolve (check and decide everything, no collectives) -> build (process groups, the model carrying
        the HF weights, the engine) -> wrap (what the script gets back, in the order it passed them)."""
        if self._megatron is None:
            return super().prepare(*args, device_placement=device_placement)
        args = tuple(_from_accelerate(a) for a in args)
        # a PeftModel: its adapters checked and kept apart, the rest of prepare sees the HF model inside it
        args, lora = peft_inputs(args)
        inputs = Inputs.sort(args, self._megatron, already_prepared=self._engine is not None)
        spec = resolve(inputs, self._megatron, world_size=self.num_processes, device_type=self.device.type,
                       mixed_precision=self.mixed_precision, dynamo_plugin=getattr(self.state, "dynamo_plugin", None),
                       project_dir=self.project_dir)
        if lora is not None:
            check_lora_run(lora, spec.plugin, inputs.optimizer)
        timeout = getattr(getattr(self, "init_handler", None), "timeout", None)  # InitProcessGroupKwargs
        engine, layout, iterators = build(spec, inputs, timeout=timeout, lora=lora)
        self.state.megatron_lm_plugin = spec.plugin
        self._engine = engine
        self._megatron_iterators = list(iterators)
        return self._wrap(args, inputs, engine, layout, iterators)

    def _wrap(self, args, inputs, engine, layout, iterators):
        """The prepared objects in the order the script passed theirs."""
        plugin = engine.plugin
        opt_wrapper = MegatronLMOptimizerWrapper(engine.optimizer, engine)
        sched_wrapper = MegatronLMSchedulerWrapper(engine.scheduler, engine.optimizer) if engine.scheduler else None
        iterators = list(iterators)
        out = []
        for a in args:
            if isinstance(a, torch.nn.Module):
                out.append(engine)
            elif isinstance(a, torch.optim.Optimizer):
                out.append(opt_wrapper)
            elif isinstance(a, MegatronLMDummyDataLoader):
                out.append(iterators.pop(0))
            elif isinstance(a, DataLoader):
                loader = prepare_megatron_dataloader(a, plugin, layout.dp_size, layout.dp_rank, layout.device, plugin.seed)
                self._dataloaders.append(loader)
                out.append(loader)
            elif a is inputs.scheduler:
                out.append(sched_wrapper)
            else:
                out.append(a)
        self._models.append(engine)
        self._optimizers.append(opt_wrapper)
        if sched_wrapper:
            self._schedulers.append(sched_wrapper)
        return out[0] if len(out) == 1 else tuple(out)

    # -- synchronization ----------------------------------------------------------------------------
    # accelerate's wait_for_everyone barriers only for the distributed types it lists, and MEGATRON_LM is not
    # one of them: there it (and so main_process_first) did nothing, and every rank ran a "main process
    # first" block at once (e.g. two ranks writing one tokenizer folder or datasets cache).
    def wait_for_everyone(self):
        if self._megatron is None:
            return super().wait_for_everyone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.local_process_index])
            else:
                torch.distributed.barrier()

    @contextlib.contextmanager
    def _goes_first(self, first: bool):
        if not first:
            self.wait_for_everyone()
        yield
        if first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self):
        if self._megatron is None:
            with super().main_process_first():
                yield
        else:
            with self._goes_first(self.is_main_process):
                yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        if self._megatron is None:
            with super().local_main_process_first():
                yield
        else:
            with self._goes_first(self.is_local_main_process):
                yield

    # -- the engine does these inside model(**batch) -----------------------------------------------
    def backward(self, loss, **kwargs):
        if self._megatron is None:
            return super().backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self._megatron is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        norm = self._engine.last_grad_norm if self._engine else None
        return None if norm is None else norm if torch.is_tensor(norm) else torch.tensor(norm)

    @contextlib.contextmanager
    def accumulate(self, *models):
        if self._megatron is None:
            with super().accumulate(*models):
                yield
        else:
            yield

    # -- checkpoints ------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        if self._megatron is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if output_dir is None:
            raise MegatronPluginConfigError("save_state(output_dir)", None, "pass the folder to save into")
        engine = self._prepared("save_state", ready=True)
        return checkpoint.save_state(
            output_dir, engine, self._custom_objects, distributed_optimizer=self._megatron.use_distributed_optimizer,
            format_name=getattr(engine.plugin, "ckpt_format", "torch_dist"),
        )

    def load_state(self, input_dir: str | None = None, **kwargs):
        if self._megatron is None:
            return super().load_state(input_dir, **kwargs)
        engine = self._prepared("load_state", ready=True)
        meta = checkpoint.load_state(input_dir, engine, self._custom_objects)
        if getattr(self, "_megatron_iterators", None):
            # Megatron-LM resumes its samples from iteration x global batch: the train iterator goes on there
            self._megatron_iterators[0].seek(engine.iteration)
        return meta

    def get_state_dict(self, model, unwrap=True):
        """The HF state dict of the whole model on every rank: gathered over TP ranks and pipeline stages."""
        if self._megatron is None:
            return super().get_state_dict(model, unwrap)
        from .engine.export import full_state_dict

        engine = self._prepared("get_state_dict", ready=True)
        return full_state_dict(engine)

    def end_training(self):
        """accelerate's end of a run (trackers finished, process group destroyed), and ours before it: the
        TensorBoard writer closed (its last scalars flushed) and megatron-core's groups destroyed, so no gloo or
        NCCL group is still alive when the interpreter exits."""
        if self._megatron is not None and getattr(self, "_engine", None) is not None:
            if getattr(self._engine, "tensorboard", None) is not None:
                self._engine.tensorboard.close()
            self._engine.manual_gc.stop()  # manual_gc: Python's collector back on
            from .engine.distributed import release_model_parallel
            from .engine.full_graph import release_all

            release_all()  # the full-iteration graphs, before NCCL's groups go (else their destroy never returns)

            self.wait_for_everyone()
            release_model_parallel()
        super().end_training()

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True, merge_lora=False):
        """Write an HF checkpoint (config, sharded safetensors, index) straight from the TP/PP model:
        tensor by tensor, written by global rank 0, `from_pretrained` loads it. Collective. A model prepared
        from a peft PeftModel writes its adapter folder (adapter_config.json, adapter_model.safetensors) that
        `PeftModel.from_pretrained(base, dir)` loads; `merge_lora=True` writes the full HF weights with the
        adapters merged in instead (what peft's merge_and_unload().save_pretrained writes)."""
        if self._megatron is None:
            if merge_lora:
                raise MegatronPluginConfigError("save_model(merge_lora)", True,
                                                "merge_lora is for Megatron runs: merge with peft's merge_and_unload()")
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        from .engine.export import save_model

        engine = self._prepared("save_model", ready=True)
        return save_model(engine, save_directory, max_shard_size, safe_serialization, merge_lora=merge_lora)

    # -- post-training ----------------------------------------------------------------------------
    def offload(self, model=None, params: bool = True, grads: bool = True, optimizer: bool = True):
        """Free the GPU memory of the prepared model: parameters, gradients and optimizer state go to pinned
        host memory (e.g. while a rollout engine generates). `reload()` brings them back bit for bit;
        until then the model refuses to run. Returns bytes moved per kind."""
        return self._prepared("offload", model).offload(params=params, grads=grads, optimizer=optimizer)

    def reload(self, model=None):
        """Bring back to the GPU what `offload()` moved to host memory."""
        return self._prepared("reload", model).reload()

    def snapshot_weights(self, model=None):
        """A host copy of the prepared model's weights as they are now (each rank its own shards), e.g. the
        reference policy for a KL term, taken before training."""
        return self._prepared("snapshot_weights", model).snapshot_weights()

    def use_weights(self, snapshot, model=None):
        """`with accelerator.use_weights(snapshot):` the model computes with the snapshot's weights (log-probs,
        generation, evaluation), then has its own back, bit for bit."""
        return self._prepared("use_weights", model).use_weights(snapshot)

    def _prepared(self, what: str, model=None, ready: bool = False):
        """The engine `what` works on; a clear error without a MegatronLMPlugin, before `prepare` (rather than
        an AttributeError on None), for a `model` other than the prepared one, or (`ready`) while the model is
        offloaded or holds a snapshot's weights. Raised before any collective."""
        if self._megatron is None:
            raise MegatronPluginConfigError(what, "without a MegatronLMPlugin",
                                            f"{what} is for Megatron runs: pass Accelerator(megatron_lm_plugin=...)")
        if self._engine is None:
            raise MegatronPluginConfigError(
                what, "before prepare",
                f"call accelerator.prepare(model, optimizer, dataloaders, scheduler) first: {what} works on the "
                "model it returns (load_state after prepare resumes a run)",
            )
        if model is not None and model is not self._engine:
            raise MegatronPluginConfigError(f"{what}(model)", type(model).__name__,
                                            "pass the model accelerator.prepare returned (or nothing: there is one)")
        if ready:
            self._engine.check_ready(what)
        return self._engine
