"""LoRA under context parallelism on CPU (issue 29): a PeftModel through prepare at CP=2 gives HF peft's eval
logits over the whole sequences and its adapter gradients, and trains step for step like CP=1. The adapters sit on
the linears, which see this rank's tokens only: A's and B's gradients are partial sums the engine reduces over
DP x CP, as for the base weights of a full fine-tuning."""

import torch
from torch.utils.data import DataLoader

from tests.spawn import run_on_ranks
from tests.test_lora_training import LR, eval_batch, make_optimizer, peft_model, rel
from tests.training import WARMUP, token_dataset

STEPS = 10
MICRO = 4


def _worker(cp):
    """(eval logits, the first step's adapter gradients after clipping, losses, trained adapters) of STEPS steps of
    the tiny Llama with q, v, o, up, down adapters (A and B random) at context parallelism `cp`."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from megatron_plugin.models.lora import lora_hf_state_dict

    model = peft_model("llama")
    loader = DataLoader(token_dataset(STEPS * MICRO, model.config.vocab_size), batch_size=MICRO, shuffle=False)
    opt = make_optimizer(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(context_parallel_size=cp, gradient_clipping=1.0, return_logits=True)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    engine.eval()
    with torch.no_grad():
        logits = engine(**eval_batch(engine.config.vocab_size)).logits
    engine.train()
    grads = {}
    step = engine.optimizer.step

    def capturing_step(*args, **kwargs):
        if not grads:  # reduced over CP and clipped: what the optimizer steps with
            grads.update(lora_hf_state_dict(engine.model, grads=True))
        return step(*args, **kwargs)

    engine.optimizer.step = capturing_step
    losses = []
    for batch in loader:
        losses.append(engine(**batch).loss.item())
        if len(losses) == STEPS:
            break
    return {"logits": logits, "grads": grads, "losses": losses, "trained": lora_hf_state_dict(engine.model)}


def _peft_reference():
    """HF peft's eval logits and first-step gradients (clipped to norm 1, as the engine clips them)."""
    model = peft_model("llama")
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in eval_batch(model.config.vocab_size).items() if k != "labels"}).logits
    model.train()
    rows = token_dataset(STEPS * MICRO, model.config.vocab_size)[:MICRO]
    model(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}).loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    grads = {n.replace(".default.weight", ".weight"): p.grad for n, p in model.named_parameters() if p.requires_grad}
    return logits, grads


def test_lora_under_context_parallelism_matches_peft_and_cp1():
    assert LR > 0 and WARMUP < STEPS
    ref_logits, ref_grads = _peft_reference()
    (cp1,) = run_on_ranks(_worker, 1, 1)
    results = run_on_ranks(_worker, 2, 2)
    assert cp1["losses"][-1] < cp1["losses"][0]  # the run learns: equal losses mean something
    for rank, got in enumerate(results):
        assert got["logits"].shape == ref_logits.shape and rel(got["logits"], ref_logits) < 1e-4, rank
        assert set(got["grads"]) == set(ref_grads), rank
        for k, g in ref_grads.items():
            assert g.abs().max() > 0, k  # B non-zero: A's gradient too
            assert rel(got["grads"][k], g) < 1e-4, (rank, k)
        for step, (a, b) in enumerate(zip(got["losses"], cp1["losses"])):
            assert abs(a - b) / abs(b) < 1e-5, f"rank {rank} step {step}: CP=2 {a} vs CP=1 {b}"
        for k, v in cp1["trained"].items():
            assert rel(got["trained"][k], v) < 1e-4, (rank, k)
