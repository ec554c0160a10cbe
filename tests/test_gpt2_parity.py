"""HF GPT-2 vs its Megatron-Core twin under TP = 1, 2, 4 on CPU: logits, gradients, round trip."""

import pytest
import torch

from tests.errors import refusal
from tests.models import GPT2_CONFIGS, check_decoder_parity, decoder_parity, padded_ids, tiny_gpt2
from tests.spawn import run_on_ranks

SEQ = 12


def _cases(vocab):
    """(name, input_ids, attention_mask, position_ids, valid positions): no padding, right and left padding."""
    ids, right, left = padded_ids(vocab, 0, {1: 4}, SEQ)
    full = torch.ones(3, SEQ, dtype=torch.bool)
    return [("none", ids, None, None, full), ("right", ids, right, None, right.bool()),
            ("left", ids, left, None, left.bool())]


def _parity_worker():
    # gradients on the right-padded batch
    return decoder_parity(tiny_gpt2, GPT2_CONFIGS, _cases, "right")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gpt2_parity_under_tensor_parallel(world_size):
    check_decoder_parity(run_on_ranks(_parity_worker, world_size), GPT2_CONFIGS, ("none", "right", "left"), world_size)


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
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    hf = tiny_gpt2()
    plugin = MegatronLMPlugin()
    initialize(plugin, hf.config)
    model = MegatronModel(hf.config, plugin)
    state = dict(hf.state_dict(), **{"transformer.h.0.attn.extra_proj.weight": torch.zeros(2)})
    got = refusal(model.load_hf_state_dict, state)
    return None if got is None else got[1]


def test_hf_weights_outside_the_mapping_are_refused():
    (msg,) = run_on_ranks(_unmapped_worker, 1)
    assert msg is not None and "extra_proj" in msg
