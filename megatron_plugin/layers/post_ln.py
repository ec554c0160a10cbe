"""A post-LN transformer layer (HF `bert`): the norms come after the residual adds.

mcore's TransformerLayer normalizes before attention and MLP (pre-LN) and has no switch for the other
order. This subclass keeps mcore's attention, MLP and bias-dropout-add and puts two norms after them:
x -> LN(x + attn(x)) -> LN(h + mlp(h)). The spec gives it identity pre-norms and no final block norm.
"""

from __future__ import annotations

from megatron.core.transformer.transformer_layer import TransformerLayer

from .norm import Norm


class PostLNTransformerLayer(TransformerLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_attention_layernorm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_mlp_layernorm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        kwargs.pop("dynamic_inference_decode_only", None)
        hidden_states, context = self._forward_attention(*args, **kwargs)
        hidden_states = self.post_attention_layernorm(hidden_states)
        output = self._forward_mlp(hidden_states, kwargs.get("inference_context"), padding_mask=kwargs.get("padding_mask"))
        return self.post_mlp_layernorm(output), context
