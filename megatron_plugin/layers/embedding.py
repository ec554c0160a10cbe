"""The word embedding with its lookup's weight gradient accumulated straight into main_grad.

Under mcore's DDP the lookup's backward builds a dense [vocab, hidden] bf16 gradient (zeros, then the
token rows added), autograd adds it to the tied output layer's placeholder (itself zeros: mcore's
`zero_out_wgrad`), and DDP's hook adds the sum into the fp32 main_grad. At Llama-3's vocabulary of
128,256 that is about 5 GB of memory traffic per micro-batch for a gradient with one row per token.
Here the backward adds the token rows into main_grad (`index_put_` with accumulate: sorted, so the sum
is deterministic) and the hook has nothing left to add, as for the linears' fused weight gradients.

Only with `gradient_accumulation_fusion`: the tied output layer then puts its own gradient into
main_grad too, and marks the weight done (`grad_added_to_main_grad`), which tells the hook to skip it.

Under sequence parallelism the lookup's sum over TP ranks is a reduce-scatter along the sequence, through
`sp_comm` here (on CPU, mcore's own reduce-scatter reaches `sp_comm` through the `cpu_sequence_parallel` patch).

`padding_idx` is HF's `nn.Embedding(..., padding_idx=pad_token_id)` (Llama-family, BERT): the lookup gives the
pad row no gradient (a tied output layer still gives it its own). mcore's embedding has no such index, so the
output at pad positions is detached after the TP reduction, on every path: its gradient is then zero there,
which the lookup's backward (mcore's or ours into main_grad) turns into nothing added to the pad row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import VocabParallelEmbedding as _McoreVocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from .sp_comm import reduce_scatter_first_dim


class _LookupIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, placeholder: bool):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.placeholder = weight, placeholder
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        main_grad.index_put_((ids.reshape(-1),), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype), accumulate=True)
        weight.grad_added_to_main_grad = True
        # DDP's hook needs a gradient to fire (and mark the bucket ready); a tied output layer's placeholder
        # reaches the same parameter, so a second one would only cost an add of two [vocab, hidden] tensors
        return None, torch.empty_like(weight) if ctx.placeholder else None, None


def local_rows(ids: torch.Tensor, start: int, rows: int):
    """(this rank's row for each id, whether the id is another rank's). An id of another rank's rows looks up
    some row here whose output is then zeroed. mcore sends them all to row 0; then the backward's sorted
    `index_put_` adds (TP - 1) / TP of the tokens into that one row, one after another (5.5 ms a step at GPT-2
    774M, TP = 2, on an H200). The id's place in its own rank's part spreads them as the tokens themselves
    spread; the zeros added there change no sum."""
    local = ids - start
    return local.remainder(rows), (local < 0) | (local >= rows)


class VocabParallelEmbedding(_McoreVocabParallelEmbedding):
    """mcore's vocab-parallel embedding whose lookup gradient goes into main_grad (module docstring).
    The model sets `model_config` (its TransformerConfig) and `output_layer_shares_weight` (the output
    layer multiplies by this same weight in every forward that trains: a tied LM head on this stage)."""

    model_config = None
    output_layer_shares_weight = False
    padding_idx = None  # HF's: the vocabulary row whose lookups add no gradient (module docstring)

    def _into_main_grad(self) -> bool:
        w = self.weight
        return (self.model_config is not None and self.model_config.gradient_accumulation_fusion
                and torch.is_grad_enabled() and w.requires_grad and hasattr(w, "main_grad"))

    def forward(self, input_):
        out = super().forward(input_) if not self._into_main_grad() else self._lookup_into_main_grad(input_)
        if self.padding_idx is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return out
        hit = input_ == self.padding_idx
        if self.reduce_scatter_embeddings:
            # out is [s/tp, b, h]: this rank's equal part of the sequence (mcore's reduce-scatter split);
            # contiguous, or torch.where lays its output out as the transposed mask (MoE's dispatch views it)
            hit = hit.transpose(0, 1).chunk(self.tp_group.size(), dim=0)[self.tp_group.rank()].contiguous()
        # the reductions' backwards (identity, all-gather) carry the zero to every rank's lookup of that position
        return torch.where(hit.unsqueeze(-1), out.detach(), out)

    def _lookup_into_main_grad(self, input_):
        tp = self.tp_group.size()
        ids = input_
        if tp > 1:
            ids, outside = local_rows(input_, self.vocab_start_index, self.num_embeddings_per_partition)
        if self.output_layer_shares_weight:
            # the output layer's placeholder need not be zeros: nothing adds it (module docstring)
            self.weight.zero_out_wgrad = False
        out = _LookupIntoMainGrad.apply(ids, self.weight, not self.output_layer_shares_weight)
        if tp > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_first_dim(out.transpose(0, 1).contiguous(), self.tp_group)
        return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)


def use_our_word_embeddings(model, output_layer_shares_weight: bool) -> None:
    """Swap the class of a model's word embedding in place (mcore builds it outside the layer spec)."""
    if not getattr(model, "pre_process", False):
        return
    emb = model.embedding.word_embeddings
    emb.__class__ = VocabParallelEmbedding
    emb.model_config = model.config
    emb.output_layer_shares_weight = output_layer_shares_weight


def set_padding_idx(model, padding_idx) -> None:
    """Give a model's word embedding HF's `padding_idx` (None: every row's lookups train it); only the
    stage that holds the embedding has one."""
    if getattr(model, "pre_process", False) and isinstance(model.embedding.word_embeddings, VocabParallelEmbedding):
        model.embedding.word_embeddings.padding_idx = padding_idx
