"""HF GPT-2 vs its Megatron-Core twin under TP = 1, 2, 4 on CPU: logits, gradients, round trip."""

import os

import pytest
import torch

from tests.models import GPT2_CONFIGS, tiny_gpt2
from tests.spawn import run_on_ranks

SEQ = 12


def _batches(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, SEQ), generator=g)
    right = torch.ones(3, SEQ, dtype=torch.long)
    right[0, 8:] = 0
    right[2, 5:] = 0
    left = torch.ones(3, SEQ, dtype=torch.long)
    left[1, :4] = 0
    return ids, {"none": None, "right": right, "left": left}


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _parity_worker():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    tp = int(os.environ["WORLD_SIZE"])
    plugin = MegatronLMPlugin(tp_degree=tp)
    out = {}
    for name in GPT2_CONFIGS:
        for lm_head in (True, False):
            hf = tiny_gpt2(name, lm_head=lm_head)
            initialize(plugin, hf.config)
            model = MegatronModel.from_hf(hf, plugin).eval()
            ids, masks = _batches(hf.config.vocab_size)
            res = {}
            for mask_name, mask in masks.items():
                with torch.no_grad():
                    ref = hf(ids, attention_mask=mask)
                    ref = ref.logits if lm_head else ref.last_hidden_state
                    got = model(ids, attention_mask=mask)
                valid = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
                res[f"fwd_{mask_name}"] = (got - ref).abs()[valid].max().item()
                res["shape_ok"] = res.get("shape_ok", True) and got.shape == ref.shape

            # Round trip: HF -> Megatron(TP) -> HF, exact.
            back = model.hf_state_dict()
            ref_sd = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
            res["roundtrip_keys_equal"] = set(back) == set(ref_sd)
            res["roundtrip_bit_exact"] = all(torch.equal(back[k], ref_sd[k]) for k in ref_sd if k in back)

            if lm_head:
                # Gradients of a padded cross-entropy loss w.r.t. every HF parameter.
                mask = masks["right"]
                labels = ids.masked_fill(mask == 0, -100)
                hf.zero_grad()
                hf(ids, attention_mask=mask, labels=labels).loss.backward()
                shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
                per_token = model(ids, attention_mask=mask, labels=shifted)
                keep = (shifted != -100).float()
                loss = (per_token * keep).sum() / keep.sum()
                model.zero_grad()
                loss.backward()
                grads = model.hf_state_dict(grads=True)
                ref_grads = {k: p.grad for k, p in hf.named_parameters() if k in grads}
                res["grad_names_equal"] = set(ref_grads) == set(grads)
                res["grad_max_rel"] = max(_max_rel(grads[k], ref_grads[k]) for k in ref_grads)
            out[(name, lm_head)] = res
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gpt2_parity_under_tensor_parallel(world_size):
    results = run_on_ranks(_parity_worker, world_size)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == 2 * len(GPT2_CONFIGS)
        for (name, lm_head), res in per_rank.items():
            where = f"rank {rank}/{world_size}, config {name}, lm_head={lm_head}"
            assert res["shape_ok"], where
            for mask_name in ("none", "right", "left"):
                assert res[f"fwd_{mask_name}"] < 1e-4, (where, mask_name, res)
            assert res["roundtrip_keys_equal"] and res["roundtrip_bit_exact"], (where, res)
            if lm_head:
                assert res["grad_names_equal"], where
                assert res["grad_max_rel"] < 1e-4, (where, res)


def _stages_worker(tp, pp):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    hf = tiny_gpt2("untied", n_layer=4)
    plugin = MegatronLMPlugin(tp_degree=tp, pp_degree=pp)
    layout = initialize(plugin, hf.config)
    model = MegatronModel.from_hf(hf, plugin)
    back = model.hf_state_dict()
    ref = hf.state_dict()
    return {"stage": layout.pp_rank, "names": sorted(back), "exact": all(torch.equal(back[k], ref[k]) for k in back)}


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_stages_hold_their_share_bit_exact(tp, pp):
    results = run_on_ranks(_stages_worker, tp * pp, tp, pp)
    assert all(r["exact"] for r in results)
    by_stage = {r["stage"]: set(r["names"]) for r in results}
    # stages split the HF tensors: no overlap, nothing missing
    assert not by_stage[0] & by_stage[1]
    assert by_stage[0] | by_stage[1] == set(tiny_gpt2("untied", n_layer=4).state_dict())
    assert "transformer.wte.weight" in by_stage[0] and "lm_head.weight" in by_stage[1]
    assert "transformer.h.0.ln_1.weight" in by_stage[0] and "transformer.h.3.ln_1.weight" in by_stage[1]


def _unmapped_worker():
    from megatron_plugin import MegatronLMPlugin, MegatronPluginConfigError
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    hf = tiny_gpt2()
    plugin = MegatronLMPlugin()
    initialize(plugin, hf.config)
    model = MegatronModel(hf.config, plugin)
    state = dict(hf.state_dict(), **{"transformer.h.0.attn.extra_proj.weight": torch.zeros(2)})
    try:
        model.load_hf_state_dict(state)
    except MegatronPluginConfigError as err:
        return str(err)
    return None


def test_hf_weights_outside_the_mapping_are_refused():
    (msg,) = run_on_ranks(_unmapped_worker, 1)
    assert msg is not None and "extra_proj" in msg
