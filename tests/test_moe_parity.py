"""HF Mixtral, Qwen2-MoE and Qwen3-MoE vs their Megatron-Core twins on CPU: logits with right padding and
gradients within 1e-4 of HF, the weights HF -> Megatron -> HF bit for bit, at a world of one and under
expert parallelism (EP = 2), tensor parallelism (TP = 2) and both (4 processes).

HF's tensors are compared under their checkpoint names (one tensor per expert, as `save_pretrained` writes
them): transformers 5 stacks a live model's experts, and `moe_names` reverts that with transformers' own
conversion."""

import pytest
import torch

from tests.models import MOE_CONFIGS, max_rel, megatron_twin, padded_ids, tiny_moe, token_mean
from tests.spawn import run_on_ranks

SEQ = 12


def _parity(names, tp, ep, sp, folder=None):
    """One rank's comparison for each family of `names` under TP = tp, EP = ep: {name: results}. With
    `folder`, the model is also saved there by HF (`save_pretrained`: per-expert checkpoint names) and read
    back from the files as a model without weights is (each rank reading its own experts' slices)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.moe_names import checkpoint_grads, checkpoint_state_dict

    plugin = MegatronLMPlugin(tp_degree=tp, expert_model_parallel_size=ep, sequence_parallelism=sp)
    out = {}
    for name in names:
        hf = tiny_moe(name)
        model = megatron_twin(hf, plugin)
        # mcore's MoE layer refuses TP without SP in training mode; dropouts are 0, so eval changes nothing else
        model.train(sp).module.train(sp)
        ids, right, _ = padded_ids(hf.config.vocab_size, 3, {}, SEQ)
        res = {}
        with torch.no_grad():
            ref = hf(ids, attention_mask=right).logits
            got = model(ids, attention_mask=right)
        res["fwd"] = (got - ref).abs()[right.bool()].max().item()
        res["shape_ok"] = got.shape == ref.shape

        back = model.hf_state_dict()
        ref_sd = checkpoint_state_dict(hf)
        if hf.config.tie_word_embeddings:
            ref_sd.pop("lm_head.weight")
        res["roundtrip_keys"] = set(back) ^ set(ref_sd)
        res["roundtrip_exact"] = all(torch.equal(back[k], ref_sd[k]) for k in ref_sd if k in back)
        if folder is not None:
            from megatron_plugin.engine.hf_io import HFReader
            from megatron_plugin.models.modeling import MegatronModel

            path = f"{folder}/{name}"
            if dist.get_rank() == 0:
                hf.save_pretrained(path)
            dist.barrier()
            read = MegatronModel(hf.config, plugin)
            reader = HFReader(path)
            read.load_hf(reader.get_slice, reader.names)
            mine = model.module.state_dict()
            res["files_exact"] = all(torch.equal(v, mine[k]) for k, v in read.module.state_dict().items()
                                     if not k.endswith("_extra_state"))

        labels = ids.masked_fill(right == 0, -100)
        hf.zero_grad()
        hf(ids, attention_mask=right, labels=labels).loss.backward()
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        model.zero_grad()
        token_mean(model(ids, attention_mask=right, labels=shifted), shifted).backward()
        # what the engines do to gradients before the step, done here on one identical batch per rank:
        # experts split over EP ranks saw the tokens of every data-parallel rank (all the same batch here):
        # megatron-core scales their summed gradients by 1 / data-parallel size; q/k norms and (under SP)
        # the router and the shared expert's gate see part of the heads or tokens: summed over TP
        # This parity run keeps SP off (the forward generation runs): every TP rank then holds all tokens and
        # megatron-core's dispatcher gathers each rank's copy, so the experts see every token TP times (why
        # training refuses MoE with TP > 1 without SP); scaled back here. Training under SP: test_moe_training.
        dp = ps.get_data_parallel_world_size()
        tp_group = ps.get_tensor_model_parallel_group()
        for n, p in model.module.named_parameters():
            if getattr(p, "allreduce", True) is False:
                p.grad /= dp
            if tp > 1 and not sp and ".local_experts." in n:
                p.grad /= tp
            if tp > 1 and ("q_layernorm" in n or "k_layernorm" in n or (sp and getattr(p, "sequence_parallel", False))):
                dist.all_reduce(p.grad, group=tp_group)
        grads, ref_grads = model.hf_state_dict(grads=True), checkpoint_grads(hf)
        res["grad_keys"] = set(grads) ^ set(ref_grads)
        rel = {k: max_rel(grads[k], ref_grads[k]) for k in ref_grads if k in grads}
        res["grad_worst"] = max(rel.items(), key=lambda kv: kv[1])
        out[name] = res
    return out


def _check(results, names, where):
    for rank, per_rank in enumerate(results):
        assert sorted(per_rank) == sorted(names)
        for name, res in per_rank.items():
            at = f"{where}, rank {rank}, {name}"
            assert res["shape_ok"], at
            assert res["fwd"] < 1e-4, (at, res)
            assert not res["roundtrip_keys"] and res["roundtrip_exact"], (at, res)
            assert res.get("files_exact", True), (at, res)
            assert not res["grad_keys"], (at, res)
            assert res["grad_worst"][1] < 1e-4, (at, res)


def test_moe_families_match_hf_at_world_one():
    names = sorted(MOE_CONFIGS)
    _check(run_on_ranks(_parity, 1, names, 1, 1, False), names, "world of one")


@pytest.mark.parametrize("tp,ep,names", [
    (1, 2, ["qwen2_moe", "mixtral"]),
    (2, 1, ["qwen3_moe"]),
    (2, 2, ["qwen2_moe"]),
])
def test_moe_families_match_hf_under_expert_and_tensor_parallel(tp, ep, names, tmp_path):
    folder = str(tmp_path) if ep > 1 else None
    results = run_on_ranks(_parity, tp * ep, names, tp, ep, False, folder)
    _check(results, names, f"TP={tp} x EP={ep}")
    assert folder is None or all("files_exact" in res for per_rank in results for res in per_rank.values())


def _base_models(names):
    """HF's base models (no LM head: hidden states, names without `model.`) against their twins."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.moe_names import checkpoint_state_dict

    out = {}
    for name in names:
        hf = tiny_moe(name, lm_head=False)
        model = megatron_twin(hf, MegatronLMPlugin()).eval()
        ids, right, _ = padded_ids(hf.config.vocab_size, 3, {}, SEQ)
        with torch.no_grad():
            ref = hf(ids, attention_mask=right).last_hidden_state
            got = model(ids, attention_mask=right)
        back, ref_sd = model.hf_state_dict(), checkpoint_state_dict(hf)
        out[name] = ((got - ref).abs()[right.bool()].max().item(), set(back) ^ set(ref_sd),
                     all(torch.equal(back[k], ref_sd[k]) for k in ref_sd if k in back))
    return out


def test_moe_base_models_match_hf():
    (got,) = run_on_ranks(_base_models, 1, ["mixtral", "qwen2_moe"])
    for name, (fwd, key_diff, exact) in got.items():
        assert fwd < 1e-4 and not key_diff and exact, (name, fwd, key_diff, exact)


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_checkpoint_and_live_names_round_trip(name):
    """A live transformers-5 model's stacked experts -> checkpoint names (what the mapping reads and the
    exports write) -> back, bit for bit, so exported weights load into a live HF model (rollouts)."""
    from megatron_plugin.models.moe_names import checkpoint_state_dict, live_state_dict

    for lm_head in (True, False):
        hf = tiny_moe(name, lm_head=lm_head)
        ckpt = checkpoint_state_dict(hf)
        assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in ckpt)
        back = live_state_dict(hf.config, ckpt, "lm" if lm_head else "base")
        live = hf.state_dict()
        assert set(back) == set(live) and all(torch.equal(back[k], live[k]) for k in live), (name, lm_head)


def test_routing_and_expert_order_matter():
    """The parity above could not pass with a router mis-normalized or experts mis-numbered: renormalizing
    Qwen2-MoE's top-k changes HF's logits, and so does swapping two experts' weights."""
    hf = tiny_moe("qwen2_moe")
    ids, right, _ = padded_ids(hf.config.vocab_size, 3, {}, SEQ)
    with torch.no_grad():
        plain = hf(ids, attention_mask=right).logits
        experts = hf.model.layers[0].mlp.experts
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
        assert (hf(ids, attention_mask=right).logits - plain).abs().max() > 1e-3
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
        assert torch.equal(hf(ids, attention_mask=right).logits, plain)
        hf.model.layers[0].mlp.gate.norm_topk_prob = True
        assert (hf(ids, attention_mask=right).logits - plain).abs().max() > 1e-3
