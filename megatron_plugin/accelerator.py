"""`megatron_plugin.Accelerator`: accelerate's Accelerator, with Megatron-Core behind `prepare`.

In Megatron mode (a `MegatronLMPlugin` passed in, or `ACCELERATE_USE_MEGATRON_LM=true` as written by
`accelerate launch` for a `distributed_type: MEGATRON_LM` config) it reports
`DistributedType.MEGATRON_LM` like accelerate does, but never enters accelerate's own Megatron code
(which needs a patched Megatron-LM checkout). Outside Megatron mode it is accelerate's Accelerator.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import accelerate
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType, DynamoBackend
from torch.utils.data import DataLoader

from .engine import checkpoint
from .data.indexed import MegatronLMDummyDataLoader
from .engine.data import check_dataloader, prepare_megatron_dataloader
from .engine.distributed import initialize
from .engine.cpu import MegatronEngine, megatron_args
from .errors import MegatronPluginConfigError
from .launch_config import check_launch
from .models.modeling import MegatronModel
from .models.convert import mcore_to_hf_sources
from .models import check_model
from .models.mapping import StagePlan
from .engine.optimizer import MegatronLMOptimizerWrapper, check_optimizer, rebuild_optimizer, trainable_flags
from .plugin import MegatronLMPlugin, check_compile, check_cpu_support, uses_cuda_graphs
from .engine.scheduler import MegatronLMDummyScheduler, MegatronLMSchedulerWrapper, build_scheduler, check_scheduler

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


def layer_compile_kwargs(plugin: MegatronLMPlugin, dynamo_plugin) -> Optional[dict]:
    """torch.compile arguments for the Megatron layers, or None for eager. accelerate's dynamo settings
    (`accelerate config`, `Accelerator(dynamo_backend=...)`) win over the plugin's plain switch."""
    if dynamo_plugin is not None and dynamo_plugin.backend != DynamoBackend.NO and not dynamo_plugin.disable:
        return dynamo_plugin.to_kwargs()
    return {} if plugin.torch_compile else None


def weights_reader(hf_model, plugin: MegatronLMPlugin, family, variant: str):
    """None for a model that carries its weights; for one without (meta device), a reader of the HF folder
    they come from, checked to hold every tensor the model needs. No collectives."""
    if not any(p.is_meta for p in hf_model.parameters()):
        return None
    from .engine.hf_io import HFReader

    path = plugin.hf_checkpoint or getattr(hf_model.config, "_name_or_path", "") or None
    if path is None or not os.path.isdir(path):
        raise MegatronPluginConfigError(
            "hf_checkpoint", path,
            "the model has no weights (meta device) and no local checkpoint folder to read them from: pass "
            "MegatronLMPlugin(hf_checkpoint='<HF model folder>'), or build the config with "
            "AutoConfig.from_pretrained('<folder>')",
        )
    reader = HFReader(path, variant=variant, setting="hf_checkpoint", config=hf_model.config)
    missing = sorted(family.mapped_hf_names(hf_model.config, variant) - set(reader.names))
    if missing:
        raise MegatronPluginConfigError(
            "hf_checkpoint", path, f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}: "
            "is it of this model (and this variant)?",
        )
    return reader


def check_step_family(step_cls, family) -> None:
    """A custom step built on one family's step (GPTTrainStep, BertTrainStep, T5TrainStep: the policy and DPO
    steps are GPT steps) reads batches and outputs of that family's model only; one built on
    AbstractTrainStep directly is the user's to match."""
    import train_steps

    own = getattr(train_steps, family.train_step)
    for base in (train_steps.GPTTrainStep, train_steps.BertTrainStep, train_steps.T5TrainStep):
        if issubclass(step_cls, base) and not issubclass(own, base) and not issubclass(step_cls, own):
            raise MegatronPluginConfigError(
                "custom_train_step_class", step_cls.__name__,
                f"it is a {base.__name__}, for other models than this {family.name} model ({family.train_step}): "
                f"subclass {family.train_step}, or pass a model the step is for",
            )


class Accelerator(accelerate.Accelerator):
    def __init__(self, *args, megatron_lm_plugin: Optional[MegatronLMPlugin] = None, **kwargs):
        use_megatron = megatron_lm_plugin is not None or os.environ.get(_ENV_FLAG, "false").lower() == "true"
        if not use_megatron:
            super().__init__(*args, **kwargs)
            self._megatron = None
            return
        if megatron_lm_plugin is None:
            megatron_lm_plugin = MegatronLMPlugin()
        if not isinstance(megatron_lm_plugin, MegatronLMPlugin):
            raise TypeError("megatron_lm_plugin must be a megatron_plugin.MegatronLMPlugin")
        steps = kwargs.get("gradient_accumulation_steps", 1)
        plugin_steps = getattr(kwargs.get("gradient_accumulation_plugin"), "num_steps", 1)
        if steps != 1 or plugin_steps != 1:
            raise MegatronPluginConfigError(
                "gradient_accumulation_steps", max(steps, plugin_steps),
                "with Megatron, micro-batches play that role: set gradient_accumulation_steps=1 and "
                "MegatronLMPlugin(num_micro_batches=...) instead",
            )
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
        if self._megatron is None:
            return super().prepare(*args, device_placement=device_placement)
        plugin = self._megatron
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if not isinstance(a, (torch.nn.Module, torch.optim.Optimizer, DataLoader))
                      and (isinstance(a, MegatronLMDummyScheduler) or hasattr(a, "step"))]
        loaders = [a for a in args if isinstance(a, DataLoader)]
        indexed = [a for a in args if isinstance(a, MegatronLMDummyDataLoader)]
        # Every check below runs before the first collective, so bad input fails on every rank alike.
        if len(models) > 1 or (models and self._engine is not None):
            raise MegatronPluginConfigError(
                "prepare(models)", len(models) + (self._engine is not None),
                "Megatron runs train one model per Accelerator: prepare a single model",
            )
        if not models:
            raise MegatronPluginConfigError("prepare(model)", None, "pass the HF model to prepare with its dataloaders")
        if not loaders and not indexed:
            raise MegatronPluginConfigError(
                "prepare(dataloaders)", None,
                "pass the training and/or evaluation DataLoader (or a MegatronLMDummyDataLoader) to the same prepare "
                "call: Megatron needs the micro-batch size to lay out the step",
            )
        if len({id(a) for a in indexed}) > 1 or len(indexed) > 3:
            raise MegatronPluginConfigError(
                "prepare(MegatronLMDummyDataLoader)", f"{len({id(a) for a in indexed})} loaders, passed {len(indexed)} times",
                "pass one MegatronLMDummyDataLoader, once, twice or three times: it becomes the train, validation and "
                "test iterators in that order",
            )
        if plugin.megatron_dataset_flag and not indexed:
            raise MegatronPluginConfigError(
                "megatron_dataset_flag", True,
                "no MegatronLMDummyDataLoader was passed to prepare: pass it (the flag is set for you when you do), "
                "or set megatron_dataset_flag=False for torch DataLoaders",
            )
        plugin.megatron_dataset_flag = bool(indexed)
        if not optimizers:
            raise MegatronPluginConfigError("prepare(optimizer)", None, "pass the optimizer to the same prepare call")
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MegatronPluginConfigError("prepare(optimizers)", len(optimizers), "pass one optimizer and one scheduler")
        for s in schedulers:
            check_scheduler(s, plugin)
        for o in optimizers:
            check_optimizer(o)
        compile_kwargs = layer_compile_kwargs(plugin, getattr(self.state, "dynamo_plugin", None))
        check_compile(plugin, compile_kwargs, self.device.type)
        if plugin.gradient_accumulation_fusion is None:
            # On CUDA, eager or compiled: with the light ops of compiled_linear.py compiled GPT-2 124M runs
            # 382k tok/s fused vs 307k unfused and 350M ties (BENCHMARKS.md, speed round 4). Not with
            # CUDA graphs (compile mode reduce-overhead): check_compile says why.
            plugin.gradient_accumulation_fusion = self.device.type == "cuda" and not uses_cuda_graphs(compile_kwargs)
        if self.device.type == "cpu":
            check_cpu_support(plugin)
        for dl in loaders:
            check_dataloader(dl, plugin, plugin.data_parallel_size(self.num_processes))
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        if dtype is torch.float16 and self.device.type == "cpu":
            raise MegatronPluginConfigError("mixed_precision", "fp16", "fp16 needs CUDA; use 'bf16' or 'no' on CPU")
        hf_model = models[0]
        family = check_model(plugin, hf_model.config)
        variant = family.variant_of(hf_model)
        data_sizes = indexed[0].check_for(hf_model.config, family, plugin, schedulers[0] if schedulers else None,
                                          len(indexed)) if indexed else None
        step_cls = plugin.custom_train_step_class
        if step_cls is None:
            if variant not in family.trainable_variants:
                trainable = " or ".join(family.classes[v] for v in family.trainable_variants)
                raise MegatronPluginConfigError(
                    "model", type(hf_model).__name__,
                    f"this model has no head the default train step can compute a loss with: pass {trainable}, or "
                    "set custom_train_step_class to a step that computes your loss from the hidden states",
                )
            import train_steps

            step_cls = getattr(train_steps, family.train_step)
        else:
            check_step_family(step_cls, family)
        if hasattr(step_cls, "check_kwargs"):
            step_cls.check_kwargs(dict(plugin.custom_train_step_kwargs))
        whole = StagePlan.single(family.num_layers(hf_model.config))
        trainable_flags(hf_model, optimizers[0], mcore_to_hf_sources(family, hf_model.config, whole, variant))
        reader = weights_reader(hf_model, plugin, family, variant)
        if self.project_dir:
            checkpoint.check_writable(self.project_dir, "ProjectConfiguration.project_dir")

        layout = initialize(plugin, hf_model.config)
        # a damaged file may be read by some ranks only (pipeline stages read different tensors): every
        # rank raises the error, so none waits in a collective
        chunks = checkpoint.agree(lambda: MegatronModel.chunks_from_hf(
            hf_model, plugin, params_dtype=dtype if (dtype is not None and self.device.type == "cuda") else torch.float32,
            reader=reader,
        ))
        for chunk in chunks:
            sources = mcore_to_hf_sources(chunk.family, chunk.hf_config, chunk.plan, chunk.variant)
            flags = trainable_flags(hf_model, optimizers[0], sources)
            for name, param in chunk.module.named_parameters():
                param.requires_grad_(flags[name])
        model = chunks[0]
        micro = max([dl.batch_size for dl in loaders] + [m.micro_batch_size for m in indexed])
        plugin.micro_batch_size = micro
        plugin.global_batch_size = micro * plugin.num_micro_batches * layout.dp_size
        # collective: megatron-core writes the sample indices on rank 0 first, the others read them
        iterators = indexed[0].build(data_sizes, plugin, layout, layout.device, len(indexed)) if indexed else []
        self._megatron_iterators = list(iterators)
        step_args = megatron_args(plugin, model, micro, layout.dp_size)
        step = step_cls(step_args, **plugin.custom_train_step_kwargs)
        if self.device.type == "cuda":
            from .engine.gpu import MegatronCoreEngine

            engine = MegatronCoreEngine(chunks, optimizers[0], schedulers[0] if schedulers else None, plugin, step,
                                        layout.device, dtype, compile_kwargs=compile_kwargs)
        else:
            sources = mcore_to_hf_sources(model.family, model.hf_config, model.plan, model.variant)
            inner = rebuild_optimizer(optimizers[0], hf_model, sources, dict(model.module.named_parameters()))
            sched = build_scheduler(schedulers[0], inner, plugin) if schedulers else None
            engine = MegatronEngine(chunks, inner, sched, plugin, step, layout.device, autocast_dtype=dtype)
        engine.megatron_args = step_args
        self._engine = engine
        opt_wrapper = MegatronLMOptimizerWrapper(engine.optimizer, engine)
        sched_wrapper = MegatronLMSchedulerWrapper(engine.scheduler, engine.optimizer) if engine.scheduler else None

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
            elif a in schedulers:
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
        self._engine._check_ready("save_state")
        return checkpoint.save_state(
            output_dir, self._engine, self._custom_objects, distributed_optimizer=self._megatron.use_distributed_optimizer
        )

    def load_state(self, input_dir: str | None = None, **kwargs):
        if self._megatron is None:
            return super().load_state(input_dir, **kwargs)
        self._engine._check_ready("load_state")
        meta = checkpoint.load_state(input_dir, self._engine, self._custom_objects)
        if getattr(self, "_megatron_iterators", None):
            # Megatron-LM resumes its samples from iteration x global batch: the train iterator goes on there
            self._megatron_iterators[0].seek(self._engine.iteration)
        return meta

    def get_state_dict(self, model, unwrap=True):
        """The HF state dict of the whole model on every rank: gathered over TP ranks and pipeline stages."""
        if self._megatron is None:
            return super().get_state_dict(model, unwrap)
        from .engine.export import full_state_dict

        self._engine._check_ready("get_state_dict")
        return full_state_dict(self._engine)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """Write an HF checkpoint (config, sharded safetensors, index) straight from the TP/PP model:
        tensor by tensor, written by global rank 0, `from_pretrained` loads it. Collective."""
        if self._megatron is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        from .engine.export import save_model

        self._engine._check_ready("save_model")
        return save_model(self._engine, save_directory, max_shard_size, safe_serialization)

    # -- post-training ----------------------------------------------------------------------------
    def offload(self, model=None, params: bool = True, grads: bool = True, optimizer: bool = True):
        """Free the GPU memory of the prepared model: parameters, gradients and optimizer state go to pinned
        host memory (e.g. while a rollout engine generates). `reload()` brings them back bit for bit;
        until then the model refuses to run. Returns bytes moved per kind."""
        if self._megatron is None:
            raise MegatronPluginConfigError("offload", "without a MegatronLMPlugin",
                                            "offload/reload are for Megatron runs: pass megatron_lm_plugin")
        if self._engine is None:
            raise MegatronPluginConfigError("offload", "before prepare", "call accelerator.prepare(...) first")
        self._check_prepared_model("offload(model)", model)
        return self._engine.offload(params=params, grads=grads, optimizer=optimizer)

    def reload(self, model=None):
        """Bring back to the GPU what `offload()` moved to host memory."""
        if self._megatron is None or self._engine is None:
            raise MegatronPluginConfigError("reload", "nothing prepared", "call accelerator.prepare(...) and offload() first")
        self._check_prepared_model("reload(model)", model)
        return self._engine.reload()

    def snapshot_weights(self, model=None):
        """A host copy of the prepared model's weights as they are now (each rank its own shards), e.g. the
        reference policy for a KL term, taken before training."""
        self._check_prepared_model("snapshot_weights(model)", model, needs_engine=True)
        return self._engine.snapshot_weights()

    def use_weights(self, snapshot, model=None):
        """`with accelerator.use_weights(snapshot):` the model computes with the snapshot's weights (log-probs,
        generation, evaluation), then has its own back, bit for bit."""
        self._check_prepared_model("use_weights(model)", model, needs_engine=True)
        return self._engine.use_weights(snapshot)

    def _check_prepared_model(self, what, model, needs_engine=False):
        if needs_engine and (self._megatron is None or self._engine is None):
            raise MegatronPluginConfigError(what.split("(")[0], "nothing prepared",
                                            "call accelerator.prepare(...) with a MegatronLMPlugin first")
        if model is not None and model is not self._engine:
            raise MegatronPluginConfigError(what, type(model).__name__,
                                            "pass the model accelerator.prepare returned (or nothing: there is one)")
