"""MoE training through accelerator.prepare matches HF step for step (CPU, gloo, fp32): a tiny Qwen2-MoE
(8 experts, top-2, shared expert, a dense layer, padded SFT batches) with HF's load-balancing loss
(`output_router_logits=True`), under expert parallelism and tensor parallelism.

The HF reference runs each data-parallel rank's micro-batch as its own forward (HF's aux loss is per
forward) and averages them, as HF DDP with gradient accumulation does."""

import math
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import tiny_moe
from tests.spawn import run_on_ranks
from tests.training import WARMUP, sft_dataset

STEPS = 20
LR = 0.5
AUX = 0.1  # larger than HF's default 0.001, so a wrong load-balancing loss shows in the losses


def moe_model():
    return tiny_moe("qwen2_moe", output_router_logits=True, router_aux_loss_coef=AUX)


def optimizer_for(model):
    # SGD, not Adam: Adam's update hardly changes when a gradient is scaled, so it would hide a wrong
    # reduction of the expert gradients; SGD's moves with it
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)


def z_loss(out, mask):
    """megatron-core's router z-loss from HF's router logits: per MoE layer the mean over the valid tokens of
    logsumexp(logits)^2, summed over the layers."""
    valid = mask.reshape(-1).float()
    return sum((torch.logsumexp(l.float(), -1).square() * valid).sum() / valid.sum() for l in out.router_logits)


def reference(steps, dp, micro, num_micro, per_token=False, z_coeff=0.0, with_weights=False):
    """Plain HF + torch: per step, every (rank, micro-batch) forward's loss (LM + aux) / their number; with
    `per_token`, weighted by its labelled tokens over the step's (calculate_per_token_loss's weighting);
    with `z_coeff`, plus that times the z-loss."""
    from transformers import get_linear_schedule_with_warmup

    model = moe_model().train()
    step_rows = micro * num_micro
    data = sft_dataset(steps * dp * step_rows, model.config.vocab_size)
    opt = optimizer_for(model)
    sched = get_linear_schedule_with_warmup(opt, WARMUP, steps)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        batches = []
        for r in range(dp):  # the prepared loader gives rank r the step's r-th block of rows
            for i in range(num_micro):
                start = (step * dp + r) * step_rows + i * micro
                chunk = data[start:start + micro]
                batches.append({k: torch.stack([d[k] for d in chunk]) for k in chunk[0]})
        counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
        for batch, count in zip(batches, counts):
            weight = count / sum(counts) if per_token else 1 / len(batches)
            out = model(**batch)
            loss = out.loss + (z_coeff * z_loss(out, batch["attention_mask"]) if z_coeff else 0.0)
            loss = loss * weight
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
        norms.append(float(torch.sqrt(sum(p.detach().pow(2).sum() for p in model.parameters()))))
    if with_weights:  # the trained weights, in the checkpoint names hf_state_dict gives
        from megatron_plugin.models.moe_names import checkpoint_state_dict

        return losses, norms, {k: v.detach().clone() for k, v in checkpoint_state_dict(model).items()}
    return losses, norms


def megatron_run(tp, ep, steps, micro, num_micro, sp=False, per_token=False, z_coeff=0.0, log_dir=None,
                 capacity=None, with_weights=False):
    """Inside each launched process: the same run through accelerator.prepare; per step the returned loss
    and the logged metrics (load-balancing loss, tokens per expert)."""
    import os

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // tp
    model = moe_model()
    data = sft_dataset(steps * micro * num_micro * dp, model.config.vocab_size)
    loader = DataLoader(data, batch_size=micro, shuffle=False)
    opt = optimizer_for(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=tp, expert_model_parallel_size=ep, num_micro_batches=num_micro,
                              gradient_clipping=1.0, sequence_parallelism=sp, calculate_per_token_loss=per_token,
                              other_megatron_args={**({"moe_z_loss_coeff": z_coeff} if z_coeff else {}),
                                                   **({"moe_expert_capacity_factor": capacity} if capacity else {})},
                              tensorboard_dir=log_dir, set_all_logging_options=log_dir is not None)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    model.train()
    losses, metrics = [], []
    for batch in loader:
        out = model(**batch)
        losses.append(out.loss.item())
        metrics.append({k: v.tolist() for k, v in model.metrics.items()})
        if len(losses) == steps:
            break
    weights = model.hf_state_dict() if with_weights else None  # collective: every rank
    accelerator.end_training()
    return (losses, metrics, weights) if with_weights else (losses, metrics)


def valid_tokens_per_step(steps, rows_per_step):
    data = sft_dataset(steps * rows_per_step, moe_model().config.vocab_size)
    return [sum(int(d["attention_mask"].sum()) for d in data[s * rows_per_step:(s + 1) * rows_per_step])
            for s in range(steps)]


def check_run(results, ref, global_rows, topk=2, z_coeff=0.0):
    tokens = valid_tokens_per_step(len(ref), global_rows)
    for rank, (losses, metrics) in enumerate(results):
        assert len(losses) == len(ref)
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"rank {rank} step {step}: megatron {a} vs HF {b}"
        for step, m in enumerate(metrics):
            # the objective is the LM loss plus the coefficient times the logged load-balancing loss
            z = z_coeff * m["z_loss"] if z_coeff else 0.0
            assert ("z_loss" in m) == bool(z_coeff)
            assert abs(m["loss"] - (m["lm loss"] + AUX * m["load_balancing_loss"] + z)) < 1e-5
            assert m["load_balancing_loss"] >= 1.0 - 1e-4  # HF's loss is >= 1 (1 when perfectly balanced)
            # layer 1 is the only MoE layer (mlp_only_layers=[1] makes layer 2 dense): every valid token of
            # the global batch picked top-k experts
            assert sorted(k for k in m if k.startswith("tokens per expert")) == ["tokens per expert/layer 1"]
            load = m["tokens per expert/layer 1"]
            assert len(load) == 8 and sum(load) == topk * tokens[step], (load, tokens[step])
    assert ref[-1] < ref[0]  # the run learns: the comparison means something


@pytest.mark.parametrize("tp,ep,micro,num_micro,per_token,z_coeff",
                         [(1, 2, 2, 2, False, 0.0), (1, 2, 2, 1, True, 0.0), (1, 2, 2, 1, False, 0.01)],
                         ids=["ep2_dp2_2micro", "ep2_dp2_per_token", "ep2_dp2_z_loss"])
def test_moe_training_matches_hf_every_step(tp, ep, micro, num_micro, per_token, z_coeff, tmp_path):
    """EP=2 on 2 processes: each holds 4 of the 8 experts, the dense part is data-parallel over both. The
    z-loss run also writes TensorBoard logs: the router losses, every layer's tokens per expert, and the
    parameter norm, in which each expert counts once (it equals HF's)."""
    world = 2
    dp = world // tp
    steps = STEPS if not (per_token or z_coeff) else 10
    ref, ref_norms = reference(steps, dp, micro, num_micro, per_token, z_coeff)
    log_dir = str(tmp_path) if z_coeff else None
    results = run_on_ranks(partial(megatron_run, sp=tp > 1, per_token=per_token, z_coeff=z_coeff, log_dir=log_dir),
                           world, tp, ep, steps, micro, num_micro)
    check_run(results, ref, dp * micro * num_micro, z_coeff=z_coeff)
    if log_dir is not None:
        check_tensorboard(log_dir, results[0][1], ref_norms)


def check_tensorboard(log_dir, metrics, ref_norms):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()

    def values(tag):
        return [e.value for e in events.Scalars(tag)]

    for key in ("lm loss", "load_balancing_loss", "z_loss", "loss"):
        assert values(key) == [pytest.approx(m[key], rel=1e-6) for m in metrics], key
    for e in range(8):
        tag = f"tokens per expert/layer 1/expert {e}"
        assert values(tag) == [m["tokens per expert/layer 1"][e] for m in metrics], tag
    assert values("params-norm") == [pytest.approx(n, rel=1e-4) for n in ref_norms]


@pytest.mark.parametrize("tp,ep,world", [(2, 1, 2), (2, 2, 4)], ids=["tp2_sp", "tp2_sp_ep2"])
def test_moe_training_with_tensor_parallelism_matches_hf(tp, ep, world):
    """TP=2 with sequence parallelism: the router and the shared expert's gate see half the sequence on each
    rank (their gradients summed over TP), the experts' MLPs are split over expert-TP ranks; with EP=2 on 4
    processes the experts are split both ways and the dense part is data-parallel over 2."""
    dp, micro, steps = world // tp, 2, 10
    ref, _, ref_weights = reference(steps, dp, micro, 1, with_weights=True)
    results = run_on_ranks(partial(megatron_run, sp=True, with_weights=True), world, tp, ep, steps, micro, 1)
    check_run([r[:2] for r in results], ref, dp * micro)
    # the losses alone hardly move when one group's gradients are reduced wrongly; the trained weights do
    for rank, (_, _, weights) in enumerate(results):
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            assert (w - ref_weights[k]).abs().max().item() < 1e-4, f"rank {rank}: {k}"


def expected_dropped(batches, capacity, topk=2):
    """(dropped, assigned) over the valid tokens of these forwards, routed by the HF model as it starts, with
    megatron-core's capacity rule (ceil(tokens * topk / experts * factor) per expert, the highest
    probabilities kept), computed here from HF's router logits."""
    model = moe_model()
    dropped = assigned = 0
    for batch in batches:
        with torch.no_grad():
            out = model(**batch)
        valid = batch["attention_mask"].reshape(-1).bool()
        for logits in out.router_logits:
            scores = torch.softmax(logits.float(), -1)
            top_p, top_i = torch.topk(scores, topk, -1)  # Qwen2-MoE here: norm_topk_prob=False
            probs = torch.zeros_like(scores).scatter(1, top_i, top_p)
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_i, True)
            cap = math.ceil(scores.shape[0] * topk / scores.shape[1] * capacity)
            kept = torch.zeros_like(chosen).scatter(0, torch.topk(probs, cap, dim=0).indices, True)
            dropped += int((chosen & ~kept & valid[:, None]).sum())
            assigned += int((chosen & valid[:, None]).sum())
    return dropped, assigned


def test_capacity_factor_drops_and_logs_the_dropped_fraction():
    """moe_expert_capacity_factor: the fraction of expert assignments dropped, logged per step, is what
    megatron-core's capacity rule drops from HF's routing (step 0, both ranks' micro-batches); the loads are
    counted before dropping."""
    capacity, micro = 0.5, 2
    results = run_on_ranks(partial(megatron_run, capacity=capacity), 2, 1, 2, 4, micro, 1)
    data = sft_dataset(2 * micro, moe_model().config.vocab_size)
    batches = [{k: torch.stack([d[k] for d in data[r * micro:(r + 1) * micro]]) for k in data[0]} for r in range(2)]
    dropped, assigned = expected_dropped(batches, capacity)
    assert 0 < dropped < assigned
    for _, metrics in results:
        m = metrics[0]
        assert m["dropped fraction"] == pytest.approx(dropped / assigned, abs=1e-6), (m, dropped, assigned)
        assert sum(m["tokens per expert/layer 1"]) == assigned
