import torch

from megatron_plugin.errors import MegatronPluginConfigError


class AbstractTrainStep:
    """A train step supplies three functions to the engine:

    - `get_batch(data_iterator)`: the next micro-batch as Megatron inputs,
    - `forward_step(data_iterator, model) -> (output_tensor, loss_func_of(output_tensor))`,
    - `loss_func(..., output_tensor) -> (loss, {"name": data-parallel-averaged value})`; with the plugin's
      `calculate_per_token_loss` (megatron_args.calculate_per_token_loss), Megatron-LM's per-token contract
      instead: `(sum of the token losses, token count as an int tensor, {"name": [sum, count] summed over
      data-parallel ranks})` (`train_steps.utils.per_token_loss_result`, `sum_across_data_parallel_group`);
      the engines then divide the gradients and the logged sums by the global batch's count.

    Class attributes the engine reads: `input_key`, the batch key whose [rows, tokens] shape lays out
    the micro-batches; `loss_log_key`, the logged value returned as the output's `.loss` (None: the
    sum of the logged scalars, as accelerate does); `same_shape`, (key, like, what) rules: a batch
    tensor under `key` must have the shape of the one under `like` when both are given (`what` says
    what it holds, for the error).
    """

    model_output_class = None
    input_key = "input_ids"
    loss_log_key = None
    same_shape = ()

    def __init__(self, name):
        self.name = name

    def get_batch_func(self, *args, **kwargs):
        raise NotImplementedError

    def get_forward_step_func(self):
        raise NotImplementedError

    def get_loss_func(self, *args, **kwargs):
        raise NotImplementedError

    def count_loss_tokens(self, batch):
        """How many tokens of this (whole, local) batch carry a loss, as a tensor; None if unknown. The
        engine skips a step whose global batch has none, rather than stepping on a zero loss."""
        return None

    def check_shapes(self, batch):
        """An error for a tensor of the batch shaped unlike its `same_shape` partner, else None. The
        engine checks it for every batch, with a loss or without (log-probs read labels too), before
        `check_batch`, on every rank alike."""
        for key, like, what in self.same_shape:
            t, ref = batch.get(key), batch.get(like)
            if torch.is_tensor(t) and torch.is_tensor(ref) and t.shape != ref.shape:
                return MegatronPluginConfigError(f"batch[{key!r}]", tuple(t.shape),
                                                 f"pass {what}, shaped like {like} {tuple(ref.shape)}")
        return None

    def check_batch(self, batch):
        """An exception (MegatronPluginConfigError) for a batch this step cannot use, else None. Called on
        the whole local batch before any collective; every rank raises if one rank's batch is bad."""
        return None

    def before_sequence_split(self, micro_batch):
        """The micro-batch (a dict, whole sequences) with what must be computed over the whole sequence
        before context parallelism splits it along the sequence over the CP ranks, e.g. labels shifted to
        the position that predicts them (a shift crosses the chunks' edges). Called only when CP > 1; the
        split then cuts every [rows, sequence] tensor of the result (layers/context_parallel.shard_sequence)."""
        return micro_batch

    def schedule_shape(self, micro_batch):
        """(rows, tokens) of the activations one micro-batch sends between pipeline stages (under context
        parallelism the micro-batch is this CP rank's part: its tokens)."""
        rows, tokens = micro_batch[self.input_key].shape[:2]
        return rows, tokens

    def forward_logits(self, data, model):
        """Forward one micro-batch (a dict) without a loss, for `engine.compute_log_probs`. Returns
        (output, targets, shift): output is the logits [b, s, vocab / tp] on the last pipeline stage
        (hidden states on the others); targets [b, s] the token ids the logits at each position score
        (-100 where none); shift how many positions later that token sits in the sequence (1 for causal
        LMs, whose position t scores token t + 1; 0 for T5's decoder and BERT)."""
        raise NotImplementedError

    @classmethod
    def check_kwargs(cls, kwargs):
        """Raise for `custom_train_step_kwargs` this step rejects; runs at prepare, before any process group."""
