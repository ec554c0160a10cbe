"""Layer specs: which implementation fills each slot of a Megatron-Core transformer layer.

One place decides which modules fill the slots; the model code never branches on it.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from ..errors import MegatronPluginConfigError
from .attention import SDPAttention, SelfAttention
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import Norm


def local_layer_spec(qk_layernorm: bool = False) -> ModuleSpec:
    """Megatron-Core's local layer with our SDPA core attention and SP-capable norms."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=Norm if qk_layernorm else IdentityOp,
                    k_layernorm=Norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(config: TransformerConfig, num_local_layers: int, backend: str = "local") -> TransformerBlockSubmodules:
    """The decoder block: `num_local_layers` layers of the chosen backend and a final norm.

    Passing the block (not just the layer) keeps mcore from choosing its own final norm, which would be
    apex's or `WrappedTorchNorm` (no sequence parallelism).
    """
    if backend != "local":
        # TE's layers fuse the norms into the linears (other parameter names); the HF mapping tables
        # do not cover them yet, so loading HF weights would fail.
        raise MegatronPluginConfigError(
            "backend", backend, "only the 'local' spec (Megatron-Core layers + SDPA attention) is supported so far"
        )
    return TransformerBlockSubmodules(layer_specs=[local_layer_spec(config.qk_layernorm)] * num_local_layers, layer_norm=Norm)


def default_backend(device_type: str, requested: Optional[str] = None) -> str:
    return requested or "local"
