"""Context parallelism through accelerator.prepare on CPU (gloo): the engine splits each sequence over the CP
ranks, and what comes back is what one rank holding the whole sequence gives. Training at CP=2 (and
CP=2 x TP=2) repeats CP=1's losses and weights step for step, with the mean and the per-token loss and padded
batches; log-probs, entropy and returned logits match HF over whole sequences; the GRPO and DPO gradients
match HF autograd of the same losses (so CP=1's, which tests/test_post_training.py holds to the same);
megatron_generate refuses CP > 1 with the fix."""

import os

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import grad_parity
from tests.spawn import run_on_ranks
from tests.test_post_training import (POLICY_CASES, SEQ, causal_batch, dpo_batch, hf_dpo_loss, hf_logps, hf_policy_loss,
                                      hf_token_log_probs, make_optimizer, policy_batch)
from tests.test_post_training import build as build_model
from tests.training import WARMUP, build, dataset, optimizer_for

STEPS = 20


def prepare(name, tp, micro=4, num_micro=1, step_class=None, step_kwargs=None, return_logits=False, **plugin_kwargs):
    """(accelerator, engine, optimizer, hf model) for a tiny model on this process's ranks, as
    tests/test_post_training.prepare (its loader only gives prepare the micro-batch size)."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    hf = build_model(name)
    plugin = MegatronLMPlugin(tp_degree=tp, num_micro_batches=num_micro, gradient_clipping=1.0,
                              return_logits=return_logits, **plugin_kwargs)
    if step_class is not None:
        plugin.custom_train_step_class = step_class
        plugin.custom_train_step_kwargs = step_kwargs or {}
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    opt = make_optimizer(hf.parameters())
    loader = DataLoader([{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * (micro * num_micro), batch_size=micro,
                        drop_last=True)
    model, opt, _ = accelerator.prepare(hf, opt, loader)
    return accelerator, model, opt, hf


def _train_worker(model_name, data, tp, cp, micro, num_micro, per_token, sequence_parallelism=False):
    """20 steps through prepare on a (tp, cp) layout; every rank returns its losses, rank 0 the HF weights."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    dp = int(os.environ["WORLD_SIZE"]) // (tp * cp)
    hf = build(model_name)
    rows = dataset(data, STEPS * micro * num_micro * dp, hf.config.vocab_size)
    opt = optimizer_for(hf)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=tp, context_parallel_size=cp, num_micro_batches=num_micro,
                              gradient_clipping=1.0, calculate_per_token_loss=per_token,
                              sequence_parallelism=sequence_parallelism)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model, opt, sched, loader = accelerator.prepare(hf, opt, sched, DataLoader(rows, batch_size=micro))
    model.train()
    losses = []
    for batch in loader:
        out = model(**batch)
        opt.step()
        sched.step()
        opt.zero_grad()
        assert not model.last_step_skipped
        losses.append(out.loss.item())
        if len(losses) == STEPS:
            break
    state = model.hf_state_dict()  # collective over TP
    rank0 = int(os.environ["RANK"]) == 0
    return losses, ({k: v.clone() for k, v in state.items()} if rank0 else None)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# (model, data, per-token loss, micro-batch rows, micro-batches): right-padded SFT rows (loss on the response
# only, padding at each row's end), plain LM rows; both loss kinds
TRAIN_CASES = {
    "llama_sft_mean": ("llama", "sft", False, 2, 2),
    "gpt2_lm_per_token": ("tied", "lm", True, 4, 1),
    "gpt2_sft_per_token": ("tied", "sft", True, 2, 2),
}
_reference = {}


def _cp1(case):
    """CP=1 on one process: the reference run (kept for the cases that compare against it)."""
    if case not in _reference:
        model_name, data, per_token, micro, num_micro = TRAIN_CASES[case]
        _reference[case] = run_on_ranks(_train_worker, 1, model_name, data, 1, 1, micro, num_micro, per_token)[0]
    return _reference[case]


def _assert_same_run(got, ref, where):
    (losses, state), (ref_losses, ref_state) = got, ref
    assert ref_losses[-1] < ref_losses[0], where  # the run learns, so equal losses mean something
    assert len(losses) == STEPS, where
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert _rel(a, b) < 1e-5, f"{where} step {step}: CP {a} vs CP=1 {b}"
    if state is not None:
        assert set(state) == set(ref_state), where
        for k in ref_state:
            # AdamW turns rounding into weight differences: an element whose gradient is near zero can take a
            # step of up to the learning rate either way (TP=2 alone ends 3e-5 of the largest weight from TP=1
            # here; CP=2 x DP=2, whose attention sums over keys in another order, 4e-4 on the embedding). A
            # wrong gradient weighting moves the losses, held above to 1e-5 (they agree to 1e-7), and the
            # gradients, held to HF's by the tests below
            rel = ((state[k] - ref_state[k]).abs().max() / ref_state[k].abs().max().clamp_min(1e-12)).item()
            assert rel < 1e-3, f"{where} {k}: {rel}"


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_cp2_trains_like_cp1(case):
    model_name, data, per_token, micro, num_micro = TRAIN_CASES[case]
    ref = _cp1(case)
    results = run_on_ranks(_train_worker, 2, model_name, data, 1, 2, micro, num_micro, per_token)
    assert results[1][0] == results[0][0], case  # both CP ranks log the same losses
    _assert_same_run(results[0], ref, case)


@pytest.mark.parametrize("sequence_parallelism", [False, True], ids=["tp2", "tp2_sp"])
def test_cp2_tp2_trains_like_cp1(sequence_parallelism):
    case = "llama_sft_mean"
    model_name, data, per_token, micro, num_micro = TRAIN_CASES[case]
    ref = _cp1(case)
    results = run_on_ranks(_train_worker, 4, model_name, data, 2, 2, micro, num_micro, per_token, sequence_parallelism)
    for rank, res in enumerate(results):
        _assert_same_run(res, ref, (case, "cp2 x tp2", sequence_parallelism, rank))


@pytest.mark.parametrize("case", ["llama_sft_mean", "gpt2_sft_per_token"])
def test_cp2_dp2_trains_like_dp2(case):
    """Gradients and logged losses reduced over DP x CP: CP=2 x DP=2 repeats DP=2's run (the same rows per
    data-parallel rank)."""
    model_name, data, per_token, micro, num_micro = TRAIN_CASES[case]
    ref = run_on_ranks(_train_worker, 2, model_name, data, 1, 1, micro, num_micro, per_token)[0]
    results = run_on_ranks(_train_worker, 4, model_name, data, 1, 2, micro, num_micro, per_token)
    for rank, res in enumerate(results):
        _assert_same_run(res, ref, (case, "cp2 x dp2", rank))


# -- log-probs, entropy and returned logits over whole sequences ----------------------------------------------
def _left_padded(batch):
    """The rows moved to the right end (left padding) with position ids counting from each row's first token,
    as HF's generation makes them."""
    mask = batch["attention_mask"]
    shift = (mask == 0).sum(-1)
    out = {}
    for k in ("input_ids", "attention_mask", "labels"):
        fill = -100 if k == "labels" else 0
        out[k] = torch.stack([torch.cat([torch.full((int(n),), fill, dtype=row.dtype), row[: row.numel() - int(n)]])
                              for row, n in zip(batch[k], shift)])
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp_min(0)
    return out


def _log_probs_worker(name, tp, num_micro):
    _, model, _, hf = prepare(name, tp, num_micro=num_micro, return_logits=True, context_parallel_size=2)
    out = {}
    right = causal_batch(hf.config.vocab_size)
    for kind, batch in (("right", right), ("left", _left_padded(right))):
        model.eval()
        with torch.no_grad():
            logits = model(**batch).logits
            ref_logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch.get("position_ids"), use_cache=False).logits
        model.train()
        token = batch["attention_mask"].bool()
        lp, ent = model.compute_log_probs(batch, temperature=0.7, entropy=True)
        with torch.no_grad():
            hf_batch = {k: v for k, v in batch.items() if k != "position_ids"}
            if "position_ids" in batch:  # HF's forward with the same position ids
                ref_lp, ref_ent = _token_log_probs_with_positions(hf, batch, 0.7)
            else:
                ref_lp, ref_ent = hf_token_log_probs(hf, hf_batch, 0.7)
        on = ref_lp != 0
        out[kind] = {
            "logits": (logits - ref_logits).abs()[token].max().item(),
            "logits_shape": tuple(logits.shape) == tuple(ref_logits.shape),
            "lp": (lp - ref_lp).abs().max().item(),
            "ent": (ent - ref_ent).abs()[on].max().item(),
            "scored": int(on.sum()),
            "zeros_where_no_label": bool((lp[~on] == 0).all()),
        }
    return out


def _token_log_probs_with_positions(hf, batch, temperature):
    from tests.test_post_training import token_log_probs

    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False).logits
    return token_log_probs(logits, batch, True, temperature)


@pytest.mark.parametrize("name,tp,num_micro", [("llama", 1, 2), ("tied", 1, 1), ("llama", 2, 1)])
def test_log_probs_and_logits_match_hf_under_cp2(name, tp, num_micro):
    for rank, res in enumerate(run_on_ranks(_log_probs_worker, 2 * tp, name, tp, num_micro)):
        for kind in ("right", "left"):
            r = res[kind]
            where = (name, tp, rank, kind, r)
            assert r["logits_shape"] and r["zeros_where_no_label"] and r["scored"] >= 8, where
            assert r["logits"] < 1e-4, where  # returned in sequence order, the whole sequence
            assert r["lp"] < 1e-5 and r["ent"] < 1e-5, where


# -- GRPO and DPO gradients ------------------------------------------------------------------------------------
def _engine_grads(engine, batch):
    """One step's gradients as the CPU engine reduces them (over DP x CP), before clipping: HF-named full
    tensors, and the first micro-batch's logs; the weights do not move."""
    step = engine.train_step_handler
    engine.train()
    micro_batches = engine.micro_batches(batch, step)
    assert engine.check_batch(batch, step, micro_batches)
    logs = engine.accumulate_gradients(micro_batches)
    grads = {k: v.clone() for k, v in engine.iter_hf_weights(grads=True)}
    for p in engine.model.parameters():
        p.grad = None
    return grads, logs


def _lm_worker(name, per_token, left):
    _, model, _, hf = prepare(name, 1, micro=2, num_micro=2, context_parallel_size=2, calculate_per_token_loss=per_token)
    batch = causal_batch(hf.config.vocab_size)
    if left:
        batch = _left_padded(batch)
    grads, logs = _engine_grads(model, batch)
    hf.zero_grad()

    def hf_loss(rows):
        return hf(**{k: v[rows] for k, v in batch.items()}, use_cache=False).loss

    halves = [slice(0, 2), slice(2, 4)]
    # the mean loss: each micro-batch's token mean, averaged; per-token: the mean over the whole batch's tokens
    ref = hf_loss(slice(0, 4)) if per_token else sum(hf_loss(h) for h in halves) / 2
    ref.backward()
    names, grad_max_rel = grad_parity(grads, hf, reached_only=True)
    logged = logs[0]["lm loss"]
    logged = (logged[0] / logged[1]).item() if logged.dim() else logged.item()
    with torch.no_grad():
        first = hf_loss(halves[0]).item()
    return {"names": names, "grad_max_rel": grad_max_rel, "loss": (logged, first)}


@pytest.mark.parametrize("name,per_token,left", [("llama", False, True), ("tied", True, False)])
def test_lm_gradients_under_cp2_match_hf_autograd(name, per_token, left):
    """The gradients themselves (an AdamW run hardly shows a gradient scaled by a constant)."""
    for rank, res in enumerate(run_on_ranks(_lm_worker, 2, name, per_token, left)):
        where = (name, per_token, left, rank, res)
        assert res["names"], where
        got, ref = res["loss"]
        assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), where
        assert res["grad_max_rel"] < 1e-4, where


def _policy_worker(name, case, per_token):
    from train_steps import PolicyGradientTrainStep

    kwargs = POLICY_CASES[case]
    _, model, _, hf = prepare(name, 1, num_micro=2, micro=2, step_class=PolicyGradientTrainStep, step_kwargs=kwargs,
                              context_parallel_size=2, calculate_per_token_loss=per_token)
    batch = policy_batch(hf, kwargs)
    grads, logs = _engine_grads(model, batch)
    hf.zero_grad()
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    # the engine's aggregation: over the global batch (per-token loss), or per micro-batch then averaged
    ref = hf_policy_loss(hf, batch, **kwargs) if per_token else sum(hf_policy_loss(hf, h, **kwargs) for h in halves) / 2
    ref.backward()
    names, grad_max_rel = grad_parity(grads, hf, reached_only=True)
    logged = logs[0]["loss"]
    with torch.no_grad():
        first = hf_policy_loss(hf, halves[0], **kwargs).item()
    logged = (logged[0] / logged[1]).item() if logged.dim() else logged.item()
    return {"names": names, "grad_max_rel": grad_max_rel, "loss": (logged, first)}


@pytest.mark.parametrize("case,per_token", [("kl_entropy_high", False), ("seq_mean", False), ("grpo", True)])
def test_policy_gradient_under_cp2_matches_hf_autograd(case, per_token):
    for rank, res in enumerate(run_on_ranks(_policy_worker, 2, "llama", case, per_token)):
        where = (case, per_token, rank, res)
        assert res["names"], where
        got, ref = res["loss"]
        assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), where  # the first micro-batch's logged loss
        assert res["grad_max_rel"] < 1e-4, where


def _dpo_worker(name, per_token):
    from train_steps import DPOTrainStep

    kwargs = dict(beta=0.5, label_smoothing=0.1)
    _, model, _, hf = prepare(name, 1, step_class=DPOTrainStep, step_kwargs=kwargs, context_parallel_size=2,
                              calculate_per_token_loss=per_token)
    # the rejected side cut to 8 tokens: the two sides differ in length (joined padded to 12), each a multiple of 2 x CP
    batch = {k: v[:, :8] if k.startswith("rejected") else v for k, v in dpo_batch(hf.config.vocab_size).items()}
    for side in ("chosen", "rejected"):  # the reference's summed log-probs, through CP's log-probs
        lp = model.compute_log_probs({k: batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")})
        batch[f"ref_{side}_logps"] = lp.sum(-1)
    with torch.no_grad():
        ref_c = hf_logps(hf, batch["chosen_input_ids"], batch["chosen_attention_mask"], batch["chosen_labels"])
        ref_r = hf_logps(hf, batch["rejected_input_ids"], batch["rejected_attention_mask"], batch["rejected_labels"])
    res = {"ref_logps": max((batch["ref_chosen_logps"] - ref_c).abs().max().item(),
                            (batch["ref_rejected_logps"] - ref_r).abs().max().item())}
    g = torch.Generator().manual_seed(3)
    batch["ref_chosen_logps"] = batch["ref_chosen_logps"] + torch.randn(4, generator=g)
    batch["ref_rejected_logps"] = batch["ref_rejected_logps"] + torch.randn(4, generator=g)
    grads, logs = _engine_grads(model, batch)
    hf.zero_grad()
    ref_loss = hf_dpo_loss(hf, batch, **kwargs)
    ref_loss.backward()
    names, grad_max_rel = grad_parity(grads, hf, reached_only=True)
    logged = logs[0]["loss"]
    logged = (logged[0] / logged[1]).item() if logged.dim() else logged.item()
    res.update(names=names, grad_max_rel=grad_max_rel, loss=(logged, ref_loss.item()))
    return res


@pytest.mark.parametrize("name,per_token", [("llama", False), ("tied", True)])
def test_dpo_under_cp2_matches_hf_autograd(name, per_token):
    for rank, res in enumerate(run_on_ranks(_dpo_worker, 2, name, per_token)):
        where = (name, per_token, rank, res)
        assert res["ref_logps"] < 1e-4, where
        assert res["names"], where
        got, ref = res["loss"]
        assert abs(got - ref) < 1e-5, where
        assert res["grad_max_rel"] < 1e-4, where


# -- generation -----------------------------------------------------------------------------------------------
def _generate_worker():
    from megatron_plugin.errors import MegatronPluginConfigError

    _, model, _, hf = prepare("llama", 1, context_parallel_size=2)
    try:
        model.megatron_generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=2)
    except MegatronPluginConfigError as e:
        return str(e)
    return None


def _odd_length_worker():
    from megatron_plugin.errors import MegatronPluginConfigError

    _, model, _, hf = prepare("llama", 1, context_parallel_size=2)
    batch = {k: v[:, :10] for k, v in causal_batch(hf.config.vocab_size).items()}  # 10: not a multiple of 4
    messages = []
    for call in (lambda: model(**batch), lambda: model.compute_log_probs(batch)):
        try:
            call()
            messages.append(None)
        except MegatronPluginConfigError as e:
            messages.append(str(e))
    return messages


def test_a_length_not_a_multiple_of_2cp_is_refused_on_every_rank():
    for messages in run_on_ranks(_odd_length_worker, 2):
        for m in messages:
            assert m is not None and "context_parallel_size" in m and "pad" in m, messages


def test_generate_under_cp2_says_to_use_a_cp1_layout():
    for message in run_on_ranks(_generate_worker, 2):
        assert message is not None and "context_parallel_size" in message and "context_parallel_size=1" in message, message
