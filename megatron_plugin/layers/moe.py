"""Mixture of Experts in megatron-core's MoELayer slot, on CPU (gloo) and CUDA, without TE.

megatron-core 0.16.1's pieces are CUDA-bound in places: `TopKRouter.gating` moves its weight to
`torch.cuda.current_device()`, the allgather dispatcher's collectives allocate on CUDA (on CPU the
`cpu_sequence_parallel` patch routes them to `sp_comm`), and `SequentialMLP` reads the token counts back to the
host. Here:

- `Router`: HF's routing (softmax in fp32 over the logits, top-k, optionally renormalized), mcore's
  capacity/dropping (`moe_expert_capacity_factor`), and the micro-batch's routing statistics
  (`RouterStats`) from which the train step computes HF's load-balancing loss over all layers together.
  mcore's own aux-loss machinery never runs (its losses are per layer, HF's is across layers).
- `TokenDispatcher`: mcore's allgather dispatcher over the expert TP x EP group; with expert-TP x EP == 1
  and no capacity, a counting-sort permutation that never syncs.
- `Experts`: mcore's `SequentialMLP` parameters (`local_experts.{e}.linear_fc1/fc2`); on CUDA in bf16 the
  experts run as two grouped GEMMs (`torch._grouped_mm`) over the stacked local weights, the weight
  gradients going into `main_grad` under gradient_accumulation_fusion.
- `MoELayer`: mcore's MoELayer building our dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer as _McoreMoELayer
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from .compiled_linear import define_op, in_inductor_codegen

# ---------------------------------------------------------------------------------------------------
# collectives on any device


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce whose backward is the identity: every rank then holds the same total and computes the
    same loss from it, so each rank's local part receives that loss's gradient once (mcore's
    `reduce_from_tensor_model_parallel_region`, without its in-place write into the input)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@torch.compiler.disable
def _sum_over(x: torch.Tensor, group, grad: bool) -> torch.Tensor:
    if grad:
        return _SumOverGroup.apply(x, group)
    x = x.detach().clone()
    dist.all_reduce(x, group=group)
    return x


# ---------------------------------------------------------------------------------------------------
# router


@dataclass
class RouterStats:
    """One router's statistics for one micro-batch, over its valid (non-padding) tokens, summed over the
    TP group under sequence parallelism so that every TP rank holds the whole micro-batch's.

    counts: [E] top-k selections per expert, before capacity dropping (no grad).
    prob_sum: [E] sum of the full softmax probabilities (with grad).
    tokens: number of valid tokens (scalar, no grad).
    z_sum: sum of logsumexp(logits)^2 (scalar, with grad).
    dropped: expert assignments dropped by the capacity (scalar, no grad).
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    tokens: torch.Tensor
    z_sum: torch.Tensor
    dropped: torch.Tensor

    @property
    def dropped_fraction(self) -> torch.Tensor:
        assignments = self.counts.sum()
        return self.dropped / torch.clamp(assignments, min=1.0)


class Router(MegatronModule):
    """Top-k softmax router computing exactly what HF's Mixtral / Qwen2-MoE / Qwen3-MoE routers compute:
    logits = x @ W^T in the input's dtype, softmax in fp32, top-k; renormalized over the top-k unless
    `moe_router_pre_softmax` (HF `norm_topk_prob=False`). mcore's non-pre-softmax path (softmax over the
    top-k logits) is the same function, but computed differently; this follows HF's operations.

    Its parameter is mcore's `weight` [E, H], replicated over TP and marked `sequence_parallel` (like
    mcore's router and our norms) so its gradient, computed on a sequence shard under SP, is summed over TP.
    """

    def __init__(self, config: TransformerConfig, pg_collection=None) -> None:
        super().__init__(config)
        if config.add_bias_linear:
            raise NotImplementedError("the MoE router has no bias here (add_bias_linear=False, as HF's routers)")
        if config.moe_router_score_function != "softmax":
            raise NotImplementedError(
                f"moe_router_score_function={config.moe_router_score_function!r}: only 'softmax' (HF's) is mapped")
        # mcore's other routings have no HF counterpart in the mapped families; models/ refuses them by
        # name before prepare, this is the backstop for models built by hand
        unmapped = {"moe_router_num_groups": config.moe_router_num_groups,
                    "moe_router_group_topk": config.moe_router_group_topk,
                    "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
                    "moe_input_jitter_eps": config.moe_input_jitter_eps,
                    "moe_router_force_load_balancing": config.moe_router_force_load_balancing,
                    "moe_enable_routing_replay": config.moe_enable_routing_replay}
        unmapped = {k: v for k, v in unmapped.items() if v}
        if config.moe_router_load_balancing_type == "sinkhorn":
            unmapped["moe_router_load_balancing_type"] = "sinkhorn"
        if unmapped:
            raise NotImplementedError(f"router settings without an HF counterpart: {unmapped}")
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.layer_number = None
        self.tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32, device=device))
        if config.perform_initialization:
            config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel
        self.stats: Optional[RouterStats] = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype)
        if dtype is None:
            return F.linear(x, self.weight.to(x.dtype))
        return F.linear(x.to(dtype), self.weight.to(dtype))

    def forward(self, hidden: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden: [s, b, H] (or [T, H]); padding_mask: [s, b] bool, True = padding (mcore's meaning).
        Returns probs [T, E] fp32 (zero off the routing map) and routing_map [T, E] bool."""
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = self._logits(x)
        scores = torch.softmax(logits.float(), dim=-1)
        top_p, top_i = torch.topk(scores, self.topk, dim=-1)
        if not self.config.moe_router_pre_softmax:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        if self.config.moe_router_topk_scaling_factor:
            top_p = top_p * self.config.moe_router_topk_scaling_factor
        probs = torch.zeros_like(scores).scatter(1, top_i, top_p)
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_i, True)
        routing_map = chosen
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, chosen, router_topk=self.topk, capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )
        self.stats = self._statistics(logits, scores, chosen, routing_map, padding_mask)
        return probs, routing_map

    def _statistics(self, logits, scores, chosen, routing_map, padding_mask) -> RouterStats:
        valid = None if padding_mask is None else (~padding_mask.reshape(-1).bool()).to(scores.dtype)
        weighted = scores if valid is None else scores * valid.unsqueeze(-1)
        prob_sum = weighted.sum(dim=0)
        z = torch.logsumexp(logits.float(), dim=-1).square()
        z_sum = (z if valid is None else z * valid).sum()
        with torch.no_grad():
            lost = chosen & ~routing_map
            if valid is None:
                counts = chosen.sum(dim=0).float()
                tokens = scores.new_full((), float(scores.shape[0]))  # a fill, not a host-to-device copy
                dropped = lost.sum().float()
            else:
                counts = (chosen.float() * valid.unsqueeze(-1)).sum(dim=0)
                tokens = valid.sum()
                dropped = (lost.float() * valid.unsqueeze(-1)).sum()
        if self.config.sequence_parallel and _group_size(self.tp_group) > 1:
            e = self.num_experts
            summed = _sum_over(torch.cat([prob_sum, z_sum.reshape(1)]), self.tp_group, grad=True)
            prob_sum, z_sum = summed[:e], summed[e]
            plain = _sum_over(torch.cat([counts, tokens.reshape(1), dropped.reshape(1)]), self.tp_group, grad=False)
            counts, tokens, dropped = plain[:e], plain[e], plain[e + 1]
        return RouterStats(counts=counts, prob_sum=prob_sum, tokens=tokens, z_sum=z_sum, dropped=dropped)


def moe_routers(module: torch.nn.Module) -> List[Router]:
    """This module's routers (one per MoE layer of this pipeline stage), in layer order."""
    return [m for m in module.modules() if isinstance(m, Router)]


def hf_load_balancing_loss(stats: List[RouterStats], num_experts: int, topk: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` over the router logits of all the given layers together:
    num_experts * sum_e (sum_l counts_le / N) * (sum_l prob_sum_le / N), N = sum_l valid tokens_l (= L*T).
    `topk` is the routers' (their counts already hold top-k selections); kept for HF's signature."""
    del topk
    counts = torch.stack([s.counts for s in stats]).sum(dim=0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
    rows = torch.stack([torch.as_tensor(s.tokens, dtype=torch.float32, device=counts.device) for s in stats]).sum()
    rows = torch.clamp(rows, min=1.0)
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def z_loss(stats: List[RouterStats]) -> torch.Tensor:
    """megatron-core's router z-loss without its coefficient: per layer, the mean over valid tokens of
    logsumexp(logits)^2; summed over layers."""
    return sum(s.z_sum / torch.clamp(s.tokens, min=1.0) for s in stats)


def padding_mask_from_hf(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """mcore's MoE `padding_mask` ([b, s] bool, True = padding) from an HF attention mask (1 = token)."""
    if attention_mask is None:
        return None
    return attention_mask == 0


# ---------------------------------------------------------------------------------------------------
# dispatcher


class _SpreadRows(torch.autograd.Function):
    """Token t's row copied to its k expert slots in expert order: out[p] = x[token[p]]. The backward
    gathers each slot's gradient back into token order by `slots` ([T * k]: token t's k slot positions) and
    sums the k slots (in fp32): gathers only, where index_select's own backward would scatter-add with atomics."""

    @staticmethod
    def forward(ctx, x, token, slots, k):
        ctx.save_for_backward(slots)
        ctx.k, ctx.tokens = k, x.shape[0]
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (slots,) = ctx.saved_tensors
        g = grad.index_select(0, slots).view(ctx.tokens, ctx.k, -1)
        return g.sum(dim=1, dtype=torch.float32).to(grad.dtype), None, None, None


class _GatherSlots(torch.autograd.Function):
    """The inverse of `_SpreadRows`: out[t] = sum of token t's k expert outputs (fp32 sum), by one gather
    over `slots`; the backward hands each slot its token's gradient (a gather too)."""

    @staticmethod
    def forward(ctx, y, token, slots, k):
        ctx.save_for_backward(token)
        tokens = y.shape[0] // k
        return y.index_select(0, slots).view(tokens, k, -1).sum(dim=1, dtype=torch.float32).to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        return grad.index_select(0, token), None, None, None


def expert_slots(routing_map: torch.Tensor, k: int):
    """Dropless routing [T, E] (k experts per token) -> (order [T*k]: for each expert-major slot, the pair
    t*k + j (token t's j-th expert) it holds, tokens ascending within an expert; slots [T*k]: the inverse,
    the slot of each pair; top_i [T, k]: the experts of the pairs; tokens_per_expert [E]). The permutation a
    stable sort of the pairs by expert gives, found by counting: a token's place among its expert's tokens
    is a running count down the routing map, so no sort kernel runs and nothing reads the host."""
    top_i = torch.topk(routing_map.to(torch.float32), k, dim=1).indices
    counts = routing_map.to(torch.int32).cumsum(dim=0)
    tokens_per_expert = counts[-1]
    start = torch.cumsum(tokens_per_expert, dim=0) - tokens_per_expert
    slots = (start + counts - 1).gather(1, top_i).reshape(-1).long()
    order = torch.empty_like(slots).scatter_(0, slots, torch.arange(slots.numel(), device=slots.device))
    return order, slots, top_i, tokens_per_expert


class TokenDispatcher(MoEAllGatherTokenDispatcher):
    """mcore's allgather dispatcher (tokens gathered over the expert TP x EP group, outputs reduce-scattered
    back; on CPU its collectives reach `sp_comm` through the `cpu_sequence_parallel` patch). With expert-TP x EP
    == 1 and no capacity it permutes by a counting sort of the routing map (`expert_slots`): exactly T*topk
    rows, token counts left on the device, no host sync."""

    def _sorted_path(self) -> bool:
        return _group_size(self.tp_ep_group) == 1 and self.config.moe_expert_capacity_factor is None

    def dispatch_postprocess(self, hidden_states, probs):
        self.sorted = None
        if not self._sorted_path():
            return super().dispatch_postprocess(hidden_states, probs)
        routing_map = self.routing_map
        self.routing_map = None
        k = self.router_topk
        with torch.no_grad():
            # dropless: every token has exactly k experts
            order, slots, top_i, tokens_per_expert = expert_slots(routing_map, k)
            token = torch.div(order, k, rounding_mode="floor")
        self.sorted = (token, slots, k)
        self.local_probs = probs.gather(1, top_i).reshape(-1)[order]
        return _SpreadRows.apply(hidden_states, token, slots, k), tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        if self.sorted is None:
            return super().combine_preprocess(hidden_states)
        out = _GatherSlots.apply(hidden_states, *self.sorted)
        self.sorted = None
        return out


# ---------------------------------------------------------------------------------------------------
# experts


def _torch_grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_fake(a, b, offs):
    if b.dim() == 3:  # [N, in] x [E, in, out] -> [N, out]
        return a.new_empty((a.shape[0], b.shape[-1]))
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))  # [out, N] x [N, in] over N -> [E, out, in]


_grouped_mm_op = None


def _grouped_mm():
    """torch's grouped GEMM as our own op: Inductor's C++ wrapper (which the CUDA engine compiles layers without
    collectives with, MoE ones included, `engine/gpu.wants_cpp_wrapper`) has no C shim for `aten::_grouped_mm`
    before torch 2.12 (torchgen/aoti/fallback_ops.py; the GPU machines run 2.11) and calls our op through Python
    instead. None where torch has no grouped GEMM."""
    global _grouped_mm_op
    if _torch_grouped_mm() is None:
        return None
    if _grouped_mm_op is None:
        op = define_op("moe_grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor",
                       lambda a, b, offs: _torch_grouped_mm()(a, b, offs=offs), _grouped_mm_fake)
        _grouped_mm_op = lambda a, b, offs: op(a, b, offs)  # noqa: E731 (offs by keyword, as torch's)
    return _grouped_mm_op


def _grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                   weights: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each weight's main_grad += its group's grad_e^T @ x_e; returns the placeholder gradients that DDP's
    hook then skips (`grad_added_to_main_grad`): one allocation for all the experts, as views."""
    if in_inductor_codegen():  # see compiled_linear.in_inductor_codegen: no side effect then
        return [torch.empty_like(w) for w in weights]
    # [E, out, in]; torch's grouped GEMM writes only its inputs' dtype (bf16). Cast once to main_grad's
    # dtype so that one multi-tensor add covers every expert (mixed dtypes leave foreach's fast path:
    # one kernel launch per expert, thousands a step)
    dw = _grouped_mm()(grad.t(), x, offs=offs)
    mains = [w.main_grad for w in weights]
    torch._foreach_add_(mains, list(dw.to(mains[0].dtype).unbind(0)))
    zero = False
    for w in weights:
        w.grad_added_to_main_grad = True
        zero = zero or getattr(w, "zero_out_wgrad", False)
    # DDP's hook (overlap_grad_reduce) requires a gradient; views of one block obey AccumulateGrad's layout
    # contract, so it keeps them without copying
    shape = (len(weights), *weights[0].shape)
    block = torch.zeros(shape, dtype=x.dtype, device=x.device) if zero else x.new_empty(shape)
    return list(block.unbind(0))


def _grouped_wgrad_fake(grad, x, offs, weights):
    return [x.new_empty(w.shape) for w in weights]


# opaque to the compiler (its side effect on main_grad is invisible to it), so that the autograd function
# around it is traced and the MoE layer compiles as one graph with the rest of the transformer layer
_grouped_wgrad_op = define_op("moe_grouped_wgrad(Tensor grad, Tensor x, Tensor offs, Tensor[] weights) -> Tensor[]",
                              _grouped_wgrad, _grouped_wgrad_fake)


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] @ W_e^T for all local experts in one grouped GEMM, taking the
    experts' weights one by one so each receives its own gradient. With `fuse`, the weight gradients
    go straight into each weight's `main_grad` (megatron-core DDP's buffer), as the dense linears do
    with gradient_accumulation_fusion (`_grouped_wgrad`), through an op the compiler does not trace."""

    @staticmethod
    def forward(ctx, x, offs, fuse, *weights):
        ctx.fuse = fuse
        ctx.save_for_backward(x, offs, *weights)
        w = torch.stack([t.to(x.dtype) for t in weights])
        return _grouped_mm()(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        mm = _grouped_mm()
        w = torch.stack([t.to(x.dtype) for t in weights])
        dx = mm(grad, w, offs=offs) if ctx.needs_input_grad[0] else None
        if ctx.fuse:
            return (dx, None, None, *_grouped_wgrad_op(grad, x, offs, list(weights)))
        # [E, out, in]: per group grad_e^T @ x_e (2D x 2D grouped over the token dimension)
        dw = mm(grad.t(), x, offs=offs)
        return (dx, None, None, *(dw[e].to(t.dtype) for e, t in enumerate(weights)))


class _StackedGroupedLinear(torch.autograd.Function):
    """`_GroupedLinear` on the local experts' weights stacked into one tensor [E, out, in] (a leaf made
    outside the compiled layer, `stack_experts_each_forward`): autograd then has one weight edge per layer
    and projection instead of one per expert, and the stacked weight gradient [E, out, in] goes to that
    leaf, whose hook (`_into_main_grad`) adds it into the experts' main_grads."""

    @staticmethod
    def forward(ctx, x, offs, w):
        ctx.save_for_backward(x, offs, w)
        return _grouped_mm()(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, offs, w = ctx.saved_tensors
        grad = grad.contiguous()
        mm = _grouped_mm()
        dx = mm(grad, w, offs=offs) if ctx.needs_input_grad[0] else None
        dw = mm(grad.t(), x, offs=offs) if ctx.needs_input_grad[2] else None
        return dx, None, dw


def grouped_expert_mlp(x: torch.Tensor, fc1, fc2, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                       activation=F.silu, fuse_wgrad: bool = False) -> torch.Tensor:
    """The local experts' gated MLPs as two grouped GEMMs. x: [N, H] rows grouped by expert; fc1: each
    expert's [2F, H] weight (gate rows then up rows), or all of them stacked [E, 2F, H]; fc2: each expert's
    [H, F], or [E, H, F] stacked; probs [N] applied after the activation (as mcore's MLP applies
    `per_token_scale`). The offsets stay on the device: no host sync.
    fuse_wgrad (weights given one by one): weight gradients accumulate into the weights' `main_grad`
    (see `_GroupedLinear`)."""
    offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32)

    def linear(t, w):
        if torch.is_tensor(w):
            return _StackedGroupedLinear.apply(t, offs, w)
        return _GroupedLinear.apply(t, offs, fuse_wgrad, *w)

    h = linear(x, fc1)
    gate, up = h.chunk(2, dim=-1)
    a = activation(gate) * up
    a = (a * probs.unsqueeze(-1)).to(a.dtype)
    return linear(a, fc2)


def _into_main_grad(experts: "Experts", weights: List[torch.Tensor], stacked: torch.Tensor) -> None:
    """Post-accumulate hook of a stacked expert weight: its gradient [E, out, in] goes into each expert
    weight's main_grad (megatron-core DDP's fp32 buffer) with one multi-tensor add, or into `.grad` where
    there is no main_grad; then the weights are reported ready to DDP, whose own hooks never fire for them
    (they are not in the graph)."""
    dw, stacked.grad = stacked.grad, None
    mains = [getattr(w, "main_grad", None) for w in weights]
    if all(m is not None for m in mains):
        # one cast of the whole block: mixed dtypes would leave foreach's fast path (one kernel per expert)
        torch._foreach_add_(mains, list(dw.to(mains[0].dtype).unbind(0)))
    else:
        for w, g in zip(weights, dw.unbind(0)):
            w.grad = g.to(w.dtype) if w.grad is None else w.grad + g.to(w.dtype)
    ddp = experts._ddp
    if ddp is not None and ddp.ddp_config.overlap_grad_reduce:
        for w in weights:
            group = ddp.param_to_bucket_group.get(w)
            if group is not None:
                group.register_grad_ready(w, ddp.force_all_reduce)


class Experts(SequentialMLP):
    """mcore's `SequentialMLP` (same parameters, names and checkpoints: `local_experts.{e}.linear_fc1/fc2`,
    each an MLP on our linears). On CUDA in bf16 the forward runs grouped GEMMs over the stacked local weights
    instead of a loop that reads the token counts back to the host.

    Where the engine stacks the weights before each forward of the model (`stack_experts_each_forward`,
    outside the compiled layers), the layer reads those stacks and the per-expert weights never enter the
    autograd graph: at Qwen3-MoE's shape that is 1,536 fewer AccumulateGrad nodes and DDP hooks a backward.
    Otherwise (recompute in backward, generation, a model called without the engine) the weights go in one by
    one; each gets its own gradient, or under gradient_accumulation_fusion the grouped weight-gradient GEMM's
    slice goes into its main_grad directly (`_GroupedLinear`)."""

    _stacks = None  # (fc1 [E, 2F, H], fc2 [E, H, F]) for the forward under way, set by the engine's hooks
    _stack_store = None  # the stacks kept between forwards, with what copies the weights into them
    _ddp = None  # megatron-core DDP holding the weights, to report them ready (`_into_main_grad`)

    def _weights_can_group(self) -> bool:
        c = self.config
        w1 = self.local_experts[0].linear_fc1.weight
        h, f = w1.shape[1], self.local_experts[0].linear_fc2.weight.shape[1]
        return (w1.is_cuda and w1.dtype == torch.bfloat16 and _grouped_mm() is not None and c.gated_linear_unit
                and c.activation_func is F.silu and not c.add_bias_linear and not c.fp8 and not c.fp4
                and not c.moe_apply_probs_on_input and c.activation_func_clamp_value is None
                and c.glu_linear_offset == 0 and h % 8 == 0 and f % 8 == 0)

    def _can_group(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == torch.bfloat16 and self._weights_can_group()

    def stack_copies(self):
        """(destinations, sources) that fill this layer's stacks with its current weights, the stacks made on
        first use (and again if the weights moved): one [E, out, in] autograd leaf per projection, whose
        gradient hook feeds the experts' main_grads. [], [] where the grouped path does not run. The stacks
        stay allocated between forwards (so the copies of every layer are one multi-tensor copy, and the
        compiled layer sees the same tensors each time); `release_stacks` frees them."""
        if not self._weights_can_group():
            return [], []
        store = self._stack_store
        w = self.local_experts[0].linear_fc1.weight
        if store is None or store[0][0].device != w.device:
            stacks, dsts, srcs = [], [], []
            for name in ("linear_fc1", "linear_fc2"):
                weights = [getattr(e, name).weight for e in self.local_experts]
                stacked = torch.empty((len(weights), *weights[0].shape), dtype=weights[0].dtype, device=w.device,
                                      requires_grad=True)
                stacked.register_post_accumulate_grad_hook(partial(_into_main_grad, self, weights))
                stacks.append(stacked)
                # through .data: filling the stacks is not a change autograd must see (a pipeline schedule runs
                # the next micro-batch's forward, with the same weights, before the last one's backward)
                dsts += list(stacked.data.unbind(0))
                srcs += weights
            store = self._stack_store = (tuple(stacks), dsts, srcs)
        for stacked in store[0]:
            stacked.requires_grad_(w.requires_grad)
        return store[1], store[2]

    def release_stacks(self) -> None:
        self._stacks = self._stack_store = None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if not self._can_group(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        if self._stacks is not None:
            fc1, fc2 = self._stacks
            return grouped_expert_mlp(x, fc1, fc2, tokens_per_expert, permuted_probs), None
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        # as our linears (`linear._fuse_only_with_main_grad`): fused only where DDP gave a main_grad
        fuse = bool(self.config.gradient_accumulation_fusion) and all(hasattr(w, "main_grad") for w in fc1 + fc2)
        return grouped_expert_mlp(x, fc1, fc2, tokens_per_expert, permuted_probs, fuse_wgrad=fuse), None


def stack_experts_each_forward(model: torch.nn.Module, ddp=None) -> None:
    """Have `model`'s forward first copy every MoE layer's expert weights into its stacks (one multi-tensor
    copy for the whole model) and hand them to the layers, and take them back after (hooks on `model`, which
    must not be compiled itself: the stacks are leaves made outside the compiled layers). `ddp`: the
    megatron-core DDP wrapping `model`, told when the expert weights' gradients are in. A recompute in
    backward runs after the forward and takes the per-expert path."""
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if not experts:
        return
    for e in experts:
        object.__setattr__(e, "_ddp", ddp)  # not as a submodule: DDP wraps the model that holds `e`

    def stack(module, args):
        dsts, srcs = [], []
        for e in experts:
            d, s = e.stack_copies()
            dsts += d
            srcs += s
        if dsts:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
            for e in experts:
                e._stacks = None if e._stack_store is None else e._stack_store[0]

    def drop(module, args, output):
        for e in experts:
            e._stacks = None

    model.register_forward_pre_hook(stack)
    model.register_forward_hook(drop)


def release_expert_stacks(model: torch.nn.Module) -> None:
    """Free the expert weight stacks (offload: they hold a copy of the experts on the GPU); the next forward
    makes them again."""
    for m in model.modules():
        if isinstance(m, Experts):
            m.release_stacks()


# ---------------------------------------------------------------------------------------------------
# layer


class MoELayer(_McoreMoELayer):
    """mcore's MoELayer with our dispatcher. mcore picks its dispatcher from `moe_token_dispatcher_type`
    inside its constructor; only the allgather one is CPU-safe and ours replaces it (its constructor
    allocates nothing). mcore's rule stays: training with TP > 1 needs sequence parallelism."""

    def __init__(self, config: TransformerConfig, submodules=None, layer_number=None, pg_collection=None):
        if config.moe_token_dispatcher_type != "allgather":
            raise NotImplementedError(
                f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: only 'allgather' is built here")
        if config.moe_shared_expert_overlap:
            raise NotImplementedError("moe_shared_expert_overlap needs CUDA streams and TE; leave it False")
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.token_dispatcher = TokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=self._pg_collection(pg_collection),
        )

    @staticmethod
    def _pg_collection(pg_collection):
        if pg_collection is not None:
            return pg_collection
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

        return get_default_pg_collection()
