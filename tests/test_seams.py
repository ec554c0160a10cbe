"""The model-side seams MoE uses (issue 25, item 5): the layer spec takes an MoE MLP and mapping rules
expand an expert index. (Context parallelism's seams: tests/test_context_parallel.py.)"""

import pytest
import torch

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
