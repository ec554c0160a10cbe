"""Layer specs: which implementation fills each slot of a Megatron-Core transformer layer.

One place decides TE versus local modules; the model code never branches on it.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from .layers import Norm, SDPAttention


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


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
    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer, final_norm = get_gpt_layer_with_transformer_engine_spec(), TENorm
    elif backend == "local":
        layer, final_norm = local_layer_spec(), Norm
    else:
        raise ValueError(f"backend={backend!r}: use 'local' or 'te'")
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=final_norm)


def default_backend(device_type: str, requested: Optional[str] = None) -> str:
    if requested is not None:
        return requested
    return "te" if device_type == "cuda" and transformer_engine_available() else "local"
