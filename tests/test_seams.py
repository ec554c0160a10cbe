"""The model-side seams MoE and context parallelism will use (issue 25, item 5): the layer spec takes an
MoE MLP, mapping rules expand an expert index, and context parallelism's split and gather points are the
identity at one rank and refuse more."""

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_on_ranks

EXPERT_FC1 = ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",
              "decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight")


def test_dense_mlp_is_the_default():
    """Without an MLP spec, a layer's MLP slot is the dense MLP it always was."""
    from megatron.core.transformer.mlp import MLP

    from megatron_plugin.layers.linear import ColumnParallelLinear, DropoutInputRowParallelLinear, RowParallelLinear
    from megatron_plugin.layers.spec import dense_mlp_spec, local_layer_spec

    for dropout, fc2 in ((False, RowParallelLinear), (True, DropoutInputRowParallelLinear)):
        mlp = local_layer_spec(mlp_dropout=dropout).submodules.mlp
        assert mlp.module is MLP
        assert (mlp.submodules.linear_fc1, mlp.submodules.linear_fc2) == (ColumnParallelLinear, fc2)
        assert local_layer_spec(mlp_dropout=dropout) == local_layer_spec(mlp=dense_mlp_spec(dropout))
    with pytest.raises(ValueError, match="mlp_dropout"):
        local_layer_spec(mlp_dropout=True, mlp=dense_mlp_spec())


def _moe_block_worker():
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.layers.linear import ColumnParallelLinear, RowParallelLinear
    from megatron_plugin.layers.spec import block_spec, moe_mlp_spec
    from megatron_plugin.models.mapping import Rule, StagePlan, expand

    initialize(MegatronLMPlugin())
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
                            num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                            use_cpu_initialization=True)
    block = TransformerBlock(cfg, block_spec(cfg, 2, mlp=moe_mlp_spec()))
    report = {"layers": []}
    for layer in block.layers:
        mlp = layer.mlp
        experts = mlp.experts.local_experts if isinstance(mlp.experts, SequentialMLP) else []
        report["layers"].append(dict(
            moe=isinstance(mlp, MoELayer) and layer.is_moe_layer,
            experts=len(experts),
            fc1=[type(e.linear_fc1) is ColumnParallelLinear for e in experts],
            fc2=[type(e.linear_fc2) is RowParallelLinear for e in experts],
            fc1_shape=[tuple(e.linear_fc1.weight.shape) for e in experts],
            fc2_shape=[tuple(e.linear_fc2.weight.shape) for e in experts],
        ))
    # the expert rule names exactly the block's expert weights (the block's names lack "decoder.")
    rule = Rule(EXPERT_FC1[0], EXPERT_FC1[1].removeprefix("decoder."), tp_dim=0)
    report["mapped"] = sorted(m for _, _, m in expand([rule], StagePlan.single(2).with_experts(4)))
    report["params"] = sorted(n for n, _ in block.named_parameters() if n.endswith("linear_fc1.weight"))
    return report


def test_layer_spec_takes_an_moe_mlp():
    (report,) = run_on_ranks(_moe_block_worker, 1)
    assert len(report["layers"]) == 2
    for layer in report["layers"]:
        assert layer["moe"] and layer["experts"] == 4, layer
        assert all(layer["fc1"]) and all(layer["fc2"]), layer
        assert layer["fc1_shape"] == [(24, 16)] * 4 and layer["fc2_shape"] == [(16, 24)] * 4, layer
    assert report["mapped"] == report["params"] and len(report["params"]) == 8, report


def test_rules_expand_an_expert_index():
    from megatron_plugin.models.mapping import Rule, StagePlan, expand

    rule = Rule((EXPERT_FC1[0],), EXPERT_FC1[1], tp_dim=0)
    dense = Rule(("model.layers.{i}.mlp.up_proj.weight",), "decoder.layers.{i}.mlp.linear_fc1.weight", tp_dim=0)
    hf, mc = EXPERT_FC1
    # 2 layers x 4 experts at EP=2: rank 1 holds global experts 2 and 3 as its local 0 and 1
    got = [(names, m) for _, names, m in expand([rule], StagePlan.single(2).with_experts(4, ep_size=2, ep_rank=1))]
    assert got == [((hf.format(i=i, e=e),), mc.format(i=i, e=e - 2)) for i in (0, 1) for e in (2, 3)]
    # the layer index still follows the pipeline stage: stage 1 of 2 over 4 layers, EP rank 0
    plan = StagePlan.for_rank(4, pp_size=2, pp_rank=1).with_experts(4, ep_size=2, ep_rank=0)
    got = [(names, m) for _, names, m in expand([rule], plan)]
    assert got == [((hf.format(i=i + 2, e=e),), mc.format(i=i, e=e)) for i in (0, 1) for e in (0, 1)]
    # a rule without {e} expands as before, with or without experts in the plan
    for plan in (StagePlan.single(2), StagePlan.single(2).with_experts(4, ep_size=2, ep_rank=1)):
        got = [(names, m) for _, names, m in expand([dense], plan)]
        assert got == [(("model.layers.0.mlp.up_proj.weight",), "decoder.layers.0.mlp.linear_fc1.weight"),
                       (("model.layers.1.mlp.up_proj.weight",), "decoder.layers.1.mlp.linear_fc1.weight")]
    with pytest.raises(ValueError, match="no experts"):
        list(expand([rule], StagePlan.single(2)))
    with pytest.raises(ValueError, match="evenly"):
        StagePlan.single(2).with_experts(4, ep_size=3, ep_rank=0)
    with pytest.raises(ValueError, match="stage='layer'"):
        Rule(("experts.{e}.w",), "experts.{e}.w", stage="first")


def test_every_transform_reads_its_own_shard():
    """`read_shard` dispatches to the transform's reader; a reader that declines (None) falls back to
    sharding the whole transformed tensor."""
    from megatron_plugin.models.mapping import TRANSFORMS, Dims, Rule, TensorSlice, read_shard, shard

    assert all(t.read_shard is not None for t in TRANSFORMS.values())
    d = Dims(hidden=8, heads=4, groups=1, head_dim=2, vocab=10, padded_vocab=12)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, 8, generator=g) for n, s in (("q", 8), ("k", 2), ("v", 2), ("e", 10))}
    qkv = Rule(("q", "k", "v"), "qkv", transform="qkv_split", tp_dim=0)  # 1 KV head, 2 ranks: falls back
    assert TRANSFORMS["qkv_split"].read_shard([TensorSlice(sd[n]) for n in "qkv"], qkv, d, 2, 0) is None
    vocab = Rule(("e",), "emb", transform="vocab", tp_dim=0)  # a reader of its own
    for rule in (qkv, vocab):
        full = TRANSFORMS[rule.transform].to_mcore([sd[n] for n in rule.hf], d)
        for r in range(2):
            got = read_shard(lambda n: TensorSlice(sd[n]), rule, rule.hf, d, 2, r)
            assert torch.equal(got, shard(full, rule, 2, r))
    assert torch.equal(read_shard(lambda n: TensorSlice(sd[n]), vocab, vocab.hf, d, 2, 1)[4:], torch.zeros(2, 8))


def test_context_parallel_identity_at_one_rank():
    from megatron_plugin.layers.context_parallel import gather_sequence, shard_sequence

    batch = {"input_ids": torch.arange(12).view(2, 6), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    out = shard_sequence(batch, 1, 0)
    assert out is batch and out["input_ids"] is batch["input_ids"]
    k, v = torch.randn(6, 2, 2, 4), torch.randn(6, 2, 2, 4)
    gk, gv = gather_sequence(k, v, 1)
    assert gk is k and gv is v


def test_context_parallel_refused_with_the_setting_named():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.errors import MegatronPluginConfigError
    from megatron_plugin.layers.attention import SDPAttention
    from megatron_plugin.layers.context_parallel import gather_sequence, shard_sequence

    k = torch.zeros(4, 1, 1, 2)
    for call in (lambda: shard_sequence({"input_ids": torch.zeros(1, 4)}, 2, 1), lambda: gather_sequence(k, k, 2),
                 lambda: SDPAttention(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                                        context_parallel_size=2), 1, AttnMaskType.causal, "self")):
        with pytest.raises(MegatronPluginConfigError, match="context_parallel_size=2") as e:
            call()
        assert e.value.setting == "context_parallel_size" and e.value.value == 2


@pytest.mark.parametrize("causal", [True, False])
def test_attention_unchanged_through_the_gather(causal, monkeypatch):
    """SDPAttention's output equals SDPA's on the same tensors, and its keys and values pass through
    `gather_sequence` (one rank: untouched)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.layers import attention, context_parallel

    seen = []

    def spy(key, value, cp_size):
        seen.append((key, value, cp_size))
        return context_parallel.gather_sequence(key, value, cp_size)

    monkeypatch.setattr(attention, "gather_sequence", spy)
    heads, groups, d, s, b = 4, 2, 8, 6, 2
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=d, attention_dropout=0.0)
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    attn = attention.SDPAttention(cfg, 1, mask_type, "self").eval()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = torch.randn(s, b, groups, d, generator=g), torch.randn(s, b, groups, d, generator=g)
    got = attn(q, k, v, None)
    assert len(seen) == 1 and seen[0][0] is k and seen[0][1] is v and seen[0][2] == 1
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)))
    want = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5
