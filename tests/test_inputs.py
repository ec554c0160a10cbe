"""One HF -> Megatron input conversion per family: what it gives, and that the family's forward, the train
step's get_batch, log-probs (`forward_logits`) and generation all hand the model the same inputs.

The model is a recorder: these tests are about what reaches it, so no process group is needed."""

from types import SimpleNamespace

import pytest
import torch

from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.generation.generate import Decoder
from megatron_plugin.layers.masks import KNOWN
from megatron_plugin.models import FAMILIES
from megatron_plugin.models.bert import bert_forward, bert_inputs
from megatron_plugin.models.causal import causal_lm_inputs
from megatron_plugin.models.modeling import MegatronModel
from megatron_plugin.models.t5 import t5_forward, t5_inputs
from train_steps import BertTrainStep, GPTTrainStep, T5TrainStep

T, F = True, False


class Recorder:
    """Stands for the Megatron module: keeps the arguments of each call."""

    post_process = False  # an earlier pipeline stage: the steps hand its output on as it is

    def __init__(self, returns=None):
        self.calls = []
        self.returns = returns

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.returns


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _family_model(returns=None, variant="lm", **config):
    """Just what the family forwards read of a MegatronModel, on an earlier pipeline stage."""
    return SimpleNamespace(module=Recorder(returns), plan=SimpleNamespace(last=False), lm_head=True, variant=variant,
                           hf_config=SimpleNamespace(vocab_size=50, **config), family=FAMILIES["llama"])


# causal LMs ------------------------------------------------------------------------------------------------

def test_every_family_names_its_conversion():
    names = {t: fam.inputs for t, fam in FAMILIES.items()}
    for t in ("gpt2", "llama", "mistral", "qwen2", "qwen3"):
        assert names[t] is causal_lm_inputs, t
    assert names["bert"] is names["megatron-bert"] is bert_inputs
    assert names["t5"] is names["mt5"] is t5_inputs


def test_causal_right_padding():
    ids = torch.tensor([[5, 6, 7, 0]], dtype=torch.int32)
    tokens, positions, mask = causal_lm_inputs(ids, torch.tensor([[1, 1, 1, 0]]))
    assert tokens.dtype == torch.long and tokens.tolist() == [[5, 6, 7, 0]]
    assert positions.tolist() == [[0, 1, 2, 3]]
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[F, T, T, T],
                                   [F, F, T, T],
                                   [F, F, F, T],
                                   [F, F, F, T]]  # the padding key stays masked for the padding query too


def test_causal_left_padding_with_position_ids():
    ids = torch.tensor([[0, 5, 6, 7]])
    # HF's positions for a left-padded row; with a padding mask they are positions, not packing
    tokens, positions, mask = causal_lm_inputs(ids, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[1, 0, 1, 2]]))
    assert positions.tolist() == [[1, 0, 1, 2]]
    assert mask[0, 0].tolist() == [[T, T, T, T],  # a query that sees no key: SDPA gives zeros, as HF's does
                                   [T, F, T, T],
                                   [T, F, F, T],
                                   [T, F, F, F]]


def test_causal_packed_position_ids():
    ids = torch.arange(10).view(2, 5)
    tokens, positions, mask = causal_lm_inputs(ids, None, torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]))
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert mask[0, 0].tolist() == [[F, T, T, T, T],
                                   [F, F, T, T, T],
                                   [F, F, F, T, T],
                                   [F, F, F, F, T],
                                   [F, F, F, F, F]]
    assert mask[1, 0].tolist() == [[F, T, T, T, T],
                                   [F, F, T, T, T],
                                   [F, F, F, T, T],
                                   [T, T, T, F, T],  # the second sequence sees only itself
                                   [T, T, T, F, F]]


def test_causal_plain_batch_keeps_the_fused_kernels():
    tokens, positions, mask = causal_lm_inputs(torch.ones(3, 4, dtype=torch.long), torch.ones(3, 4))
    assert mask is None
    assert positions.tolist() == [[0, 1, 2, 3]] * 3
    # an offset is a start position, not packing
    assert causal_lm_inputs(torch.ones(1, 4), None, torch.tensor([[5, 6, 7, 8]])).attention_mask is None


def test_causal_mask_is_read_before_a_cast():
    # what the engine's batch check already knows about the position ids rides on the tensor it checked:
    # here, "not packed" on ids that would read as packed; a cast first would lose it and mask them apart
    given = torch.tensor([[0, 1, 0, 1]], dtype=torch.int32)
    setattr(given, KNOWN, True)
    tokens, positions, mask = causal_lm_inputs(torch.ones(1, 4), None, given)
    assert mask is None and positions.dtype == torch.long and positions.tolist() == [[0, 1, 0, 1]]


def test_causal_after_cached_positions():
    tokens, positions, mask = causal_lm_inputs(torch.tensor([[4], [9]]), past=5)
    assert positions.tolist() == [[5], [5]] and mask is None
    tokens, positions, mask = causal_lm_inputs(torch.tensor([[4, 9]]), past=3)
    assert positions.tolist() == [[3, 4]]
    assert mask[0, 0].tolist() == [[F, F, F, F, T], [F, F, F, F, F]]


CAUSAL_BATCHES = {
    "right": {"input_ids": torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]]),
              "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])},
    "left": {"input_ids": torch.tensor([[0, 4, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1, 1]]),
             "position_ids": torch.tensor([[1, 0, 1, 2]])},
    "packed": {"input_ids": torch.tensor([[3, 4, 5, 6]]), "position_ids": torch.tensor([[0, 1, 0, 1]])},
    "plain": {"input_ids": torch.tensor([[3, 4, 5, 6]])},
}


@pytest.mark.parametrize("name", sorted(CAUSAL_BATCHES))
def test_causal_forward_train_step_and_log_probs_agree(name):
    batch = CAUSAL_BATCHES[name]
    model = _family_model()
    MegatronModel.causal_lm_forward(model, batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
    (from_forward,) = model.module.calls
    assert len(from_forward) == 3

    step = GPTTrainStep(SimpleNamespace())
    tokens, labels, loss_mask, attention_mask, position_ids = step.get_batch(iter([batch]))
    for a, b in zip(from_forward, (tokens, position_ids, attention_mask)):
        assert _same(a, b), name

    logits_model = Recorder()
    step.forward_logits(batch, logits_model)
    (from_log_probs,) = logits_model.calls
    for a, b in zip(from_forward, from_log_probs):
        assert _same(a, b), name
    expected = causal_lm_inputs(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
    assert all(_same(a, b) for a, b in zip(from_forward, expected))
    assert (from_forward[2] is None) == (name == "plain")


def test_generation_feeds_the_family_conversion():
    fed = []

    class Stage:  # a Decoder's forward of one stage, recording what it is given
        model = SimpleNamespace(family=FAMILIES["llama"])

        def __call__(self, *inputs):
            fed.append(inputs)

    Decoder.run(Stage(), torch.tensor([[7], [8]]), past=6)  # a decode step: one token per row after 6 cached
    Decoder.run(Stage(), torch.tensor([[1, 2, 3]]))  # a prefill
    (tokens, positions, mask), (tokens2, positions2, mask2) = fed
    assert positions.tolist() == [[6], [6]] and mask is None
    assert positions2.tolist() == [[0, 1, 2]] and mask2 is None  # plain causal: the cache masks


# BERT ------------------------------------------------------------------------------------------------------

def test_bert_inputs():
    ids = torch.tensor([[101, 7, 102], [101, 8, 9]], dtype=torch.int32)
    types = torch.tensor([[0, 0, 1], [0, 1, 1]])
    x = bert_inputs(ids, torch.tensor([[1, 1, 0], [1, 1, 1]]), types)
    assert x.tokens.dtype == torch.long and x.tokens.tolist() == ids.tolist()
    assert x.padding_mask.shape == (2, 1, 1, 3)
    assert x.padding_mask[:, 0, 0].tolist() == [[F, F, T], [F, F, F]]  # both ways: padding only, no causal part
    assert x.token_types is types and x.position_ids is None
    assert bert_inputs(ids, torch.ones(2, 3)).padding_mask is None


def test_bert_forward_and_train_step_agree():
    batch = {"input_ids": torch.tensor([[101, 7, 102, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]]),
             "token_type_ids": torch.tensor([[0, 0, 1, 1]]), "labels": torch.tensor([[-100, 7, -100, -100]])}
    model = _family_model(returns=(None, None), variant="base")
    bert_forward(model, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    ((tokens, mask, types, labels, positions),) = model.module.calls

    step = BertTrainStep(SimpleNamespace(model_variant="mlm"))
    s_tokens, s_types, _, loss_mask, _, s_mask = step.get_batch(iter([batch]))
    assert _same(tokens, s_tokens) and _same(mask, s_mask) and _same(types, s_types)
    assert mask[0, 0, 0].tolist() == [F, F, F, T]

    logits_model = Recorder()
    step.forward_logits(batch, logits_model)
    ((l_tokens, l_mask),) = logits_model.calls
    assert _same(tokens, l_tokens) and _same(mask, l_mask)


# T5 --------------------------------------------------------------------------------------------------------

def test_t5_inputs():
    ids = torch.tensor([[4, 5, 1, 0]], dtype=torch.int32)
    x = t5_inputs(ids, torch.tensor([[1, 1, 1, 0]]), labels=torch.tensor([[8, 9, -100]]),
                  decoder_attention_mask=torch.tensor([[1, 1, 0]]), decoder_start_token_id=3, pad_token_id=2)
    assert x.encoder_ids.dtype == torch.long and x.decoder_ids.tolist() == [[3, 8, 9]]
    assert x.encoder_mask[0, 0, 0].tolist() == [F, F, F, T]
    assert x.cross_mask is x.encoder_mask  # decoder queries see the encoder's real tokens
    assert x.decoder_mask[0, 0].tolist() == [[F, T, T], [F, F, T], [F, F, T]]
    # -100 shifted into the decoder's inputs becomes the pad token, as HF's _shift_right does
    shifted = t5_inputs(ids, labels=torch.tensor([[8, -100, 9]]), decoder_start_token_id=0, pad_token_id=2)
    assert shifted.decoder_ids.tolist() == [[0, 8, 2]] and shifted.encoder_mask is None and shifted.decoder_mask is None
    given = t5_inputs(ids, decoder_input_ids=torch.tensor([[6, 7]]), labels=torch.tensor([[1, 2]]))
    assert given.decoder_ids.tolist() == [[6, 7]]  # given decoder inputs win over the labels
    with pytest.raises(MegatronPluginConfigError, match="decoder_input_ids"):
        t5_inputs(ids)


def test_t5_forward_and_train_step_agree():
    batch = {"input_ids": torch.tensor([[4, 5, 1, 0], [6, 1, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
             "labels": torch.tensor([[8, 9, 1], [7, 1, -100]]),
             "decoder_attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
    model = _family_model(variant="base", decoder_start_token_id=0, pad_token_id=0)
    t5_forward(model, batch["input_ids"], batch["attention_mask"],
               decoder_attention_mask=batch["decoder_attention_mask"], labels=batch["labels"])
    (from_forward,) = model.module.calls

    step = T5TrainStep(SimpleNamespace(decoder_start_token_id=0, pad_token_id=0))
    enc_ids, dec_ids, _, _, enc, dec, cross = step.get_batch(iter([batch]))
    for a, b in zip(from_forward, (enc_ids, dec_ids, enc, dec, cross)):
        assert _same(a, b)
    assert dec_ids.tolist() == [[0, 8, 9], [0, 7, 1]]  # the labels shifted right behind the start token

    logits_model = Recorder()
    step.forward_logits(batch, logits_model)
    (from_log_probs,) = logits_model.calls
    assert all(_same(a, b) for a, b in zip(from_forward, from_log_probs))
