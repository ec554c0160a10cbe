"""Activation recompute with a frozen embedding (a LoRA run, or trainable_flags freezing it).

megatron-core recomputes through `tensor_parallel.checkpoint`, a reentrant autograd.Function whose output requires
grad only if an input does: full recompute (whole layers), and selective recompute (core attention by default, but
`recompute_modules` in other_megatron_args may add the MLP, MoE or shared experts). With the embedding frozen no
input of the first stage's checkpointed blocks requires grad, so the parameters inside (LoRA adapters, trainable
layers) would get no gradient. As HF's `enable_input_require_grads`, the embedding's output is made to require
grad; later pipeline stages receive activations that already do.
"""

from __future__ import annotations

import torch


def _output_requires_grad(module, args, output):
    # a frozen embedding's output is a leaf without grad; a trainable one already has it
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def recompute_needs_input_grad(plugin) -> bool:
    """Whether the run recomputes through megatron-core's reentrant checkpoint (full or selective)."""
    return plugin.recompute_granularity is not None


def embedding_output_requires_grad(chunk) -> bool:
    """Hook the chunk's embedding (first stage) so its output requires grad; whether the chunk holds one."""
    embedding = getattr(chunk.module, "embedding", None)
    if embedding is None:
        return False
    embedding.register_forward_hook(_output_requires_grad)
    return True


def hook_embeddings_for_recompute(chunks, plugin) -> None:
    """What `build` does for every run: the hook when recompute is on (otherwise it would only add a backward
    through the first layer's frozen ops)."""
    if recompute_needs_input_grad(plugin):
        for chunk in chunks:
            embedding_output_requires_grad(chunk)
