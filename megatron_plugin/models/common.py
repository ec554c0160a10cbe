"""What every Megatron model class of ours adds to mcore's for HF parity and for running on CPU."""

from __future__ import annotations

import torch

from ..layers.cross_entropy import vocab_parallel_cross_entropy
from ..layers.linear import ColumnParallelLinear


def use_our_output_layer(layer) -> None:
    """mcore's models build their output layer outside the layer spec; ours only adds methods (CPU
    autocast, eager under compile with TP), so the module's class is swapped in place."""
    layer.__class__ = ColumnParallelLinear


class HFParityMixin:
    """For subclasses of mcore's LanguageModule (set `true_vocab_size`)."""

    true_vocab_size: int

    def compute_language_model_loss(self, labels, logits):
        """Per-token loss [b, s] from labels [b, s] and logits [s, b, local vocab]; the padded vocabulary
        rows stay out of the softmax (`cross_entropy.py`), so the loss equals HF's."""
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.true_vocab_size)
        return loss.transpose(0, 1).contiguous()

    def setup_embeddings_and_output_layer(self):
        # With tied embeddings split over pipeline stages, mcore fills the last stage's copy from the first
        # stage through CUDA (`weight.data.cuda()` + all-reduce). The HF weights fill both copies at load,
        # so on CPU that copy is skipped; the attributes mcore sets on the weights are kept.
        if torch.cuda.is_available():
            return super().setup_embeddings_and_output_layer()
        self._is_in_embd_group = lambda: False
        try:
            return super().setup_embeddings_and_output_layer()
        finally:
            del self._is_in_embd_group
