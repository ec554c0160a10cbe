"""The start of a step's gradients, without zeroing what the step's first weight-gradient GEMM overwrites.

mcore's DDP zeroes its whole fp32 gradient buffer each step (`zero_grad_buffer`), and with
`gradient_accumulation_fusion` the first weight-gradient GEMM of every linear then reads those zeros
back to add to them: at Llama-3.2-1B, 5 GB written and 5 GB read a step for nothing. Here the weights
whose gradient starts with a fused GEMM are marked `write_first` (layers/wgrad.py runs that GEMM with
beta=0: it writes) and only the rest of the buffer is zeroed: norms and biases (their gradients are added
by DDP's hook), embeddings reached only by lookups, the buckets' padding. The result is bit-identical:
zero plus a product is that product.
"""

from __future__ import annotations

from typing import List, Set

import torch

from ..layers.embedding import VocabParallelEmbedding
from ..layers.moe import Experts


def written_first_by_gemm(module: torch.nn.Module) -> Set[torch.nn.Parameter]:
    """The trainable weights whose every step starts with a fused weight-gradient GEMM: the parallel
    linears' own weights, and a word embedding tied to an output layer on the same stage (the output
    layer's backward runs before the lookup's, which only adds rows). None without
    gradient_accumulation_fusion: then every gradient is added by DDP's hook into a zeroed buffer.

    MoE experts' linears are left out: on CUDA in bf16 the experts run as grouped GEMMs over their stacked
    weights (layers/moe.Experts), which never reach the linears' fused GEMM, so their gradients come through
    DDP's hook, which adds: their buffer must start zeroed."""
    grouped = {id(p) for m in module.modules() if isinstance(m, Experts) for p in m.parameters()}
    found = set()
    for m in module.modules():
        if any(id(p) in grouped for p in m.parameters(recurse=False)):
            continue
        if isinstance(m, VocabParallelEmbedding):
            fused = m.model_config is not None and m.model_config.gradient_accumulation_fusion
            if fused and m.output_layer_shares_weight and m.weight.requires_grad:
                found.add(m.weight)
        elif getattr(m, "gradient_accumulation_fusion", False):
            w = getattr(m, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.requires_grad:
                found.add(w)
    return found


class GradBufferReset:
    """`DistributedDataParallel.zero_grad_buffer`, zeroing only the parts of the buffers that no GEMM
    writes first (module docstring); without gradient_accumulation_fusion that is all of them."""

    def __init__(self, ddp):
        self.ddp = ddp
        overwritten = written_first_by_gemm(ddp.module)
        self.marked: List[torch.Tensor] = []  # main_grads written whole by their first GEMM
        self.gaps: List[torch.Tensor] = []  # the rest of the buffers
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            spans = sorted(buffer.param_index_map[p][:2] for p in buffer.param_index_map if p in overwritten)
            self.marked += [p.main_grad for p in buffer.param_index_map if p in overwritten]
            start = 0
            for s, e in spans:
                if s > start:
                    self.gaps.append(buffer.grad_data[start:s])
                start = e
            if start < buffer.grad_data.numel():
                self.gaps.append(buffer.grad_data[start:])

    def reset(self) -> None:
        ddp = self.ddp
        if getattr(ddp.config, "cuda_graph_impl", "none") != "transformer_engine":  # as zero_grad_buffer
            for p in ddp.params_with_grad:
                p.grad_added_to_main_grad = False
        for g in self.marked:
            g.write_first = True
        if self.gaps:
            torch._foreach_zero_(self.gaps)
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group.reset()

    def zero_unwritten(self) -> None:
        """A marked weight that no GEMM reached this step (a module the forward skipped) would keep last
        step's gradient: zero it. Called before the gradients are reduced and used."""
        left = [g for g in self.marked if g.write_first]
        for g in left:
            g.write_first = False
        if left:
            torch._foreach_zero_(left)
