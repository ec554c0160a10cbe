class AbstractTrainStep:
    """A train step supplies three functions to the engine:

    - `get_batch(data_iterator)`: the next micro-batch as Megatron inputs,
    - `forward_step(data_iterator, model) -> (output_tensor, loss_func_of(output_tensor))`,
    - `loss_func(..., output_tensor) -> (loss, {"name": data-parallel-averaged value})`.
    """

    model_output_class = None

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
