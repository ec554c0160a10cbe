"""`Norm`: LayerNorm / RMSNorm that works with sequence parallelism. mcore's `WrappedTorchNorm` refuses
SP when TE and apex are absent; the only thing SP needs from a norm is that its parameters carry
`sequence_parallel=True`, so that their gradients (computed on a sequence shard) are all-reduced over
the TP group by mcore's `finalize_model_grads` (or by our CPU engine)."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """RMSNorm in HF's order of operations (Llama, Mistral, Qwen): normalize in fp32, cast back to the
    input dtype, then scale. torch.nn.RMSNorm scales before the cast, which differs in bf16."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Norm:
    """LayerNorm or RMSNorm (by `config.normalization`) whose parameters are marked for sequence
    parallelism. Same constructor as mcore's norms, so it fits any slot of a layer spec."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError("zero-centered gamma is not implemented by the plugin's Norm")
        device = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        kwargs = dict(eps=eps, device=device, dtype=config.params_dtype)
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, **kwargs)
        elif config.normalization == "RMSNorm":
            norm = RMSNorm(hidden_size, **kwargs)
        else:
            raise NotImplementedError(f"normalization={config.normalization!r} is not implemented")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
