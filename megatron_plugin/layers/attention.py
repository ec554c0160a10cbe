"""`SDPAttention`: core attention on `torch.nn.functional.scaled_dot_product_attention`. It picks flash /
memory-efficient kernels on GPU and runs on CPU, where mcore's `DotProductAttention` needs a CUDA
memory buffer and the CUDA RNG tracker.

Context parallelism (CP, layers/context_parallel.py): each rank holds 2 of the 2*CP chunks of the sequence
and its queries attend to the whole sequence, so keys and values are all-gathered over the CP group
(global order; the backward reduce-scatters their gradients, which is exact), rather than passed round a
ring as TE does. All-gather, because: under GQA the keys and values are a fraction of the activations
(Llama-3-8B: 8 of 32 heads), so holding them whole costs little; one collective per layer instead of CP-1
steps with a softmax merge after each; and every mask we need (padding, packed documents, a sliding window)
is exact and trivial written over global positions, with one SDPA call per local chunk. Llama 3 trained
with the same all-gather scheme at 128k tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
import torch.distributed as dist
from megatron.core.transformer.attention import SelfAttention as McoreSelfAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from ..errors import MegatronPluginConfigError
from .comm import all_gather_last_dim
from .context_parallel import check_context_parallel, gather_sequence
from .masks import causal_mask
from .rng_fork import dropout_call


# Megatron-Core's attention backends -> torch SDPA kernels (in order of preference); None: torch picks. TE's
# 'fused' is its cuDNN fused attention: torch's cuDNN kernel, else its memory-efficient one; 'unfused' (TE's
# unfused softmax) and 'local' (mcore's DotProductAttention) compute the scores and softmax apart: the math path.
SDPA_KERNELS = {
    AttnBackend.auto: None,
    AttnBackend.flash: (SDPBackend.FLASH_ATTENTION,),
    AttnBackend.fused: (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    AttnBackend.unfused: (SDPBackend.MATH,),
    AttnBackend.local: (SDPBackend.MATH,),
}

# what torch raises when none of the allowed kernels takes the inputs
_NO_KERNEL = ("No available kernel", "No viable backend")


def sdpa_kernels(config: TransformerConfig):
    backend = getattr(config, "attention_backend", AttnBackend.auto)
    if not isinstance(backend, AttnBackend):  # a name (other_megatron_args), as mcore's argparse takes it
        backend = AttnBackend[str(backend).lower()] if not isinstance(backend, bool) else AttnBackend.auto
    return SDPA_KERNELS[backend]


class SDPAttention(MegatronModule):
    """Drop-in for mcore's DotProductAttention: [s, b, heads, dim] in, [s, b, heads * dim] out.

    `attention_mask` follows Megatron's convention: a bool tensor broadcastable to [b, 1, sq, sk]
    where True means *masked out*. With no mask and a causal layer, SDPA's own causal path is used.
    Grouped-query attention (fewer key/value heads than query heads) is handled by SDPA's `enable_gqa`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        check_context_parallel(config.context_parallel_size)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
            self.cp_rank = dist.get_rank(group)
        tp = config.tensor_model_parallel_size
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim**-0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_type = attention_type
        # the kernels config.attention_backend allows (None: torch's choice)
        self.kernels = sdpa_kernels(config)
        # set by generation (megatron_plugin.generation.cache) while it decodes; None when training
        self.kv_cache = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need Transformer Engine's attention")
        if self.cp_size > 1:
            causal = (attn_mask_type if attn_mask_type is not None else self.attn_mask_type) == AttnMaskType.causal
            return self._over_context_parallel(query, key, value, attention_mask, attention_bias, causal)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.kv_cache is not None:
            out = self.kv_cache.attend(q, k, v, self.softmax_scale, self.groups != self.heads, attention_bias)
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        attn_mask = None
        is_causal = False
        if attention_bias is not None:
            # a bias (T5's relative positions) leaves no room for SDPA's is_causal: the causal part of a
            # decoder's mask goes into the bias too
            attn_mask = attention_bias.to(q.dtype)
            masked = attention_mask
            if masked is None and mask_type == AttnMaskType.causal:
                masked = causal_mask(sq, key.shape[0], q.device)
            if masked is not None:
                attn_mask = attn_mask.masked_fill(masked, float("-inf"))
        elif attention_mask is not None:
            attn_mask = ~attention_mask
        else:
            # A single new query during decoding attends to every cached key: not causal.
            is_causal = mask_type == AttnMaskType.causal and sq == key.shape[0]
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                      enable_gqa=self.groups != self.heads)
        # the heads differ across TP ranks: their dropout draws from megatron-core's tracker (layers/rng_fork.py)
        out = dropout_call(self._attend, q, k, v, kwargs, dropout_p=dropout_p, on_cuda=q.is_cuda,
                           sequence_parallel=self.config.sequence_parallel)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _attend(self, q, k, v, kwargs):
        return F.scaled_dot_product_attention(q, k, v, **kwargs) if self.kernels is None \
            else self._on_chosen_kernels(q, k, v, kwargs)

    def _over_context_parallel(self, query, key, value, attention_mask, attention_bias, causal):
        """This rank's queries (its chunks r and 2*CP-1-r, local order) over the whole sequence's keys and
        values. `attention_mask` is [b, 1, 2L, s] (True = masked) or None: plain causal by global
        positions, where each local chunk attends to the keys up to its own end, its last query to its last
        key: SDPA's lower-right causal bias, which flash / memory-efficient kernels take on GPU."""
        if attention_bias is not None or self.kv_cache is not None:
            raise NotImplementedError("context parallelism runs decoder self-attention in training and scoring "
                                      "only (no attention bias, no decoding cache)")
        sq, b = query.shape[0], query.shape[1]
        key = gather_sequence(key, self.cp_size, 0)
        value = gather_sequence(value, self.cp_size, 0)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(dropout_p=dropout_p, scale=self.softmax_scale, enable_gqa=self.groups != self.heads)
        out = dropout_call(self._attend_context_parallel, q, k, v, kwargs, attention_mask, causal, sq,
                           dropout_p=dropout_p, on_cuda=q.is_cuda, sequence_parallel=self.config.sequence_parallel)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _attend_context_parallel(self, q, k, v, kwargs, attention_mask, causal, sq):
        if not causal:
            attn_mask = None if attention_mask is None else ~attention_mask
            return self._sdpa(q, k, v, dict(kwargs, attn_mask=attn_mask, is_causal=False))
        # each local chunk over its causal key prefix only (keys past a chunk's end are masked for all of its
        # queries): half the work of one call over every key
        chunk, rank = sq // 2, self.cp_rank
        ends = ((rank + 1) * chunk, (2 * self.cp_size - rank) * chunk)  # each local chunk's last key + 1
        return torch.cat([
            self._sdpa(q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :end], v[:, :, :end],
                       dict(kwargs, is_causal=False, attn_mask=(
                           self._lower_right(chunk, end, q.device) if attention_mask is None
                           else ~attention_mask[:, :, i * chunk:(i + 1) * chunk, :end])))
            for i, end in enumerate(ends)], dim=2)

    def _lower_right(self, queries: int, keys: int, device):
        bias = causal_lower_right(queries, keys)
        # the bias dispatches to flash, else memory-efficient attention, else the math path on its mask, as
        # far as the enabled kernels allow (attention_backend's sdpa_kernel context): it goes in as itself
        # unless only the math path is allowed, which takes the mask it stands for
        allowed = self.kernels is None or any(
            k in self.kernels for k in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION))
        return bias if allowed else bias._materialize(device)

    def _sdpa(self, q, k, v, kwargs):
        return (F.scaled_dot_product_attention(q, k, v, **kwargs) if self.kernels is None
                else self._on_chosen_kernels(q, k, v, kwargs))

    def _on_chosen_kernels(self, q, k, v, kwargs):
        try:
            with sdpa_kernel(list(self.kernels), set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        except RuntimeError as err:
            if not any(m in str(err) for m in _NO_KERNEL):
                raise
            what = (f"{q.dtype} on {q.device.type}, head dim {q.shape[-1]}, "
                    f"{'a mask or bias' if kwargs['attn_mask'] is not None else 'no mask'}, "
                    f"dropout {kwargs['dropout_p']}")
            raise MegatronPluginConfigError(
                "attention_backend", getattr(self.config.attention_backend, "name", self.config.attention_backend),
                f"torch's {'/'.join(kernel.name for kernel in self.kernels)} SDPA kernel cannot run this attention ({what}): "
                "use 'auto' (torch picks a kernel that can), or 'unfused'",
            ) from err


class SelfAttention(McoreSelfAttention):
    """mcore's SelfAttention, with its fused QKV output split on a head axis: [s, b, groups, heads per group
    + 2, dim], query heads, then key, then value. mcore splits [s, b, groups, (heads per group + 2) * dim]
    and reshapes the query part; the values are the same, but in a compiled layer the gradient of that
    reshape came out as one integer division and remainder after another for every element (the kernel
    that assembles the QKV gradient ran at a tenth of memory speed).

    With fewer key/value heads than TP ranks (e.g. 2 KV heads at TP=4) each rank gathers the fused QKV
    output and keeps its group, as mcore does, but with a gather that also runs on CPU (mcore's allocates
    on `torch.cuda.current_device()`)."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if output_gate or not split_qkv:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        d = self.hidden_size_per_attention_head
        groups = self.config.num_query_groups
        if groups < self.world_size:
            # the fused rows are [q of the group's heads, k, v] per group: gather them all, keep this rank's group
            mixed_qkv = all_gather_last_dim(mixed_qkv, self.tp_group)
            ranks_per_group = self.world_size // groups
            rank = dist.get_rank(self.tp_group)
            size = mixed_qkv.size(-1) // groups
            group = rank // ranks_per_group
            mixed_qkv = mixed_qkv[..., group * size:(group + 1) * size]
            local_groups, per_group = 1, self.config.num_attention_heads // groups
        else:
            local_groups = self.num_query_groups_per_partition
            per_group = self.num_attention_heads_per_partition // local_groups
        s, b = mixed_qkv.shape[:2]
        heads = mixed_qkv.view(s, b, local_groups, per_group + 2, d)
        query = heads[:, :, :, :per_group].reshape(s, b, local_groups * per_group, d)
        key, value = heads[:, :, :, per_group], heads[:, :, :, per_group + 1]
        if groups < self.world_size:
            # of the group's query heads, this rank's share
            share = per_group // ranks_per_group
            start = (rank % ranks_per_group) * share
            query = query[:, :, start:start + share]
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value
