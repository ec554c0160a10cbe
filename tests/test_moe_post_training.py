"""Post-training with an MoE model under expert parallelism (CPU, gloo, EP=2 on 2 processes: each holds 4 of
the 8 experts, the dense part is data-parallel over both): greedy generation equals HF's generate token for
token, with each rank generating its own prompts (different counts and lengths); log-probs equal HF's
log_softmax (and batches of different lengths on the ranks are refused clearly); DPO and policy-gradient
gradients, with HF's load-balancing loss, equal HF autograd's (at EP=2, and at TP=2 with sequence
parallelism); offload/reload is bit-exact; save_model writes the checkpoint's per-expert names, which
from_pretrained loads bit for bit."""

import math
import os
import tempfile

import pytest
import torch

from tests.models import max_rel, tiny_moe
from tests.spawn import run_on_ranks
from tests.test_post_training import causal_batch, dpo_batch, hf_dpo_loss, hf_policy_loss, hf_token_log_probs, \
    prepare

AUX = 0.1
NEW = 12


def moe_model(**overrides):
    return tiny_moe("qwen2_moe", **overrides)


def _prompts(vocab, rank):
    """Rank 0: three prompts of up to 9 tokens; rank 1: two of up to 6 (so the ranks' batches differ)."""
    g = torch.Generator().manual_seed(11 + rank)
    rows, width = (3, 9) if rank == 0 else (2, 6)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[1, width - 3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _hf_greedy(hf, ids, mask, eos=None):
    rows = []
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        rows.append(hf.generate(ids[r:r + 1, :n], max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                pad_token_id=0)[0])
    return rows


def _serving_worker():
    from megatron_plugin.models.moe_names import checkpoint_state_dict
    from transformers import AutoModelForCausalLM

    rank = int(os.environ["RANK"])
    hf = moe_model()
    accelerator, model, _, _ = prepare("qwen2_moe", 1, hf=hf, expert_model_parallel_size=2)
    res = {}
    # generation: each rank its own prompts; the expert-parallel group decodes them together
    ids, mask = _prompts(hf.config.vocab_size, rank)
    got = model.megatron_generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])
    ref = _hf_greedy(hf, ids, mask)
    res["generate_equal"] = all(torch.equal(got[r, : row.numel()], row) for r, row in enumerate(ref))
    res["generate_width"] = (got.shape[1], int(mask.sum(1).max()) + NEW)
    res["no_cache_equal"] = torch.equal(model.megatron_generate(ids, mask, max_new_tokens=NEW, eos_token_id=[],
                                                                use_cache=False), got)
    # with a stop token (one this rank's first row generates), rows stop as HF's do
    stop = int(ref[0][int(mask[0].sum()) + 3])
    stopped = model.megatron_generate(ids, mask, max_new_tokens=NEW, eos_token_id=stop)
    ref_stop = _hf_greedy(hf, ids, mask, eos=stop)
    res["stop_equal"] = all(torch.equal(stopped[r, : row.numel()], row) for r, row in enumerate(ref_stop))
    res["stop_width_ok"] = stopped.shape[1] <= got.shape[1]
    # log-probs, the same shapes on both ranks (the experts see both ranks' tokens), different tokens
    batch = causal_batch(hf.config.vocab_size, seed=20 + rank)
    lp = model.compute_log_probs(batch)
    with torch.no_grad():
        ref_lp, _ = hf_token_log_probs(hf, batch)
    res["log_probs"] = (lp - ref_lp).abs().max().item()
    # batches of other lengths on the two ranks: one clear error on both, not a collective that fails or hangs
    from megatron_plugin.errors import MegatronPluginConfigError

    try:
        model.compute_log_probs({k: v[:, : 12 - 2 * rank] for k, v in batch.items()})
        res["uneven_error"] = None
    except MegatronPluginConfigError as e:
        res["uneven_error"] = str(e)
    # offload / reload: bit for bit
    before = {k: v.clone() for k, v in model.model.module.state_dict().items() if torch.is_tensor(v)}
    model.offload()
    model.reload()
    after = model.model.module.state_dict()
    res["offload_exact"] = all(torch.equal(before[k], after[k]) for k in before)
    # every tensor under the checkpoint's names; save_model -> from_pretrained gives the same weights
    names = [name for name, _ in model.iter_hf_weights()]
    want = checkpoint_state_dict(hf)
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    res["names_equal"] = sorted(names) == sorted(want)
    with tempfile.TemporaryDirectory() as d:
        shared = [d if rank == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        accelerator.save_model(model, shared[0])
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(shared[0]).state_dict()
            original = hf.state_dict()
            res["reload_exact"] = set(loaded) == set(original) and all(
                torch.equal(loaded[k], original[k]) for k in original)
        torch.distributed.barrier()
    return res


def test_generation_log_probs_offload_and_export_under_expert_parallelism():
    results = run_on_ranks(_serving_worker, 2)
    for rank, res in enumerate(results):
        where = (rank, res)
        assert res["generate_equal"] and res["stop_equal"] and res["no_cache_equal"], where
        got_width, own_width = res["generate_width"]
        assert got_width == own_width, where  # as wide as this rank's own prompts make it, not the union's
        assert res["stop_width_ok"], where
        assert res["log_probs"] < 1e-5, where
        assert res["offload_exact"] and res["names_equal"], where
        assert res["uneven_error"] and "expert_model_parallel_size" in res["uneven_error"], where
    assert results[0]["reload_exact"], results[0]


def _sequence_parallel_generation_worker():
    """TP=2 trained with sequence parallelism (MoE layers need it with TP > 1) generates as HF does, and
    the model trains on afterwards with sequence parallelism back in place."""
    rank = int(os.environ["RANK"])
    hf = moe_model()
    _, model, _, _ = prepare("qwen2_moe", 2, hf=hf, sequence_parallelism=True)
    ids, mask = _prompts(hf.config.vocab_size, 0)  # TP ranks of one replica: the same prompts

    def flags():
        return sorted(n for n, m in model.model.module.named_modules() if vars(m).get("sequence_parallel") is True)

    before = flags()
    got = model.megatron_generate(ids, mask, max_new_tokens=NEW, eos_token_id=[])
    ref = _hf_greedy(hf, ids, mask)
    # sequence parallelism is back: log-probs run through it and equal HF's
    batch = causal_batch(hf.config.vocab_size, seed=20)
    lp = model.compute_log_probs(batch)
    with torch.no_grad():
        ref_lp, _ = hf_token_log_probs(hf, batch)
    return {"rank": rank, "equal": all(torch.equal(got[r, : row.numel()], row) for r, row in enumerate(ref)),
            "restored": model.model.config.sequence_parallel is True and flags() == before and len(before) > 0,
            "log_probs": (lp - ref_lp).abs().max().item()}


def test_generation_with_sequence_parallelism_equals_hf():
    for res in run_on_ranks(_sequence_parallel_generation_worker, 2):
        assert res["equal"] and res["restored"] and res["log_probs"] < 1e-5, res


def _with_aux(hf, ids, mask):
    """HF's load-balancing loss of one forward over these rows (what the step adds, times the coefficient)."""
    return hf(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss


def _step_grads(model, batch):
    """One step's gradients (data-parallel reduced) under checkpoint names, without stepping."""
    from tests.test_post_training import _engine_grads

    return _engine_grads(model, batch)


def _layout(tp):
    """EP=2 over the two processes, or TP=2 with sequence parallelism (the experts split over expert-TP ranks)."""
    return dict(expert_model_parallel_size=2) if tp == 1 else dict(sequence_parallelism=True)


def _dpo_worker(tp=1):
    from megatron_plugin.models.moe_names import checkpoint_grads
    from train_steps import DPOTrainStep
    from train_steps.dpo import concatenated

    hf = moe_model(output_router_logits=True, router_aux_loss_coef=AUX)
    kwargs = dict(beta=0.5, label_smoothing=0.1)
    _, model, _, _ = prepare("qwen2_moe", tp, hf=hf, step_class=DPOTrainStep, step_kwargs=kwargs, **_layout(tp))
    batch = dpo_batch(hf.config.vocab_size)
    g = torch.Generator().manual_seed(3)
    for side in ("chosen", "rejected"):
        lp = model.compute_log_probs({k: batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels")})
        batch[f"ref_{side}_logps"] = lp.sum(-1) + torch.randn(4, generator=g)
    grads, logs = _step_grads(model, batch)
    hf.zero_grad()
    both = concatenated(batch)
    aux = _with_aux(hf, both["input_ids"], both["attention_mask"])
    ref_loss = hf_dpo_loss(hf, batch, **kwargs) + AUX * aux
    ref_loss.backward()
    return _compare(grads, checkpoint_grads(hf), logs[0], ref_loss, aux)


def _policy_worker(tp=1):
    from megatron_plugin.models.moe_names import checkpoint_grads
    from train_steps import PolicyGradientTrainStep

    hf = moe_model(output_router_logits=True, router_aux_loss_coef=AUX)
    kwargs = dict(clip_range=0.2, kl_coef=0.05)
    _, model, _, _ = prepare("qwen2_moe", tp, hf=hf, step_class=PolicyGradientTrainStep, step_kwargs=kwargs,
                             **_layout(tp))
    batch = causal_batch(hf.config.vocab_size)
    g = torch.Generator().manual_seed(5)
    on = batch["labels"] != -100
    lp = model.compute_log_probs(batch)  # the sampling policy's, from the model itself
    batch["old_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * on
    batch["ref_log_probs"] = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * on
    batch["advantages"] = torch.randn(lp.shape[0], generator=g)
    grads, logs = _step_grads(model, batch)
    hf.zero_grad()
    aux = _with_aux(hf, batch["input_ids"], batch["attention_mask"])
    ref_loss = hf_policy_loss(hf, batch, **kwargs) + AUX * aux
    ref_loss.backward()
    return _compare(grads, checkpoint_grads(hf), logs[0], ref_loss, aux)


def _compare(grads, ref, logs, ref_loss, aux):
    common = sorted(set(grads) & set(ref))
    experts = [k for k in common if ".experts." in k]
    return {
        "names_equal": set(ref) <= set(grads),
        "grad_max_rel": max(max_rel(grads[k], ref[k]) for k in common),
        "expert_grads_nonzero": sum(int(ref[k].abs().max() > 0) for k in experts),
        "experts": len(experts),
        "loss": (logs["loss"].item(), ref_loss.item()),
        "aux": (logs["load_balancing_loss"].item(), aux.item()),
    }


def _check_grads(results):
    for rank, res in enumerate(results):
        where = (rank, res)
        assert res["names_equal"], where
        # both ranks hold the same batch: the step's gradients are HF's for it, experts split or not
        assert res["grad_max_rel"] < 1e-5, where
        assert res["experts"] == 8 * 3 and res["expert_grads_nonzero"] >= 8, where  # the experts learn
        got, want = res["loss"]
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), where
        got, want = res["aux"]
        assert abs(got - want) < 1e-6 and want >= 1.0, where
        assert not math.isnan(got)


@pytest.mark.parametrize("tp", [1, 2], ids=["ep2", "tp2_sp"])
def test_dpo_gradients_with_load_balancing_equal_hf(tp):
    _check_grads(run_on_ranks(_dpo_worker, 2, tp))


@pytest.mark.parametrize("tp", [1, 2], ids=["ep2", "tp2_sp"])
def test_policy_gradients_with_load_balancing_equal_hf(tp):
    _check_grads(run_on_ranks(_policy_worker, 2, tp))
