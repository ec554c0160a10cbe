"""megatron_generate under TP=2 on CPU: greedy output equals HF's generate, prompt by prompt."""

import torch
from torch.utils.data import DataLoader

from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import optimizer_for, token_dataset

NEW = 8


def _prompts():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 1000, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # a shorter prompt, right-padded
    mask[2, 5:] = 0
    return ids, mask


def _generate_worker():
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2()
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=2), DataLoader(token_dataset(4, 1000), batch_size=2)
    )
    ids, mask = _prompts()
    greedy = engine.megatron_generate(ids, mask, max_new_tokens=NEW, eos_token_id=None)
    torch.manual_seed(0)
    sampled = engine.megatron_generate(ids, mask, max_new_tokens=NEW, top_k=5, top_p=0.9, temperature=0.8,
                                       eos_token_id=None)
    return greedy, sampled


def test_greedy_generation_matches_hf_under_tp2():
    results = run_on_ranks(_generate_worker, 2)
    hf = tiny_gpt2()
    ids, mask = _prompts()
    (greedy0, sampled0), (greedy1, sampled1) = results
    assert torch.equal(greedy0, greedy1) and torch.equal(sampled0, sampled1)  # TP ranks agree
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        ref = hf.generate(ids[row : row + 1, :n], max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0]
        assert torch.equal(greedy0[row, : n + NEW], ref), (row, greedy0[row], ref)
    assert greedy0.shape == (3, 7 + NEW)
    # sampled tokens stay inside the vocabulary and keep each prompt
    assert sampled0.max() < 1000 and torch.equal(sampled0[0, :7], ids[0])
