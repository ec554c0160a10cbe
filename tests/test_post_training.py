"""Post-training on CPU under TP = 1, 2: per-token log-probs and entropy against HF's log_softmax, the
gradients of the policy-gradient and DPO losses against HF autograd of the same losses, offload/reload
bit for bit, weights streamed out after training, and the errors for bad batches."""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.errors import expecter
from tests.models import grad_parity, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from tests.spawn import run_on_ranks

SEQ = 12


def build(name):
    if name.startswith("t5"):
        return tiny_t5(name)
    if name in ("bert", "megatron_bert"):
        return tiny_bert(name, "mlm")
    return tiny_gpt2(name) if name in ("tied", "untied") else tiny_llama(name)


def make_optimizer(params, kind="adamw"):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)


def prepare(name, tp, micro=4, num_micro=1, step_class=None, step_kwargs=None, hf=None, return_logits=False,
            optimizer="adamw", mixed_precision=None, **plugin_kwargs):
    """(accelerator, engine, optimizer, hf model) for a tiny model on this process's ranks; `plugin_kwargs`
    (pp_degree, sequence_parallelism, ...) go to the plugin."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    hf = hf if hf is not None else build(name)
    plugin = MegatronLMPlugin(tp_degree=tp, num_micro_batches=num_micro, gradient_clipping=1.0,
                              return_logits=return_logits, **plugin_kwargs)
    if step_class is not None:
        plugin.custom_train_step_class = step_class
        plugin.custom_train_step_kwargs = step_kwargs or {}
    accelerator = Accelerator(megatron_lm_plugin=plugin, mixed_precision=mixed_precision)
    opt = make_optimizer(hf.parameters(), optimizer)
    loader = DataLoader([{"input_ids": torch.zeros(SEQ, dtype=torch.long)}] * (micro * num_micro), batch_size=micro)
    model, opt, _ = accelerator.prepare(hf, opt, loader)
    return accelerator, model, opt, hf


def causal_batch(vocab, rows=4, seed=1):
    """Prompt + response rows, right-padded: labels are the response tokens (-100 on prompt and padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, SEQ), generator=g)
    lengths = torch.tensor([SEQ, SEQ - 3, SEQ - 1, SEQ - 5][:rows])
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # the prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hf_logits(hf, batch):
    if hf.config.model_type == "t5":
        return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                  decoder_attention_mask=batch.get("decoder_attention_mask")).logits
    if "bert" in hf.config.model_type:
        return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  token_type_ids=batch.get("token_type_ids")).logits
    return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits


def token_log_probs(logits, batch, causal, temperature=1.0):
    """Token-aligned log p(token t) and the entropy of the distribution scoring it, from log_softmax of
    full logits; 0 where nothing scores a token."""
    targets = batch["labels"]
    if causal:
        logits, targets = logits[:, :-1], targets[:, 1:]
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    on = targets != -100
    lp = lsm.gather(-1, targets.clamp_min(0)[..., None])[..., 0] * on
    ent = -(lsm.exp() * lsm).sum(-1)
    if causal:
        zero = lp.new_zeros(lp.shape[0], 1)
        lp, ent = torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)
    return lp, ent


def is_causal(hf):
    return hf.config.model_type != "t5" and "bert" not in hf.config.model_type


def hf_token_log_probs(hf, batch, temperature=1.0):
    """HF's reference: log_softmax of HF's logits."""
    return token_log_probs(hf_logits(hf, batch), batch, is_causal(hf), temperature)


def _batch_for(name, vocab):
    if name.startswith("t5"):
        from tests.training import seq2seq_dataset
        rows = seq2seq_dataset(4, vocab)
    elif "bert" in name:
        from tests.training import mlm_dataset
        rows = mlm_dataset(4, vocab)
    else:
        return causal_batch(vocab)
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# -- log-probs and entropy --------------------------------------------------------------------------
def _log_probs_worker(name, num_micro):
    tp = int(os.environ["WORLD_SIZE"])
    _, model, _, hf = prepare(name, tp, num_micro=num_micro, return_logits=True)
    batch = _batch_for(name, hf.config.vocab_size)
    out = {}
    model.eval()
    with torch.no_grad():
        own_logits = model(**batch).logits  # gathered over TP: the plain log_softmax of our own logits
    model.train()
    for temperature in (1.0, 0.7):
        lp, ent = model.compute_log_probs(batch, temperature=temperature, entropy=True)
        own_lp, own_ent = token_log_probs(own_logits, batch, is_causal(hf), temperature)
        only = model.compute_log_probs(batch, temperature=temperature)
        with torch.no_grad():
            ref_lp, ref_ent = hf_token_log_probs(hf, batch, temperature)
        # entropy is compared where a token is scored (HF's logits at padded decoder positions differ in
        # what they see, and nobody reads them)
        on = ref_lp != 0
        out[temperature] = {
            "shape": tuple(lp.shape) == tuple(ref_lp.shape),
            "lp": (lp - ref_lp).abs().max().item(),
            "lp_scale": ref_lp.abs().max().item(),
            "own_lp": (lp - own_lp).abs().max().item(),
            "own_ent": (ent - own_ent).abs()[on].max().item(),
            "ent": (ent - ref_ent).abs()[on].max().item(),
            "same": torch.equal(only, lp),
            "zeros_where_no_label": bool((lp[~on] == 0).all()),
            "scored": int(on.sum()),
        }
    out["training_after"] = model.training
    return out


@pytest.mark.parametrize("name,world,num_micro", [
    ("llama", 1, 2), ("llama", 2, 2), ("tied", 2, 1), ("qwen3", 2, 1), ("t5_v1_1", 2, 2), ("bert", 2, 1),
])
def test_log_probs_and_entropy_match_hf(name, world, num_micro):
    for rank, res in enumerate(run_on_ranks(_log_probs_worker, world, name, num_micro)):
        assert res["training_after"], "compute_log_probs leaves the model in the mode it found it"
        for temperature in (1.0, 0.7):
            r = res[temperature]
            where = (name, world, rank, temperature, r)
            assert r["shape"] and r["same"] and r["zeros_where_no_label"], where
            assert r["scored"] >= 8, where
            # fp32 rounding grows with the size of the logits (T5 v1.1's, unscaled, reach log-probs of -50)
            scale = max(1.0, r["lp_scale"])
            # vocab-parallel reductions vs log_softmax of the same logits gathered: rounding only
            assert r["own_lp"] < 1e-6 * scale and r["own_ent"] < 1e-6 * scale, where
            # vs HF's log_softmax of HF's logits
            assert r["lp"] < 1e-5 * scale and r["ent"] < 1e-5 * scale, where


# -- policy-gradient loss: gradients against HF autograd ----------------------------------------------
POLICY_CASES = {
    "grpo": dict(clip_range=0.2),
    "kl_entropy_high": dict(clip_range=0.1, clip_range_high=0.3, kl_coef=0.05, entropy_coef=0.01, temperature=0.8),
    "seq_mean": dict(clip_range=0.2, loss_aggregation="seq-mean-token-mean", kl_coef=0.1),
    "seq_sum": dict(clip_range=0.2, loss_aggregation="seq-mean-token-sum"),
}


def policy_batch(hf, kwargs, seed=5):
    batch = causal_batch(hf.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp, _ = hf_token_log_probs(hf, batch, kwargs.get("temperature", 1.0))
    on = batch["labels"] != -100
    # a sampling policy a little off the current one, so some ratios leave the clip range
    batch["old_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * on
    batch["ref_log_probs"] = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * on
    batch["advantages"] = torch.randn(lp.shape[0], generator=g)  # one per sequence, as GRPO's
    return batch


def hf_policy_loss(hf, batch, clip_range=0.2, clip_range_high=None, kl_coef=0.0, entropy_coef=0.0, temperature=1.0,
                   loss_aggregation="token-mean"):
    """The same loss written plainly on the HF model (the reference)."""
    high = clip_range if clip_range_high is None else clip_range_high
    lp, ent = hf_token_log_probs(hf, batch, temperature)
    mask = (batch["labels"] != -100).float()
    ratio = torch.exp((lp - batch["old_log_probs"]) * mask)
    adv = batch["advantages"][:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + high))
    if kl_coef:
        d = (batch["ref_log_probs"] - lp) * mask
        per_token = per_token + kl_coef * (d.exp() - d - 1)
    if entropy_coef:
        per_token = per_token - entropy_coef * ent
    if loss_aggregation == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    per_seq = (per_token * mask).sum(-1)
    if loss_aggregation == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1)
    return per_seq.mean()


def _engine_grads(model, batch):
    """Gradients of one step's loss (data-parallel reduced), as HF-named full tensors, without stepping."""
    engine = model  # what prepare returned for the HF model
    step = engine.train_step_handler
    engine.train()
    for p in engine.model.parameters():
        p.grad = None
    micro_batches = engine.micro_batches(batch, step)
    assert engine.check_batch(batch, step)
    logs = []
    for mb in micro_batches:
        _, (loss, log) = engine.forward_micro_batch(mb)
        (loss / len(micro_batches)).backward()
        logs.append(log)
    engine.reduce_gradients()
    grads = dict(engine.iter_hf_weights(grads=True))
    for p in engine.model.parameters():
        p.grad = None
    return grads, logs


def _policy_grads_worker(name, case):
    from train_steps import PolicyGradientTrainStep

    tp = int(os.environ["WORLD_SIZE"])
    kwargs = POLICY_CASES[case]
    _, model, _, hf = prepare(name, tp, step_class=PolicyGradientTrainStep, step_kwargs=kwargs)
    batch = policy_batch(hf, kwargs)
    grads, logs = _engine_grads(model, batch)
    hf.zero_grad()
    ref_loss = hf_policy_loss(hf, batch, **kwargs)
    ref_loss.backward()
    names, grad_max_rel = grad_parity(grads, hf, reached_only=True)
    return {
        "names": names,
        "loss": (logs[0]["loss"].item(), ref_loss.item()),
        "clip fraction": logs[0]["clip fraction"].item(),
        "grad_max_rel": grad_max_rel,
    }


@pytest.mark.parametrize("name,world,case", [
    ("llama", 1, "grpo"), ("llama", 2, "kl_entropy_high"), ("tied", 2, "seq_mean"), ("qwen2", 2, "seq_sum"),
])
def test_policy_gradient_matches_hf_autograd(name, world, case):
    for rank, res in enumerate(run_on_ranks(_policy_grads_worker, world, name, case)):
        where = (name, world, case, rank, res)
        assert res["names"], where
        got, ref = res["loss"]
        assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), where
        assert 0.0 < res["clip fraction"] < 1.0, where  # the batch exercises the clipping
        assert res["grad_max_rel"] < 1e-4, where


# -- DPO ------------------------------------------------------------------------------------------------
def dpo_batch(vocab, seed=7):
    """Pairs that share a prompt, each side padded on its own (the rejected side is shorter)."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt = 4, 4
    chosen = causal_batch(vocab, seed=seed)
    rej_ids = torch.randint(3, vocab, (rows, SEQ - 2), generator=g)
    rej_ids[:, :prompt] = chosen["input_ids"][:, :prompt]
    rej_mask = torch.ones_like(rej_ids)
    rej_mask[1, 7:] = 0
    rej_ids = rej_ids.masked_fill(rej_mask == 0, 0)
    rej_labels = rej_ids.masked_fill(rej_mask == 0, -100)
    rej_labels[:, :prompt] = -100
    chosen["labels"][:, :prompt] = -100
    return {"chosen_input_ids": chosen["input_ids"], "chosen_attention_mask": chosen["attention_mask"],
            "chosen_labels": chosen["labels"], "rejected_input_ids": rej_ids, "rejected_attention_mask": rej_mask,
            "rejected_labels": rej_labels}


def hf_logps(hf, ids, mask, labels):
    lp, _ = hf_token_log_probs(hf, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    return lp.sum(-1)


def hf_dpo_loss(hf, batch, beta, label_smoothing=0.0):
    c = hf_logps(hf, batch["chosen_input_ids"], batch["chosen_attention_mask"], batch["chosen_labels"])
    r = hf_logps(hf, batch["rejected_input_ids"], batch["rejected_attention_mask"], batch["rejected_labels"])
    m = beta * ((c - batch["ref_chosen_logps"]) - (r - batch["ref_rejected_logps"]))
    return (-(1 - label_smoothing) * F.logsigmoid(m) - label_smoothing * F.logsigmoid(-m)).mean()


def _dpo_worker(name):
    from train_steps import DPOTrainStep

    tp = int(os.environ["WORLD_SIZE"])
    kwargs = dict(beta=0.5, label_smoothing=0.1)
    _, model, _, hf = prepare(name, tp, step_class=DPOTrainStep, step_kwargs=kwargs)
    batch = dpo_batch(hf.config.vocab_size)
    # reference log-probs from the model itself, as a user computes them before training
    for side in ("chosen", "rejected"):
        lp = model.compute_log_probs({k: batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")})
        batch[f"ref_{side}_logps"] = lp.sum(-1)
    with torch.no_grad():
        ref_c = hf_logps(hf, batch["chosen_input_ids"], batch["chosen_attention_mask"], batch["chosen_labels"])
    res = {"ref_logps": (batch["ref_chosen_logps"] - ref_c).abs().max().item()}
    # identical policy and reference: margin 0, loss log 2
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    res["identical_loss"] = out.loss.item()
    res["identical_accuracy"] = out.metrics["reward accuracy"].item()
    # a reference that differs, so the gradient is not the symmetric one
    g = torch.Generator().manual_seed(3)
    batch["ref_chosen_logps"] = batch["ref_chosen_logps"] + torch.randn(4, generator=g)
    batch["ref_rejected_logps"] = batch["ref_rejected_logps"] + torch.randn(4, generator=g)
    grads, logs = _engine_grads(model, batch)
    hf.zero_grad()
    ref_loss = hf_dpo_loss(hf, batch, **kwargs)
    ref_loss.backward()
    names, grad_max_rel = grad_parity(grads, hf, reached_only=True)
    res.update(names=names, loss=(logs[0]["loss"].item(), ref_loss.item()), grad_max_rel=grad_max_rel)
    return res


@pytest.mark.parametrize("name,world", [("llama", 1), ("tied", 2)])
def test_dpo_matches_hf_autograd_and_is_log2_against_itself(name, world):
    import math

    for rank, res in enumerate(run_on_ranks(_dpo_worker, world, name)):
        where = (name, world, rank, res)
        assert res["ref_logps"] < 1e-4, where
        assert abs(res["identical_loss"] - math.log(2)) < 1e-6, where
        assert res["identical_accuracy"] == 0.0, where  # no pair is preferred when the rewards are equal
        assert res["names"], where
        got, ref = res["loss"]
        assert abs(got - ref) < 1e-5, where
        assert res["grad_max_rel"] < 1e-4, where


# -- training: offload/reload bit for bit, weights streamed out -----------------------------------------
def _policy_train_worker(name, steps, offload_between, optimizer="adamw", layout=None):
    """On-policy GRPO-style steps: log-probs of the current policy, advantages per sequence, one update.
    With `offload_between`, everything goes to host memory and back between the steps. `layout`: prepare's
    keyword arguments (default: TP over every rank)."""
    from train_steps import PolicyGradientTrainStep

    layout = dict(layout or {})
    tp = layout.pop("tp", int(os.environ["WORLD_SIZE"]))
    kwargs = dict(clip_range=0.2, kl_coef=0.05)
    accelerator, model, opt, hf = prepare(name, tp, num_micro=2, micro=2, step_class=PolicyGradientTrainStep,
                                          step_kwargs=kwargs, optimizer=optimizer, **layout)
    ref_model_lp = None
    losses, checks = [], []
    for step in range(steps):
        batch = causal_batch(hf.config.vocab_size, seed=10 + step)
        batch["old_log_probs"] = model.compute_log_probs(batch)
        if ref_model_lp is None:
            ref_model_lp = batch["old_log_probs"]
        batch["ref_log_probs"] = ref_model_lp
        batch["advantages"] = torch.linspace(-1, 1, 4) * (1 + step)
        model.train()
        out = model(**batch)
        opt.step()
        opt.zero_grad()
        losses.append((out.loss.item(), out.metrics["pg loss"].item(), out.metrics["kl"].item()))
        memory = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if offload_between:
            moved = accelerator.offload()
            engine = model  # what prepare returned for the HF model
            freed = all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
            if torch.cuda.is_available():  # the device memory is given back, not just the tensors emptied
                freed = freed and memory - torch.cuda.memory_allocated() >= 0.9 * sum(moved.values())
            try:
                model(**batch)
                refused = False
            except Exception as e:
                refused = "reload" in str(e)
            accelerator.reload()
            checks.append((moved["params"] > 0 and moved["optimizer"] > 0, freed, refused, engine.is_offloaded))
    streamed = {k: v.detach().cpu().clone() for k, v in model.iter_hf_weights()}
    state = accelerator.get_state_dict(model)
    same = set(streamed) == set(state) and all(torch.equal(streamed[k], state[k].cpu()) for k in state)
    return {"losses": losses, "checks": checks, "streamed": streamed, "stream_equals_state_dict": same}


def hf_policy_train(name, steps, optimizer="adamw"):
    """The same loop in plain HF + torch."""
    hf = build(name).train()
    opt = make_optimizer(hf.parameters(), optimizer)
    ref_model_lp, losses = None, []
    for step in range(steps):
        batch = causal_batch(hf.config.vocab_size, seed=10 + step)
        with torch.no_grad():
            batch["old_log_probs"], _ = hf_token_log_probs(hf, batch)
        if ref_model_lp is None:
            ref_model_lp = batch["old_log_probs"]
        batch["ref_log_probs"] = ref_model_lp
        batch["advantages"] = torch.linspace(-1, 1, 4) * (1 + step)
        # two micro-batches of two rows, each token-averaged, then averaged (what the step computes)
        loss = sum(hf_policy_loss(hf, {k: v[i:i + 2] for k, v in batch.items()}, kl_coef=0.05) for i in (0, 2)) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in hf.state_dict().items()}


STEPS = 10


def test_offload_reload_between_steps_is_bit_identical_and_trains_like_hf():
    plain = run_on_ranks(_policy_train_worker, 2, "llama", STEPS, False)
    parked = run_on_ranks(_policy_train_worker, 2, "llama", STEPS, True)
    ref_losses, _ = hf_policy_train("llama", STEPS)
    for rank in range(2):
        a, b = plain[rank], parked[rank]
        assert a["losses"] == b["losses"], rank  # bit for bit
        assert all(torch.equal(a["streamed"][k], b["streamed"][k]) for k in a["streamed"]), rank
        assert b["checks"] == [(True, True, True, False)] * STEPS, b["checks"]
        assert a["stream_equals_state_dict"] and b["stream_equals_state_dict"], rank
        for step, ((loss, _, _), ref) in enumerate(zip(a["losses"], ref_losses)):
            assert abs(loss - ref) <= 1e-4 * max(1.0, abs(ref)), (step, loss, ref)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # the steps moved the model


@pytest.mark.parametrize("name", ["tied", "qwen3"])
def test_streamed_weights_after_policy_training_match_hf(name):
    """Weights streamed out of the TP=2 model after training equal get_state_dict bit for bit and HF's
    weights after the same loop. (SGD: Adam's first step on a row whose gradient is ~0 takes the sign of
    rounding noise, which would hide what this compares.)"""
    got = run_on_ranks(_policy_train_worker, 2, name, 6, False, "sgd")
    ref_losses, ref_state = hf_policy_train(name, 6, "sgd")
    start = build(name).state_dict()
    for rank in range(2):
        res = got[rank]
        assert res["stream_equals_state_dict"], rank
        for step, ((loss, _, _), ref) in enumerate(zip(res["losses"], ref_losses)):
            assert abs(loss - ref) <= 1e-4 * max(1.0, abs(ref)), (step, loss, ref)
        tied = "lm_head.weight" in ref_state and "lm_head.weight" not in res["streamed"]
        assert set(res["streamed"]) == set(ref_state) - ({"lm_head.weight"} if tied else set()), rank
        for k, v in res["streamed"].items():
            assert v.shape == ref_state[k].shape, k
            moved = (ref_state[k] - start[k]).abs().max().item()
            assert (v - ref_state[k]).abs().max().item() <= 1e-3 * max(moved, 1e-3), (k, moved)
    assert max((ref_state[k] - start[k]).abs().max().item() for k in ref_state) > 1e-2  # training moved them


# -- bad input ----------------------------------------------------------------------------------------
def _bad_inputs_worker():
    from megatron_plugin.engine.offload import WeightSnapshot
    from train_steps import DPOTrainStep, GPTTrainStep, PolicyGradientTrainStep

    errors = {}
    expect = expecter(errors, message_only=True)

    accelerator, model, _, hf = prepare("tied", 1, step_class=PolicyGradientTrainStep, step_kwargs={"kl_coef": 0.1})
    batch = causal_batch(hf.config.vocab_size)
    expect("missing_old", lambda: model(**batch))
    batch["old_log_probs"] = torch.zeros(4, SEQ)
    expect("missing_adv", lambda: model(**batch))
    batch["advantages"] = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    batch["ref_log_probs"] = torch.zeros(4, SEQ)
    expect("nan_adv", lambda: model(**batch))
    batch["advantages"] = torch.zeros(4)
    expect("probs_not_log_probs", lambda: model(**dict(batch, old_log_probs=torch.full((4, SEQ), 0.5))))
    expect("nan_ref", lambda: model(**dict(batch, ref_log_probs=torch.full((4, SEQ), float("nan")))))
    batch["advantages"] = torch.zeros(4, SEQ - 1)
    expect("adv_shape", lambda: model(**batch))
    expect("temperature", lambda: model.compute_log_probs(batch, temperature=0.0))
    batch["advantages"] = torch.zeros(4)
    errors["good_batch_runs"] = bool(torch.isfinite(model(**batch).loss))
    expect("use_weights_not_a_snapshot", lambda: accelerator.use_weights({"w": 1}).__enter__())
    stranger = WeightSnapshot([torch.zeros(3)], torch.device("cpu"))  # a snapshot of some other tensors
    expect("use_weights_other_model", lambda: accelerator.use_weights(stranger).__enter__())
    accelerator.offload()
    expect("log_probs_while_offloaded", lambda: model.compute_log_probs(batch))
    expect("save_while_offloaded", lambda: accelerator.save_model(model, "/nonexistent/never"))
    accelerator.reload()

    class OffloadInStep(GPTTrainStep):
        def get_loss_func(self, *args, **kwargs):
            inner = super().get_loss_func(*args, **kwargs)

            def loss_func(*a):
                model.offload()  # the engine prepared below, mid-step
                return inner(*a)

            return loss_func

    from megatron_plugin.engine.distributed import destroy
    destroy()
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, model, _, hf = prepare("tied", 1, step_class=OffloadInStep)
    expect("offload_in_step", lambda: model(**causal_batch(hf.config.vocab_size)))
    errors["not_offloaded_after"] = not model.is_offloaded
    return errors


def test_post_training_bad_inputs_are_named():
    errors = run_on_ranks(_bad_inputs_worker, 1)[0]
    assert "old_log_probs" in errors["missing_old"] and "compute_log_probs" in errors["missing_old"]
    assert "advantages" in errors["missing_adv"]
    assert "advantages" in errors["nan_adv"] and "nan" in errors["nan_adv"]
    assert "old_log_probs" in errors["probs_not_log_probs"] and "<= 0" in errors["probs_not_log_probs"]
    assert "ref_log_probs" in errors["nan_ref"] and "nan" in errors["nan_ref"]
    assert "advantages" in errors["adv_shape"] and "(4, 11)" in errors["adv_shape"]
    assert "temperature" in errors["temperature"]
    assert errors["good_batch_runs"]
    assert "snapshot_weights()" in errors["use_weights_not_a_snapshot"]
    assert "another model" in errors["use_weights_other_model"]
    assert "reload" in errors["log_probs_while_offloaded"]
    assert "reload" in errors["save_while_offloaded"]
    assert "offload" in errors["offload_in_step"] and "step" in errors["offload_in_step"]
    assert errors["not_offloaded_after"]


def _dpo_bad_worker():
    from train_steps import DPOTrainStep

    _, model, _, hf = prepare("tied", 1, step_class=DPOTrainStep)
    batch = dpo_batch(hf.config.vocab_size)
    errors = {}
    expect = expecter(errors, message_only=True)
    for key, change in {
        "missing_ref": lambda b: b,
        "labels_length": lambda b: dict(b, rejected_labels=b["rejected_labels"][:, :-1]),
        "ref_shape": lambda b: dict(b, ref_chosen_logps=torch.zeros(4, 2)),
        "empty_row": lambda b: dict(b, chosen_labels=b["chosen_labels"].index_fill(0, torch.tensor([2]), -100)),
        "positive_ref": lambda b: dict(b, ref_rejected_logps=torch.full((4,), 2.0)),
    }.items():
        b = dict(batch) if key == "missing_ref" else dict(batch, ref_chosen_logps=torch.zeros(4), ref_rejected_logps=torch.zeros(4))
        expect(key, model, **change(b))
    return errors


def test_dpo_bad_batches_are_named():
    errors = run_on_ranks(_dpo_bad_worker, 1)[0]
    assert "ref_chosen_logps" in errors["missing_ref"]
    assert "rejected_labels" in errors["labels_length"] and "(4, 9)" in errors["labels_length"]
    assert "ref_chosen_logps" in errors["ref_shape"]
    assert "chosen_labels" in errors["empty_row"] and "row 2" in errors["empty_row"]
    assert "ref_rejected_logps" in errors["positive_ref"] and "<= 0" in errors["positive_ref"]


def _kwargs_worker():
    from megatron.core import parallel_state

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from train_steps import DPOTrainStep, PolicyGradientTrainStep

    cases = [
        (PolicyGradientTrainStep, {"clip_range": -0.1}),
        (PolicyGradientTrainStep, {"loss_aggregation": "mean"}),
        (PolicyGradientTrainStep, {"kl_coeff": 0.1}),
        (DPOTrainStep, {"beta": 0.0}),
        (DPOTrainStep, {"label_smoothing": 0.5}),
    ]
    from train_steps import GPTTrainStep

    cases += [(PolicyGradientTrainStep, {}, "t5"), (GPTTrainStep, {}, "bert")]  # steps of another family
    out = {}
    expect = expecter(out, state=lambda i: parallel_state.model_parallel_is_initialized())
    for i, (cls, kwargs, *model) in enumerate(cases):
        plugin = MegatronLMPlugin(custom_train_step_class=cls, custom_train_step_kwargs=kwargs)
        hf = {"t5": lambda: tiny_t5(), "bert": lambda: tiny_bert()}[model[0]]() if model else tiny_gpt2()
        loader = DataLoader([{"input_ids": torch.zeros(4, dtype=torch.long)}] * 4, batch_size=2)
        expect(i, lambda: Accelerator(megatron_lm_plugin=plugin).prepare(hf, torch.optim.AdamW(hf.parameters()), loader))
    return list(out.values())


def test_step_kwargs_are_checked_at_prepare():
    got = run_on_ranks(_kwargs_worker, 1)[0]
    names = ["clip_range", "loss_aggregation", "kl_coeff", "beta", "label_smoothing",
             "PolicyGradientTrainStep.*T5TrainStep", "GPTTrainStep.*BertTrainStep"]
    assert len(got) == len(names)
    for (_, message, initialized), name in zip(got, names):
        assert re.search(name, message) and not initialized, (name, message)


def _lazy_stream_worker():
    """Count the TP all-gathers behind iter_hf_weights: the first tensor costs one, not the whole model's."""
    import torch.distributed as dist

    _, model, _, hf = prepare("llama", 2)
    calls = []
    real = dist.all_gather

    def counting(parts, tensor, *args, **kwargs):
        calls.append(tensor.numel() * len(parts))
        return real(parts, tensor, *args, **kwargs)

    dist.all_gather = counting
    try:
        it = model.iter_hf_weights()
        name, first = next(it)
        after_first = len(calls)
        rest = [(n, t.shape) for n, t in it]
    finally:
        dist.all_gather = real
    shapes = {k: v.shape for k, v in hf.state_dict().items()}
    return {"first": (name, first.shape == shapes[name]), "after_first": after_first, "total": len(calls),
            "largest_gather": max(calls),
            # the embedding, with the vocabulary padded for TP: the largest tensor the model holds
            "largest_tensor": model.model.module.embedding.word_embeddings.weight.numel() * 2,
            "all": {name, *(n for n, _ in rest)} == set(shapes),
            "shapes": all(s == shapes[n] for n, s in rest)}


def test_weight_streaming_gathers_one_tensor_at_a_time():
    for res in run_on_ranks(_lazy_stream_worker, 2):
        assert res["first"] == ("model.embed_tokens.weight", True), res
        assert res["after_first"] == 1, res  # the embedding's vocabulary shards only
        assert res["total"] >= 10 and res["all"] and res["shapes"], res
        # no gather moves more than one (padded) tensor
        assert res["largest_gather"] <= res["largest_tensor"], res


def _reference_worker(swap, tp=2, layout=None):
    """KL to the initial policy: reference log-probs from a weight snapshot swapped in (`swap`), or computed
    for every batch up front, before training (the plain way, possible here as the batches are known)."""
    from train_steps import PolicyGradientTrainStep

    accelerator, model, opt, hf = prepare("llama", tp, step_class=PolicyGradientTrainStep, step_kwargs={"kl_coef": 0.1},
                                          **(layout or {}))
    vocab = hf.config.vocab_size
    batches = [causal_batch(vocab, seed=20 + step) for step in range(4)]
    snapshot = accelerator.snapshot_weights() if swap else None
    upfront = [model.compute_log_probs(b) for b in batches]
    res = {"refs": [], "losses": [], "refused": {}}
    for step, batch in enumerate(batches):
        batch["old_log_probs"] = model.compute_log_probs(batch)
        batch["advantages"] = torch.linspace(-1, 1, 4)
        if swap:
            with accelerator.use_weights(snapshot):
                batch["ref_log_probs"] = model.compute_log_probs(batch)
                if step == 2:
                    refused = expecter(res["refused"], message_only=True)
                    for what, fn in {"train": lambda: model.train()(**batch), "offload": accelerator.offload,
                                     "save": lambda: accelerator.save_state("/nonexistent/never"),
                                     "snapshot": accelerator.snapshot_weights}.items():
                        refused(what, fn)
                    model.eval()
                    res["eval_inside"] = bool(torch.isfinite(model(**batch).loss))
        else:
            batch["ref_log_probs"] = upfront[step]
        res["refs"].append(batch["ref_log_probs"])
        model.train()
        out = model(**batch)
        opt.step()
        opt.zero_grad()
        res["losses"].append((out.loss.item(), out.metrics["kl"].item()))
    res["weights"] = {k: v.detach().cpu().clone() for k, v in model.iter_hf_weights()}
    res["refs"] = [r.cpu() for r in res["refs"]]
    if swap:
        res["bytes"] = snapshot.nbytes
    return res


def check_reference_runs(plain, swapped):
    for a, b in zip(plain, swapped):
        assert all(torch.equal(x, y) for x, y in zip(a["refs"], b["refs"]))  # the snapshot is the initial model
        assert a["losses"] == b["losses"]  # and training after each swap back is untouched
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert a["losses"][-1][1] > 1e-4  # the policy moved away from the reference: the KL term is live
        assert b["eval_inside"]
        for what, message in b["refused"].items():
            assert message is not None and "use_weights" in message, (what, message)
        assert b["bytes"] > 0


def test_reference_weights_swapped_in_give_the_initial_log_probs_bit_for_bit():
    check_reference_runs(run_on_ranks(_reference_worker, 2, False), run_on_ranks(_reference_worker, 2, True))
