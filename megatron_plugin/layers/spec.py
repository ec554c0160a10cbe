"""Layer specs: which implementation fills each slot of a Megatron-Core transformer layer.

One place decides which modules fill the slots; the model code never branches on it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from ..errors import MegatronPluginConfigError
from .attention import SDPAttention, SelfAttention
from .linear import ColumnParallelLinear, DropoutInputRowParallelLinear, RowParallelLinear
from .moe import Experts, MoELayer, Router
from .norm import Norm
from .post_ln import PostLNTransformerLayer


def dense_mlp_spec(mlp_dropout: bool = False) -> ModuleSpec:
    """Megatron-Core's MLP on our linears: the MLP of every family so far.

    mlp_dropout: dropout between the MLP's activation and its second linear (T5).
    """
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                 linear_fc2=DropoutInputRowParallelLinear if mlp_dropout else RowParallelLinear),
    )


def moe_mlp_spec(config: Optional[TransformerConfig] = None) -> ModuleSpec:
    """The MoE layer (`layers/moe.py`): our MoELayer (megatron-core's, with a dispatcher that runs on gloo),
    our HF-exact `Router`, the routed experts as `Experts` (megatron-core's `SequentialMLP` parameters; grouped
    GEMMs on CUDA bf16) and, when `config.moe_shared_expert_intermediate_size` is set, megatron-core's
    `SharedExpertMLP` (with its sigmoid gate under `moe_shared_expert_gate`), all on our linears. Expert count,
    top-k and capacity come from the TransformerConfig (`num_moe_experts`, ...).
    """
    shared = None
    if config is None or config.moe_shared_expert_intermediate_size is not None:
        shared = ModuleSpec(module=SharedExpertMLP,
                            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(
                module=Experts,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            shared_experts=shared,
            router=Router,
        ),
    )


def local_layer_spec(qk_layernorm: bool = False, causal: bool = True, post_ln: bool = False,
                     cross_attention: bool = False, mlp_dropout: bool = False,
                     mlp: Optional[ModuleSpec] = None) -> ModuleSpec:
    """Megatron-Core's local layer with our SDPA core attention and SP-capable norms.

    causal: decoder self-attention (else bidirectional, padding masks only: BERT, T5's encoder).
    post_ln: norms after the residual adds (HF `bert`), in our PostLNTransformerLayer.
    cross_attention: a cross-attention block between self-attention and MLP (T5's decoder).
    mlp_dropout: dropout between the MLP's activation and its second linear (T5), in the dense MLP.
    mlp: the MLP slot's spec (e.g. `moe_mlp_spec()`); None means the dense MLP, `dense_mlp_spec(mlp_dropout)`.
    The slot is filled by a spec rather than a flag so that a new kind of MLP needs no change here.
    """
    if mlp is None:
        mlp = dense_mlp_spec(mlp_dropout)
    elif mlp_dropout:
        raise ValueError("mlp_dropout applies to the dense MLP only; put the dropout into the given mlp spec")
    pre_norm = IdentityOp if post_ln else Norm
    extra = {}
    if cross_attention:
        extra = dict(
            pre_cross_attn_layernorm=Norm,
            cross_attention=ModuleSpec(
                module=CrossAttention,
                params={"attn_mask_type": AttnMaskType.padding},
                submodules=CrossAttentionSubmodules(
                    linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                    core_attention=SDPAttention, linear_proj=RowParallelLinear,
                ),
            ),
            cross_attn_bda=get_bias_dropout_add,
        )
    return ModuleSpec(
        module=PostLNTransformerLayer if post_ln else TransformerLayer,
        submodules=TransformerLayerSubmodules(
            sharded_state_dict_keys_map=checkpoint_keys_map(post_ln, mlp),
            input_layernorm=pre_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal if causal else AttnMaskType.padding},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=Norm if qk_layernorm else IdentityOp,
                    k_layernorm=Norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            **extra,
            pre_mlp_layernorm=pre_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def checkpoint_keys_map(post_ln: bool, mlp: ModuleSpec) -> dict:
    """Checkpoint names (torch_dist) that Megatron-LM writes for the norms of a layer, as megatron-core's
    local GPT/BERT/T5 specs map them: Megatron-LM's default TE layers fuse the pre-attention norm into
    `linear_qkv` and the pre-MLP norm into `linear_fc1`, so its checkpoints (and NeMo, Bridge, verl) name
    them `...linear_qkv.layer_norm_weight` / `...linear_fc1.layer_norm_weight`. Post-LN layers have no norm
    before a linear to fuse, and an MoE layer keeps its pre-MLP norm apart (TE's MoE spec does too)."""
    if post_ln:
        return {}
    keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if mlp.module is MLP:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


def block_spec(config: TransformerConfig, num_local_layers: int, backend: str = "local", *, causal: bool = True,
               post_ln: bool = False, cross_attention: bool = False, mlp_dropout: bool = False,
               mlp: Union[None, ModuleSpec, Sequence[Optional[ModuleSpec]]] = None) -> TransformerBlockSubmodules:
    """A block: `num_local_layers` layers of the chosen backend and a final norm (none after post-LN layers).
    `mlp` fills every layer's MLP slot (see `local_layer_spec`; None: the dense MLP), or is a list with one
    spec (or None) per local layer: a model whose layers are partly MoE (Qwen2-MoE's `mlp_only_layers`).

    Passing the block (not just the layer) keeps mcore from choosing its own final norm, which would be
    apex's or `WrappedTorchNorm` (no sequence parallelism); mcore's T5 block specs drop it without TE.
    """
    if backend != "local":
        # TE's layers fuse the norms into the linears (other parameter names); the HF mapping tables
        # do not cover them yet, so loading HF weights would fail.
        raise MegatronPluginConfigError(
            "backend", backend, "only the 'local' spec (Megatron-Core layers + SDPA attention) is supported so far"
        )
    mlps: List[Optional[ModuleSpec]] = list(mlp) if isinstance(mlp, (list, tuple)) else [mlp] * num_local_layers
    if len(mlps) != num_local_layers:
        raise ValueError(f"block_spec got {len(mlps)} MLP specs for {num_local_layers} local layers")
    layers = [local_layer_spec(config.qk_layernorm, causal=causal, post_ln=post_ln, cross_attention=cross_attention,
                               mlp_dropout=mlp_dropout, mlp=m) for m in mlps]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=None if post_ln else Norm)


def default_backend(device_type: str, requested: Optional[str] = None) -> str:
    return requested or "local"
