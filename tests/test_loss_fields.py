"""The plugin's loss settings on CPU: calculate_per_token_loss (Megatron-LM's per-token loss: the loss and the
gradients of HF's mean over every labelled token of the global batch, over micro-batches and data-parallel
ranks) and eod_mask_loss (Megatron's loss mask at end-of-document tokens), against HF."""

import contextlib

import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, refusal
from tests.spawn import run_on_ranks
from tests.training import build, dataset

MICRO, NUM_MICRO, DP = 2, 2, 2
GLOBAL = MICRO * NUM_MICRO * DP
LR = 0.5  # plain SGD: the update is the gradient, large enough to see


def _stack(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


@contextlib.contextmanager
def _one_thread():
    """HF references on one thread, as the launched ranks run: the sums' order then does not depend on the
    machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _hf_step(model_name, rows):
    """HF on the whole global batch: (eval loss, train loss, gradients, weights after one SGD step)."""
    with _one_thread():
        return _hf_step_on(model_name, rows)


def _hf_step_on(model_name, rows):
    hf = build(model_name)
    batch = _stack(rows)
    with torch.no_grad():
        eval_loss = hf.eval()(**batch).loss.item()
    hf.train()
    opt = torch.optim.SGD(hf.parameters(), lr=LR)
    loss = hf(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    opt.step()
    return eval_loss, loss.item(), grads, {k: v.clone() for k, v in hf.state_dict().items()}


def _engine_step(model_name, data_name, per_token):
    """One rank of a DP=2 run with 2 micro-batches: (eval loss, train loss, gradients as the optimizer saw
    them, weights after the step), HF names."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    model = build(model_name)
    rows = dataset(data_name, GLOBAL, model.config.vocab_size)
    plugin = MegatronLMPlugin(num_micro_batches=NUM_MICRO, gradient_clipping=0.0, calculate_per_token_loss=per_token)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, _, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                            DataLoader(rows, batch_size=MICRO))
    batch = next(iter(loader))
    engine.eval()
    eval_loss = engine(**batch).loss.item()
    engine.train()
    grads = {}
    inner, real = engine.optimizer, engine.optimizer.step

    def spy(*args, **kwargs):  # the gradients after reduction (and clipping, off here), as the update uses them
        grads.update(engine.model.hf_state_dict(grads=True))
        return real(*args, **kwargs)

    inner.step = spy
    train_loss = engine(**batch).loss.item()
    return eval_loss, train_loss, grads, engine.model.hf_state_dict()


def _rel(a, b, floor=1e-12):
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def _flat(tensors, keys):
    return torch.cat([tensors[k].flatten() for k in keys])


@pytest.mark.parametrize("model_name,data_name", [("bert:mlm", "mlm"), ("tied", "sft"), ("t5_v1_1", "seq2seq")],
                         ids=["bert_mlm", "gpt2_sft", "t5"])
def test_per_token_loss_is_hf_loss_over_the_global_batch(model_name, data_name):
    rows = dataset(data_name, GLOBAL, build(model_name).config.vocab_size)
    labels = torch.stack([r["labels"] for r in rows])
    if data_name == "sft":
        labels = labels[:, 1:]  # the targets a causal LM scores
    counts = (labels != -100).sum(-1).view(DP * NUM_MICRO, MICRO).sum(-1)
    assert len(set(counts.tolist())) > 2, counts  # micro-batches (and ranks) with different label counts

    ref_eval, ref_train, ref_grads, ref_weights = _hf_step(model_name, rows)
    # the mean of the micro-batch means, what the default computes, differs from HF's global mean here
    means = [_hf_step(model_name, rows[i:i + MICRO])[0] for i in range(0, GLOBAL, MICRO)]
    assert abs(sum(means) / len(means) - ref_eval) > 1e-4, (means, ref_eval)  # > 10x the tolerance below

    initial = build(model_name).state_dict()
    for rank, (eval_loss, train_loss, grads, weights) in enumerate(
            run_on_ranks(_engine_step, DP, model_name, data_name, True)):
        where = (model_name, rank)
        assert abs(eval_loss - ref_eval) <= 1e-6 * abs(ref_eval), (where, eval_loss, ref_eval)
        assert abs(train_loss - ref_train) <= 1e-6 * abs(ref_train), (where, train_loss, ref_train)
        assert set(grads) == set(ref_grads), where
        keys = sorted(ref_grads)
        assert _rel(_flat(grads, keys), _flat(ref_grads, keys)) < 1e-6, where
        # each tensor on its own, relative to itself or, where the true gradient is 0 (attention key biases: a
        # softmax ignores a shift, both sides hold rounding noise of ~1e-11), to 1e-4 of the whole gradient
        floor = 1e-4 * _flat(ref_grads, keys).norm()
        worst = max(_rel(grads[k], ref_grads[k], floor) for k in keys)
        assert worst < 5e-6, (where, worst)
        for k, w in weights.items():
            assert _rel(w, ref_weights[k]) < 1e-6, (where, k)
        # the step moved the weights by far more than the tolerance
        assert max((weights[k] - initial[k]).abs().max().item() for k in weights) > 1e-2, where


def test_without_per_token_loss_the_step_averages_micro_batch_means():
    """The default (Megatron's too): each micro-batch's mean, averaged; the same batch as above."""
    rows = dataset("sft", GLOBAL, build("tied").config.vocab_size)
    means = [_hf_step("tied", rows[i:i + MICRO])[0] for i in range(0, GLOBAL, MICRO)]
    for eval_loss, train_loss, _, _ in run_on_ranks(_engine_step, DP, "tied", "sft", False):
        assert abs(eval_loss - sum(means) / len(means)) < 1e-5, (eval_loss, means)
        assert abs(train_loss - eval_loss) < 1e-6


def _policy_worker():
    """The policy-gradient step's token-mean under per-token loss equals the global token mean of the same
    per-token objective: compared through the reported loss at ratio 1 (old log-probs = the model's)."""
    from megatron_plugin import Accelerator, MegatronLMPlugin
    from train_steps import PolicyGradientTrainStep

    model = build("tied")
    rows = dataset("sft", GLOBAL, model.config.vocab_size)
    plugin = MegatronLMPlugin(num_micro_batches=NUM_MICRO, gradient_clipping=0.0, calculate_per_token_loss=True,
                              custom_train_step_class=PolicyGradientTrainStep)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, _, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                            DataLoader(rows, batch_size=MICRO))
    batch = next(iter(loader))
    g = torch.Generator().manual_seed(7)
    batch["old_log_probs"] = engine.compute_log_probs(batch)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=g)
    engine.train()
    out = engine(**batch)
    import torch.distributed as dist

    mask = batch["labels"].clone()
    mask[:, 0] = -100  # no position scores the first token
    mask = (mask != -100).float()
    # at ratio 1 the clipped objective is -A per token: its global token mean
    parts = torch.stack([(-batch["advantages"] * mask).sum(), mask.sum()])
    dist.all_reduce(parts)
    return out.loss.item(), (parts[0] / parts[1]).item(), out.metrics["clip fraction"].item()


def test_policy_gradient_token_mean_is_global_under_per_token_loss():
    for loss, expected, clipped in run_on_ranks(_policy_worker, DP):
        assert abs(loss - expected) < 1e-6, (loss, expected)
        assert clipped == 0.0


# -- eod_mask_loss --------------------------------------------------------------------------------------------
EOD = 0  # the tiny GPT-2's eos_token_id


def _eod_rows():
    """Token rows with end-of-document ids inside them (documents packed one after another)."""
    rows = dataset("lm", 4, 1000)
    for i, r in enumerate(rows):
        ids = r["input_ids"].masked_fill(r["input_ids"] == EOD, 7)  # no accidental document ends
        ids[3 + 2 * i] = EOD
        ids[11] = EOD
        r.update(input_ids=ids, labels=ids.clone())
    return rows


def _eod_worker(eod_mask_loss):
    from megatron_plugin import Accelerator, MegatronLMPlugin

    model = build("tied")
    plugin = MegatronLMPlugin(eod_mask_loss=eod_mask_loss, gradient_clipping=0.0)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, _, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                            DataLoader(_eod_rows(), batch_size=4))
    batch = next(iter(loader))
    engine.eval()
    eval_loss = engine(**batch).loss.item()
    engine.train()
    return eval_loss, engine(**batch).loss.item()


def test_eod_mask_loss_leaves_the_token_after_a_document_end_out():
    """Megatron's get_ltor_masks_and_position_ids: loss_mask[tokens == eod] = 0, i.e. no loss for what the model
    predicts at an end-of-document token (the next document's first token): HF's loss with those labels -100."""
    rows = _eod_rows()
    batch = _stack(rows)
    masked = batch["labels"].clone()
    masked[:, 1:][batch["input_ids"][:, :-1] == EOD] = -100
    # the other reading, no loss for predicting the end-of-document token itself, is not Megatron's
    other = batch["labels"].masked_fill(batch["input_ids"] == EOD, -100)
    hf = build("tied")
    with torch.no_grad(), _one_thread():
        expected, unmasked, not_megatron = (
            hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.item()
            for labels in (masked, batch["labels"], other))
    # the cases differ by more than 10x the tolerance (1e-6 relative, ~7e-6) of the comparisons
    assert abs(expected - unmasked) > 1e-4 and abs(expected - not_megatron) > 1e-4, (expected, unmasked, not_megatron)
    ((eval_loss, train_loss),) = run_on_ranks(_eod_worker, 1, True)
    assert abs(eval_loss - expected) < 1e-6 * expected and abs(train_loss - expected) < 1e-6 * expected
    ((eval_loss, _),) = run_on_ranks(_eod_worker, 1, False)
    assert abs(eval_loss - unmasked) < 1e-6 * unmasked


def test_eod_mask_loss_refusals():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model
    from tests.models import gpt2_config, tiny_bert

    plugin = MegatronLMPlugin(eod_mask_loss=True)
    check_refusal(refusal(check_model, plugin, gpt2_config(eos_token_id=None)), "eod_mask_loss", "eos_token_id")
    check_refusal(refusal(check_model, plugin, tiny_bert("bert", "mlm").config), "eod_mask_loss", "causal")
    assert refusal(check_model, plugin, gpt2_config()) is None


def test_per_token_loss_refuses_a_sentence_order_label():
    """BERT's next-sentence loss is a mean over sequences: no single per-token weighting gives HF's sum of the
    two means, so a batch carrying the label is refused under calculate_per_token_loss (the MLM alone runs)."""
    from types import SimpleNamespace

    from train_steps import BertTrainStep

    step = BertTrainStep(SimpleNamespace(model_variant="pretraining", calculate_per_token_loss=True))
    batch = _stack(dataset("mlm_nsp", 2, 333))
    check_refusal((step.check_batch(batch).setting, str(step.check_batch(batch))), "calculate_per_token_loss",
                  "next_sentence_label", "calculate_per_token_loss=False")
    del batch["next_sentence_label"]
    assert step.check_batch(batch) is None


def _mean_step_class():
    from train_steps import GPTTrainStep

    class MeanLossStep(GPTTrainStep):
        """A custom step written for the default: its loss function returns (mean, logs) whatever the setting."""

        def get_loss_func(self, *args, **kwargs):
            def loss_func(loss_mask, output_tensor):
                loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
                return loss, {"lm loss": loss.detach()}

            return loss_func

    return MeanLossStep


def _mean_step_worker():
    from megatron_plugin import Accelerator, MegatronLMPlugin

    model = build("tied")
    plugin = MegatronLMPlugin(calculate_per_token_loss=True, custom_train_step_class=_mean_step_class())
    engine, _, loader = Accelerator(megatron_lm_plugin=plugin).prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset("sft", 4, 1000), batch_size=4))
    before = {k: v.clone() for k, v in engine.model.hf_state_dict().items()}
    engine.train()
    got = refusal(engine, **next(iter(loader)))
    after = engine.model.hf_state_dict()
    return got, all(torch.equal(before[k], after[k]) for k in before)


def test_per_token_loss_refuses_a_loss_function_without_token_counts():
    """Under calculate_per_token_loss the engine divides gradients by the token count the loss function returns
    (Megatron-LM's (sum, count, logs)); a (mean, logs) one would be scaled wrong, so it is named instead."""
    ((got, untouched),) = run_on_ranks(_mean_step_worker, 1)
    check_refusal(got, "calculate_per_token_loss", "MeanLossStep", "(loss sum, token count, logs)")
    assert untouched


def _dpo_worker():
    from tests.test_post_training import dpo_batch, hf_dpo_loss, hf_logps, prepare
    from train_steps import DPOTrainStep

    kwargs = dict(beta=0.5, label_smoothing=0.1)
    _, model, _, hf = prepare("tied", 1, micro=2, num_micro=2, step_class=DPOTrainStep, step_kwargs=kwargs,
                              calculate_per_token_loss=True)
    batch = dpo_batch(hf.config.vocab_size)
    g = torch.Generator().manual_seed(3)
    for side in ("chosen", "rejected"):
        lp = model.compute_log_probs({k: batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")})
        batch[f"ref_{side}_logps"] = lp.sum(-1) + torch.randn(4, generator=g)
    with torch.no_grad():
        expected = hf_dpo_loss(hf, batch, **kwargs).item()
        margin = kwargs["beta"] * (
            (hf_logps(hf, *(batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")))
             - batch["ref_chosen_logps"])
            - (hf_logps(hf, *(batch[f"rejected_{k}"] for k in ("input_ids", "attention_mask", "labels")))
               - batch["ref_rejected_logps"]))
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    return ((out.loss.item(), expected), (out.metrics["reward margin"].item(), margin.mean().item()),
            (out.metrics["reward accuracy"].item(), (margin > 0).float().mean().item()))


def test_dpo_under_per_token_loss_averages_the_pairs_of_the_global_batch():
    ((loss, margin, accuracy),) = run_on_ranks(_dpo_worker, 1)
    assert abs(loss[0] - loss[1]) < 1e-5 * abs(loss[1]), loss
    assert abs(margin[0] - margin[1]) < 1e-5 * max(1.0, abs(margin[1])), margin
    assert accuracy[0] == accuracy[1] and 0 < accuracy[1] < 1, accuracy  # pairs both ways: the mean shows
