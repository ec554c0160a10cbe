"""The CUDA engine: Megatron-Core's own machinery behind the same `engine(**batch)` step.

- `DistributedDataParallel` with gradient reduce-scatter/all-reduce overlapped with backward,
- `get_megatron_optimizer` (fp32 master weights for bf16/fp16, dynamic loss scaling for fp16, the
  distributed optimizer when the plugin asks for it, clipping to the global norm),
- the forward-backward schedules: no pipelining, 1F1B, or interleaved 1F1B with virtual stages,
- `finalize_model_grads`: DP reduction, sequence-parallel norm grads over TP, tied embeddings over PP.

Context parallelism is megatron-core's own case here too: DDP averages the gradients over the DP x CP ranks,
and the schedules multiply a (loss, logs) loss by the CP size; the train steps return each CP rank's part of
the whole sequences' loss (train_steps/gpt.py, train_steps/utils.py), so the gradients are one rank's.

MoE experts split over expert-parallel ranks (`allreduce = False`) are megatron-core's own case: DDP keeps
them in expert buffers summed over the expert-data-parallel group (each scaled by 1 / DP size first), and
get_megatron_optimizer chains an expert optimizer whose gradient norm is reduced over the expert
tensor x expert x pipeline group (device_clip.py adds the two norms on the device too).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import (OptimizerConfig, ParamKey, ParamWithNamePredicate, get_megatron_optimizer,
                                     get_standard_config_overrides)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from .. import patches
from .base import MegatronEngine, average_logs
from ..errors import MegatronPluginConfigError
from . import device_clip
from .full_graph import FullIterationGraph
from .grad_buffers import GradBufferReset
from ..layers import foreach_ops
from ..layers.fp8 import cache_weights as cache_fp8_weights, drop_weight_cache as drop_fp8_weight_cache
from ..layers.fp8 import settle as settle_fp8, state_of as fp8_state_of
from ..layers.moe import MoELayer, stack_experts_each_forward
from .optimizer import check_optimizer, check_optimizer_fields, use_fused_adam
from ..plugin import full_iteration_graph
from .scheduler import build_scheduler

logger = logging.getLogger(__name__)


def optimizer_config(user_opt: torch.optim.Optimizer, plugin, dtype: Optional[torch.dtype]) -> OptimizerConfig:
    """mcore's optimizer settings from the user's torch optimizer. mcore keeps weight decay off biases
    and 1-D parameters (norms), as HF scripts' usual parameter groups do, unless the plugin's
    no_wd_decay_cond decides (`config_overrides`)."""
    check_optimizer(user_opt)
    check_optimizer_fields(plugin, user_opt, "cuda")
    g = user_opt.param_groups[0]
    kind = type(user_opt)
    offload = bool(getattr(plugin, "optimizer_cpu_offload", False))
    common = dict(
        lr=max(pg["lr"] for pg in user_opt.param_groups),
        min_lr=plugin.min_lr,
        weight_decay=max(pg.get("weight_decay", 0.0) for pg in user_opt.param_groups),
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        params_dtype=dtype or torch.float32,
        clip_grad=plugin.gradient_clipping,
        use_distributed_optimizer=plugin.use_distributed_optimizer,
        initial_loss_scale=2**16,
        # Megatron-LM's --optimizer-offload-fraction defaults to 1.0 (mcore's OptimizerConfig to 0.0: nothing moves)
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=1.0 if offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=bool(getattr(plugin, "overlap_cpu_optimizer_d2h_h2d", False)),
        use_precision_aware_optimizer=bool(getattr(plugin, "use_precision_aware_optimizer", False)),
    )
    if kind is torch.optim.SGD:
        return OptimizerConfig(optimizer="sgd", sgd_momentum=g.get("momentum", 0.0), **common)
    beta1, beta2 = g["betas"]
    return OptimizerConfig(
        optimizer="adam", adam_beta1=beta1, adam_beta2=beta2, adam_eps=g["eps"],
        decoupled_weight_decay=kind is torch.optim.AdamW, **common,
    )


def config_overrides(plugin, config: OptimizerConfig, chunks) -> Optional[dict]:
    """mcore's per-parameter group settings for the plugin's conditions, or None (mcore's default groups:
    no weight decay on biases and 1-D parameters). The conditions see the Megatron parameter names of the
    model chunks (as on the CPU engine), not the wrappers' 'module.module.' names mcore iterates."""
    scale, no_wd = getattr(plugin, "scale_lr_cond", None), getattr(plugin, "no_wd_decay_cond", None)
    if scale is None and no_wd is None:
        return None
    names = {id(p): n for chunk in chunks for n, p in chunk.module.named_parameters()}

    def named(cond):
        return lambda param, name: bool(cond(names.get(id(param), name), param))

    # a non-None dict replaces mcore's default rule: keep it when only scale_lr_cond is given
    overrides = {} if no_wd is not None else get_standard_config_overrides(config)
    if no_wd is not None:
        overrides[ParamKey(with_name_predicate=ParamWithNamePredicate("no_wd_decay_cond", named(no_wd)))] = \
            {"wd_mult": 0.0}
    if scale is not None:
        mult = float(plugin.lr_mult)
        # mcore 0.16.1's scheduler reads each group's max_lr/min_lr (it no longer multiplies by lr_mult)
        overrides[ParamKey(with_name_predicate=ParamWithNamePredicate("scale_lr_cond", named(scale)))] = \
            {"max_lr": config.lr * mult, "min_lr": config.min_lr * mult, "lr_mult": mult}
    return overrides


def start_values(optimizer) -> None:
    """Each group's lr and weight decay as the scheduler's step 0 sets them (lr_mult's max_lr, wd_mult), so a
    run without a scheduler trains with them too."""
    for g in optimizer.param_groups:
        g["lr"] = g.get("max_lr", g["lr"])
        g["weight_decay"] = g.get("weight_decay", 0.0) * g.get("wd_mult", 1.0)


def _tracker_generators():
    """megatron-core's RNG tracker's streams, where they are generators (graph-safe tracker): a captured step
    draws from them, so the graph must advance them on each replay."""
    from megatron.core.tensor_parallel.random import get_all_rng_states

    return [s for s in get_all_rng_states().values() if isinstance(s, torch.Generator)]


def _judge_after_first_forward(forward_step, check):
    """The train step's forward_step, reading the batch check's flags once the first micro-batch's forward
    is queued: the host waits for the flags while the GPU computes, and a bad batch (or one without loss
    tokens) still stops the step before any backward."""

    @functools.wraps(forward_step)  # mcore reads the signature (checkpoint_activations_microbatch)
    def judged(*args, **kwargs):
        out = forward_step(*args, **kwargs)
        check.raise_if_no_loss()
        return out

    return judged


def _require_token_counts(forward_step):
    """The train step's forward_step under calculate_per_token_loss: its loss function must return Megatron's
    (loss sum, token count, logs). Given (loss, logs), mcore's schedules would take their mean-loss path while
    DDP sums gradients over data-parallel ranks (per-token config), scaling the gradients wrongly."""

    @functools.wraps(forward_step)
    def checked(*args, **kwargs):
        output, loss_func = forward_step(*args, **kwargs)

        def counted(*a, **k):
            result = loss_func(*a, **k)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise MegatronPluginConfigError(
                    "calculate_per_token_loss", True,
                    "the train step's loss function returns (loss, logs); per-token loss needs Megatron-LM's "
                    "(loss sum, token count, logs): return those, or set calculate_per_token_loss=False",
                )
            return result

        return output, counted

    return checked


def _foreach_weight_copy(optimizer) -> None:
    """mcore's bf16 optimizer copies the fp32 main weights into the model's weights one tensor at a time
    (it hands its copy no overflow buffer, apex's multi-tensor copy having no bf16 kernel); the
    foreach_clip patch's copy does bf16, in a few launches. MoE models have thousands of weights (one per
    expert and projection): 1,707 copies took 30 ms of host time a step at Qwen3-MoE 32x, against ~1 ms.
    The buffer is only filled with 0 (`_multi_tensor_copy_this_to_that`); the values copied are the same."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if mcore_optimizer.multi_tensor_applier is not foreach_ops.multi_tensor_applier:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "_dummy_overflow_buf", 0) is None and getattr(opt, "float16_groups", None):
            params = [p for group in opt.float16_groups for p in group]
            if params:
                opt._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=params[0].device)


def _direct_grad_handover(optimizer) -> None:
    """mcore's bf16 optimizer hands each weight's fp32 main_grad to its fp32 master copy one weight at a time
    through `.float()` (a dispatched no-op copy check per weight); with DDP's fp32 grad buffer (we always
    reduce in fp32) the handover is the same tensor, so the loop assigns it directly: MoE models have
    thousands of weights (1,707 at Qwen3-MoE 32x, ~5 ms of host time a step)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(opt, "float16_groups", None)
        if not groups or not hasattr(opt, "_copy_model_grads_to_main_grads"):
            continue
        pairs = [(p, m) for g, mg in zip(groups, opt.fp32_from_float16_groups) for p, m in zip(g, mg)]
        fp32 = [p for g in opt.fp32_from_fp32_groups for p in g]
        if not all(getattr(p, "main_grad", None) is not None and p.main_grad.dtype == torch.float32
                   for p, _ in pairs) or not all(hasattr(p, "main_grad") for p in fp32):
            continue

        def handover(pairs=pairs, fp32=fp32):
            for model_param, main_param in pairs:
                main_param.grad = model_param.main_grad
                model_param.grad = None
            for model_param in fp32:
                model_param.grad = model_param.main_grad

        opt._copy_model_grads_to_main_grads = handover


def _distopt_direct_copies(optimizer) -> None:
    """mcore's distributed optimizer moves each weight's shard twice a step one weight at a time, finding its place
    through three dict lookups and two slices each time: the gradient's shard to its fp32 master (`.float()`, a
    dispatched no-op: we reduce in fp32) and the updated master into the bf16 parameter buffer (one copy_ launch a
    weight). At 774M and DP = 2 the copies left the GPU idle 5.8 ms a step, waiting for the host. The places never
    move (mcore never reassigns main_grad or the buckets' param_data; offload resizes their storages in place), so
    they are taken once; the gradients are handed over as the same views, the weights copied in one foreach
    launch. Left as mcore has it where any other path runs (FP8 parameters, precision-aware optimizer, FSDP)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if (not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer or opt.ddp_config.use_megatron_fsdp
                or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                or opt.config.reuse_grad_buf_for_mxfp8_param_ag or any(opt._get_fp8_params_and_shard_fp32_from_fp8())):
            continue
        pairs = [(model_param, main_param)
                 for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                                   (opt.model_fp32_groups, opt.shard_fp32_groups))
                 for model_group, main_group in zip(model_groups, main_groups)
                 for model_param, main_param in zip(model_group, main_group)]
        if any(model_param.main_grad.dtype != torch.float32 for model_param, _ in pairs):
            continue  # mcore's `.float()` makes a copy there
        grads, dst, src = [], [], []
        for model_param, main_param in pairs:
            ranges = opt._get_model_param_range_map(model_param)
            grads.append((main_param, model_param.main_grad.view(-1)[ranges["param"].start:ranges["param"].end]))
            gbuf, _, bucket = opt.model_param_gbuf_map[model_param]
            world = ranges["gbuf_world_in_bucket"]
            dst.append(opt.buffers[gbuf].buckets[bucket].param_data.view(-1)[world.start:world.end])
            src.append(main_param)

        def handover(grads=grads):
            for main_param, grad in grads:
                main_param.grad = grad

        def copy_weights(lists=foreach_ops.by_dtype(dst, src)):
            for d, m in lists:
                torch._foreach_copy_(d, m)

        opt._copy_model_grads_to_main_grads = handover
        opt._copy_main_params_to_model_params = copy_weights


def compile_backend(compile_kwargs: dict):
    """The torch.compile backend of the layers: its name (accelerate's DynamoBackend as torch's lower-case name)
    or the callable given."""
    backend = compile_kwargs.get("backend", "inductor")
    return str(backend.value).lower() if hasattr(backend, "value") else backend


def wants_cpp_wrapper(layer, compile_kwargs: dict) -> bool:
    """Whether this compiled layer wants Inductor's C++ wrapper: any transformer layer without FP8 linears or CP;
    under TP, a dense one without `tp_comm_overlap`; a MoE one without TP or expert parallelism; unless the user
    chose a mode, options or another backend.
    A compiled layer's step is bound by the host launching its kernels, one Python call each with the default
    wrapper; the C++ wrapper launches them without (one H100: GPT-2 124M 432,084 tok/s against 293,522;
    Qwen3-MoE's shape 72,142 against 53,478-54,771; Llama-1B, full or LoRA, GPU-bound, unchanged; two H200s,
    774M at TP = 2 + SP, host-bound: 88,401-93,541 against 80,156-89,119, mean +8%: BENCHMARKS.md).
    The wrapper runs each graph once while compiling it (on the call's inputs, to tune its kernels): our
    side-effect ops skip that run (`compiled_linear.in_inductor_codegen`), and so do TP's linears and sums as ops
    (a collective there would run on this rank only); CP's key/value gather and expert dispatch do not.
    tp_comm_overlap's symmetric-memory ops skip it too, but only the Python wrapper has trained them on two GPUs."""
    if (str(compile_backend(compile_kwargs)).lower() != "inductor" or compile_kwargs.get("mode") not in (None, "default")
            or compile_kwargs.get("options")):
        return False
    moe = [m for m in layer.modules() if isinstance(m, MoELayer)]
    c = moe[0].config if moe else getattr(layer, "config", None)
    if c is None or any(fp8_state_of(m) is not None for m in layer.modules()):
        # FP8 layers keep the Python wrapper, the one their GPU tests train with. On one H200 (Llama-1B, 4
        # micro-batches of 2 x 2048) the C++ wrapper first timed slower (tensorwise 58,474 tok/s against 68,657),
        # while the step's weight copies made these graphs' weight sizes symbolic (fixed in layers/fp8.
        # cache_weights); since then the two time the same (68,138 against 68,438: BENCHMARKS.md), and their numbers
        # agree bit for bit (tests/test_fp8.py::test_cpp_wrapper_equals_python_wrapper)
        return False
    if (c.context_parallel_size or 1) > 1:
        return False
    if moe:  # the token dispatcher's collectives (EP, and expert TP, which mcore sets to TP unless told) are mcore's
        return (c.tensor_model_parallel_size == 1 and (c.expert_model_parallel_size or 1) == 1
                and (c.expert_tensor_parallel_size or 1) == 1)
    # a dense layer's config carries expert_tensor_parallel_size = TP too (mcore's default): not read here
    return not (c.tensor_model_parallel_size > 1 and c.tp_comm_overlap)


def use_cpp_wrapper() -> None:
    """Inductor's C++ wrapper for the graphs compiled from now on in this process. Process-wide: passed as a
    per-graph option, the backward graphs (compiled at the first backward) failed in torch 2.13
    ("CudaKernelParamCache not populated"); set in Inductor's config, forward and backward compile with it."""
    import torch._inductor.config as inductor_config

    if not inductor_config.cpp_wrapper:
        logger.info("compiled layers: Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper=True for this "
                    "process)")
        inductor_config.cpp_wrapper = True


def transformer_layers(module):
    """Every transformer layer of a model chunk: GPT's decoder, BERT's encoder, T5's encoder and decoder
    (a stack is absent on pipeline stages that don't hold it)."""
    return [layer for name in ("encoder", "decoder") if getattr(module, name, None) is not None
            for layer in getattr(module, name).layers]


class MegatronCoreEngine(MegatronEngine):
    def __init__(self, chunks, user_optimizer, dummy_scheduler, plugin, train_step, device, dtype,
                 compile_kwargs: Optional[dict] = None):
        patches.require("MegatronCoreEngine", "foreach_clip")
        graph_warmup = full_iteration_graph(plugin)
        side = None
        if graph_warmup is not None:
            # The backward syncs with the stream each weight's gradient accumulator was made on, and DDP's hooks
            # make them below: made on the legacy default stream, that sync inside the capture is illegal
            # (cudaErrorStreamCaptureImplicit, H200, 2026-11-30). megatron-core's graph managers switch the
            # process to a side stream for the same reason (transformer/cuda_graphs.py). The graph is captured on it
            # too (FullIterationGraph's stream).
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the weights' copies queued so far come first
            torch.cuda.set_stream(side)
        config = chunks[0].config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            use_distributed_optimizer=plugin.use_distributed_optimizer,
        )
        wrapped = []
        layers = [layer for chunk in chunks for layer in transformer_layers(chunk.module)]
        # process-wide (see use_cpp_wrapper), so only when every layer of the run takes it
        if compile_kwargs is not None and layers and all(wants_cpp_wrapper(layer, compile_kwargs) for layer in layers):
            use_cpp_wrapper()
        for i, chunk in enumerate(chunks):
            module = chunk.module
            if compile_kwargs is not None:
                # Per layer (accelerate's "regional compilation"): the layers share one graph, and
                # pipeline stages, virtual stages and recompute wrap layers, not whole models.
                for layer in transformer_layers(module):
                    layer.compile(**compile_kwargs)
            if dtype is not None:
                module = Float16Module(config, module)
            # only the first chunk buckets: later chunks' grads are ready last (Megatron-LM does the same)
            wrapped.append(DistributedDataParallel(config, ddp_config, module, disable_bucketing=i > 0))
            stack_experts_each_forward(chunk.module, wrapped[-1])
        opt_config = optimizer_config(user_optimizer, plugin, dtype)
        optimizer = get_megatron_optimizer(opt_config, wrapped,
                                           config_overrides=config_overrides(plugin, opt_config, chunks))
        start_values(optimizer)
        use_fused_adam(optimizer)
        _foreach_weight_copy(optimizer)
        _direct_grad_handover(optimizer)
        _distopt_direct_copies(optimizer)
        self.clip_on_device = device_clip.supported(optimizer)
        scheduler = build_scheduler(dummy_scheduler, optimizer, plugin) if dummy_scheduler is not None else None

        sync = [m.no_sync for m in wrapped]
        config.no_sync_func = sync[0] if len(sync) == 1 else sync
        grad_sync = [m.start_grad_sync for m in wrapped]
        config.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        # with the fused weight gradient, the buffers are zeroed only where no GEMM writes first
        self._grad_resets = [GradBufferReset(m) for m in wrapped]
        config.finalize_model_grads_func = self._finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        super().__init__(chunks, optimizer, scheduler, plugin, train_step, device)
        self.wrapped = torch.nn.ModuleList(wrapped)
        self.dtype = dtype
        # FP8 linears' states: their weights quantized once a training step (layers/fp8.cache_weights); the
        # delayed-scaling ones not yet set by a use settled after training steps (layers/fp8.settle)
        self._fp8_states = [st for st in (fp8_state_of(m) for c in chunks for m in c.modules()) if st is not None]
        # the step's FP8 weight copies compiled with the layers' backend (layers/fp8.cache_weights)
        self._fp8_backend = compile_backend(compile_kwargs) if compile_kwargs is not None else None
        self._unsettled_fp8 = [st for st in self._fp8_states if st.scale is not None and not st.settled]
        self.full_graph = None if graph_warmup is None else FullIterationGraph(
            graph_warmup, device, places=self._graph_places, generators=_tracker_generators, stream=side)

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.wrapped:
            m.train(mode)
        return self

    def _graph_places(self):
        """What a captured step reads and writes by address: every weight, and DDP's gradient and weight buffers."""
        places = [p for m in self.wrapped for p in m.parameters()]
        for m in self.wrapped:
            for b in m.buffers + m.expert_parallel_buffers:
                places += [t for t in (b.grad_data, b.param_data) if t is not None]
        return places

    def _run_schedule(self, micro_batches, forward_only: bool, forward_step=None, step=None, judge=True):
        n = len(micro_batches)
        step = step or self.train_step_handler
        b, s = step.schedule_shape(micro_batches[0])  # s: this context-parallel rank's tokens
        tp = parallel_state.get_tensor_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
        if self.plugin.sequence_parallelism and s % tp:
            each = f" ({s} on each of the {cp} context-parallel ranks, the part to be a multiple)" if cp > 1 else ""
            raise MegatronPluginConfigError(
                "sequence_parallelism", True, f"the sequence length {s * cp}{each} must be a multiple of tp_degree={tp}"
            )
        # the schedules take the whole sequence's length and divide it by the CP size for the p2p shapes
        chunks = list(self.wrapped)
        iters = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
        forward_step = forward_step or step.forward_step
        if self._pending_check is not None and judge:
            forward_step = _judge_after_first_forward(forward_step, self._pending_check)
        if self.plugin.calculate_per_token_loss:
            forward_step = _require_token_counts(forward_step)
        if self.expert_load is not None:
            forward_step = self.expert_load.counting(forward_step)
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=n,
            seq_length=s * cp,
            micro_batch_size=b,
            forward_only=forward_only,
        )

    def can_defer_batch_check(self) -> bool:
        # with pipelining a stage that raised after its forward would leave its peers waiting in p2p
        return parallel_state.get_pipeline_model_parallel_world_size() == 1

    def _finalize_model_grads(self, *args, **kwargs):
        for r in self._grad_resets:
            r.zero_unwritten()
        return finalize_model_grads(*args, **kwargs)

    def _forward_backward(self, micro_batches, judge=True):
        """The training step's forward and backward, its FP8 weights quantized first (under the full-iteration
        graph, inside the capture: the copies are then made anew by every replay, in the graph's memory)."""
        try:
            cache_fp8_weights(self._fp8_states, compiled=self._fp8_backend)
            return self._run_schedule(micro_batches, forward_only=False, judge=judge)
        finally:
            drop_fp8_weight_cache(self._fp8_states)

    def _train_step(self, micro_batches):
        for r in self._grad_resets:
            r.reset()
        self.optimizer.zero_grad()
        if self.full_graph is None:
            collected = self._forward_backward(micro_batches)
        else:
            # the batch check is read once the step is queued (it cannot be inside a capture); its safe
            # batch ran, and a bad one stops here, before the optimizer step. A delayed-scaling FP8 state that
            # settles changes the FP8 layers' code: a new graph, after one eager step of it
            collected = self.full_graph.run(
                micro_batches, lambda mbs: self._forward_backward(mbs, judge=False), self.iteration + 1,
                host_state=(len(self._unsettled_fp8),))
            if self._pending_check is not None:
                self._pending_check.raise_if_no_loss()
        if self.clip_on_device:
            # the norm and the skip flag stay on the device (read when asked); the LR schedule moves on
            # as mcore's does under bf16, where a step is never reported skipped
            self.last_grad_norm, self.last_step_skipped = device_clip.step(self.optimizer)
            ok = True
        else:
            ok, self.last_grad_norm, _ = self.optimizer.step()
            self.last_step_skipped = not ok
        if ok and self.scheduler is not None:
            self.scheduler.step(1)
        self.iteration += 1
        if self._unsettled_fp8:  # normally after the first step only: one device read
            # under the graph every rank holds the same linears (no pipelining) and must see the same host state
            self._unsettled_fp8 = settle_fp8(self._unsettled_fp8,
                                             group=dist.group.WORLD if self.full_graph is not None else None)
        return self._share_from_last_stage(average_logs(collected))

    def _eval_step(self, micro_batches):
        collected = self._run_schedule(micro_batches, forward_only=True)
        logits = self._collect_logits(collected) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None
        return self._share_from_last_stage(average_logs(collected)), logits

    def run_forward_only(self, micro_batches, forward_step=None, step=None):
        return self._run_schedule(micro_batches, forward_only=True, forward_step=forward_step, step=step)

    def gather_rows(self, collected, key):
        """The micro-batches' [b, s] outputs, concatenated on the last stage and sent to the other stages."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return super().gather_rows(collected, key)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        out = super().gather_rows(collected, key).float().contiguous() if last else None
        shape = [tuple(out.shape) if last else None]
        dist.broadcast_object_list(shape, src=src, group=group)
        if not last:
            out = torch.empty(shape[0], dtype=torch.float32, device=self.device)
        dist.broadcast(out, src=src, group=group)
        return out

    def _share_from_last_stage(self, logs):
        """Losses exist on the last pipeline stage; give every stage the same values."""
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return logs
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        keys = [sorted(logs)] if last else [None]
        group = parallel_state.get_pipeline_model_parallel_group()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(keys, src=src, group=group)
        values = torch.stack([logs[k] for k in keys[0]]).to(self.device) if last else torch.zeros(len(keys[0]), device=self.device)
        dist.broadcast(values, src=src, group=group)
        return dict(zip(keys[0], values))
