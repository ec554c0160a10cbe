"""LoRA on the Megatron twin (issue 29) against the HF peft model, on CPU: logits, adapter gradients, the
frozen base, the peft tensors' round trip, the adapter folder peft loads, merged weights, refusals.

The twin is built as `prepare` builds it, without the engine: the base weights from `base_state_dict`,
then `attach_lora` + `load_lora` with the peft model's tensors. Every B starts non-zero
(`init_lora_weights=False`), so a misplaced or mis-split adapter changes the logits."""

import pytest
import torch

from tests.models import max_rel, padded_ids, tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]


def _hf(family, seed=0):
    from tests.models import tiny_moe

    if family in ("mixtral", "qwen2_moe"):
        return tiny_moe(family, seed=seed)
    if family == "gpt2_tied":
        return tiny_gpt2("tied", seed=seed)
    return tiny_llama("llama", seed=seed) if family == "llama" else tiny_gpt2("untied", seed=seed)


def _peft(family, targets, seed=0, **config):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 100)
    config = {"init_lora_weights": False, **config}
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), **config)
    return get_peft_model(_hf(family, seed), cfg)


def _twin(pm, plugin):
    """This rank's Megatron model of peft model `pm`, adapters on and loaded."""
    from peft import get_peft_model_state_dict

    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.lora import attach_lora, base_state_dict, load_lora, lora_spec_of
    from megatron_plugin.models.modeling import MegatronModel

    spec = lora_spec_of(pm)
    hf = pm.get_base_model()
    initialize(plugin, hf.config)
    model = MegatronModel(hf.config, plugin, variant="lm")
    model.load_hf_state_dict(base_state_dict(pm))
    attach_lora(model, spec)
    load_lora(model, get_peft_model_state_dict(pm))
    return model, spec


def _peft_grads(pm):
    return {n.replace(".modules_to_save.default.", ".").replace(".default.weight", ".weight"): p.grad
            for n, p in pm.named_parameters() if p.requires_grad}


def _checkpoint_keys(model, spec):
    """(peft module name, sharded-state-dict key, 'A' or 'B') of layer 0's adapters whose whole shape the
    checkpoint must show (GPT-2's c_attn B: regrouped, same shape)."""
    from megatron_plugin.models.lora import _layer_targets

    out = []
    for target in _layer_targets(model, spec, 0):
        hf = ("transformer.h.0." if spec.family == "gpt2" else "model.layers.0.") + target.hf
        for x in "AB":
            out.append((hf, f"decoder.layers.0.{target.linear}.lora_adapters.{target.leaf}.lora_{x}", x))
    return out


def _case(family, targets, sp=False, save_dir=None, **config):
    """One model: logits and gradients vs peft; frozen base; round trip; with `save_dir`, the adapter
    folder and merged weights too."""
    import copy
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from peft import get_peft_model_state_dict

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.lora import lora_hf_state_dict, merged_hf_weights, save_adapter

    tp = int(os.environ["WORLD_SIZE"])
    pm = _peft(family, targets, **config)
    model, spec = _twin(pm, MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp))
    model.eval()
    pm.eval()
    ids, mask, _ = padded_ids(pm.config.vocab_size, 3, {}, 12)
    res = {}
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask)
    valid = mask.bool()
    res["logits"] = (got - ref).abs()[valid].max().item()
    # the adapters matter: the base model's logits are far from the adapted ones; switched off, ours are the base's
    from megatron_plugin.layers.lora import lora_disabled

    with torch.no_grad(), pm.disable_adapter():
        base_ref = pm(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad(), lora_disabled(model.module):
        res["disabled_logits"] = (model(ids, attention_mask=mask) - base_ref).abs()[valid].max().item()
    res["adapters_matter"] = (base_ref - ref).abs()[valid].max().item()

    # gradients of a padded cross-entropy
    labels = ids.masked_fill(mask == 0, -100)
    pm.zero_grad()
    pm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    per_token = model(ids, attention_mask=mask, labels=shifted)
    keep = (shifted != -100).float()
    ((per_token * keep).sum() / keep.sum()).backward()
    if tp > 1:  # a replicated parameter computed from this rank's sequence only (SP): the engines sum over TP
        for p in model.module.parameters():
            if p.grad is not None and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
    grads = lora_hf_state_dict(model, grads=True)
    ref_grads = _peft_grads(pm)
    res["grad_names_equal"] = set(grads) == set(ref_grads)
    res["grad_max_rel"] = max(max_rel(grads[k], ref_grads[k]) for k in ref_grads if k in grads)
    from megatron_plugin.models.lora import lora_param_sources

    sources = lora_param_sources(model)
    res["sources"] = (set(sources) == {n for n in dict(model.module.named_parameters()) if ".lora_adapters." in n}
                      and {s for (s,) in sources.values()} == {n for n, _ in pm.named_parameters() if ".lora_" in n})
    trainable = {n for n, p in model.module.named_parameters() if p.requires_grad}
    res["only_adapters_train"] = all(".lora_adapters." in n or n.startswith("output_layer") for n in trainable) and bool(trainable)
    res["base_has_no_grad"] = all(p.grad is None for n, p in model.module.named_parameters() if not p.requires_grad)

    # peft's tensors -> ours -> peft's, bit for bit
    mine = lora_hf_state_dict(model)
    theirs = get_peft_model_state_dict(pm)
    res["roundtrip_keys"] = set(mine) == set(theirs)
    res["roundtrip_exact"] = all(torch.equal(mine[k], theirs[k]) for k in theirs if k in mine)

    # a distributed checkpoint holds each adapter whole: the split tensors sharded over TP like the weights
    sharded = model.module.sharded_state_dict()
    shapes = {k: tuple(v.global_shape)[-2:] for k, v in sharded.items() if ".lora_adapters." in k}  # after the layer axis
    res["checkpoint_shapes"] = all(
        shapes.get(k) == tuple(theirs[f"base_model.model.{m}.lora_{x}.weight"].shape)
        for m, k, x in _checkpoint_keys(model, spec))
    if {"q_proj", "k_proj", "v_proj"} & set(targets) == {"q_proj"}:  # a q-only adapter writes the query rows only
        from megatron_plugin.layers.lora import lora_delta

        linear = model.module.decoder.layers[0].self_attention.linear_qkv
        x = torch.randn(5, 2, linear.input_size)
        delta = lora_delta(linear, x)  # under SP: the whole sequence
        delta = delta.reshape(*delta.shape[:-1], linear.lora_part_groups, -1)
        q = linear.lora_part_sizes[0]
        res["q_rows_only"] = bool(delta[..., q:].abs().max() == 0 and delta[..., :q].abs().max() > 0)

    if save_dir is not None:
        from peft import PeftModel

        base = model.hf_state_dict()
        merged = merged_hf_weights(base, mine, spec)
        from megatron_plugin.models.moe_names import checkpoint_state_dict

        ref_merged = checkpoint_state_dict(copy.deepcopy(pm).merge_and_unload())  # an MoE model's experts apart
        res["merged_keys"] = set(ref_merged) - set(merged) <= {"lm_head.weight"} and set(merged) <= set(ref_merged)
        res["merged_max"] = max((merged[k] - ref_merged[k]).abs().max().item() for k in merged)
        if dist.get_rank() == 0:
            save_adapter(save_dir, spec, mine, base_name_or_path="tiny")
        dist.barrier()
        loaded = PeftModel.from_pretrained(_hf(family), save_dir).eval()
        with torch.no_grad():
            res["saved_logits"] = (loaded(input_ids=ids, attention_mask=mask).logits - got).abs()[valid].max().item()
    return res


def _worker(cases, save_root=None):
    out = {}
    for name, family, targets, sp, config in cases:
        # the process groups stay for every case (sequence parallelism is the model config's)
        out[name] = _case(family, targets, sp, None if save_root is None else f"{save_root}/{name}", **config)
    return out


CASES = {
    1: [("llama_all", "llama", LLAMA_ALL, False, {}),
        ("gpt2_all", "gpt2", GPT2_ALL, False, {}),
        # layer 0 is MoE (the shared expert's gate/up/down), layer 1 dense (mlp_only_layers: the dense MLP's)
        ("qwen2_moe_mlp", "qwen2_moe", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], False, {})],
    2: [("llama_all", "llama", LLAMA_ALL, False, {}),
        ("llama_q_sp", "llama", ["q_proj"], True, {}),
        ("llama_all_sp_rslora", "llama", LLAMA_ALL, True, dict(use_rslora=True)),
        ("gpt2_all_head", "gpt2", GPT2_ALL, False, dict(modules_to_save=["lm_head"])),
        ("mixtral_attention", "mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"], False, {}),
        ("qwen2_moe_up_down", "qwen2_moe", ["o_proj", "up_proj", "down_proj"], False, {})],
}


def _check(res, name):
    assert res["adapters_matter"] > 1e-2, name
    assert res["logits"] < 1e-4, (name, res["logits"])
    assert res["disabled_logits"] < 1e-4, (name, res["disabled_logits"])
    assert res["grad_names_equal"], name
    assert res["grad_max_rel"] < 1e-4, (name, res["grad_max_rel"])
    assert res["only_adapters_train"] and res["base_has_no_grad"], name
    assert res["roundtrip_keys"] and res["roundtrip_exact"], name
    assert res["checkpoint_shapes"], name
    assert res["sources"], name
    if "q_rows_only" in res:
        assert res["q_rows_only"], name
    if "merged_max" in res:
        assert res["merged_keys"], name
        assert res["merged_max"] < 1e-6, (name, res["merged_max"])
        assert res["saved_logits"] < 1e-5, (name, res["saved_logits"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_lora_matches_peft_under_tensor_parallel(world_size, tmp_path):
    results = run_on_ranks(_worker, world_size, CASES[world_size], str(tmp_path) if world_size == 2 else None)
    for per_rank in results:
        assert set(per_rank) == {c[0] for c in CASES[world_size]}
        for name, res in per_rank.items():
            _check(res, name)
    if world_size == 2:
        assert any("merged_max" in r for r in results[0].values())


def _pipeline_roundtrip():
    """PP=2: each stage holds its layers' adapters (named by their global layer), and every rank gets
    every stage's back."""
    from peft import get_peft_model_state_dict

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.layers.lora import iter_adapters
    from megatron_plugin.models.lora import lora_hf_state_dict

    pm = _peft("llama", LLAMA_ALL, modules_to_save=["lm_head"])
    model, _ = _twin(pm, MegatronLMPlugin(pp_degree=2))
    mine, theirs = lora_hf_state_dict(model), get_peft_model_state_dict(pm)
    return (len(list(iter_adapters(model.module))), set(mine) == set(theirs),
            all(torch.equal(mine[k], theirs[k]) for k in theirs if k in mine))


def test_lora_round_trip_over_pipeline_stages():
    for adapters, keys, exact in run_on_ranks(_pipeline_roundtrip, 2):
        assert (adapters, keys, exact) == (len(LLAMA_ALL), True, True)


def _compiled_linears():
    """Each adapted linear (fused QKV, fused gate/up, a row linear) compiled whole (fullgraph) at TP=1:
    (max |compiled - eager|, the adapter got a gradient)."""
    from megatron_plugin import MegatronLMPlugin

    model, _ = _twin(_peft("llama", LLAMA_ALL), MegatronLMPlugin(tp_degree=1))
    layer = model.module.decoder.layers[0]
    out = {}
    for name in ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"):
        linear = layer.get_submodule(name)
        x = torch.randn(6, 2, linear.weight.shape[1], requires_grad=True)
        eager = linear(x)[0]
        compiled = torch.compile(lambda t: linear(t)[0], fullgraph=True, backend="aot_eager")(x)
        compiled.sum().backward()
        grads = [a.lora_A.grad is not None and a.lora_B.grad.abs().sum() > 0 for a in linear.lora_adapters.values()]
        out[name] = ((compiled - eager).abs().max().item(), all(grads))
    return out


def test_lora_linears_compile_without_graph_breaks():
    (out,) = run_on_ranks(_compiled_linears, 1)
    assert all(diff < 1e-6 and grads for diff, grads in out.values()), out


@pytest.mark.parametrize("family, targets, config, setting", [
    ("llama", ["q_proj"], dict(use_dora=True), "use_dora"),
    ("llama", ["q_proj"], dict(bias="all"), "bias"),
    ("llama", ["q_proj", "lm_head"], {}, "target_modules"),
    ("gpt2", ["c_attn", "wte"], {}, "target_modules"),
    ("llama", ["q_proj"], dict(layers_to_transform=[0]), "layers_to_transform"),
    ("llama", ["q_proj", "v_proj"], dict(rank_pattern={"v_proj": 8}), "rank_pattern"),
    ("llama", ["q_proj"], dict(modules_to_save=["rotary_emb"]), "modules_to_save"),
    ("llama", ["q_proj"], dict(init_lora_weights="pissa"), "init_lora_weights"),
    ("gpt2_tied", ["c_attn"], dict(modules_to_save=["wte"]), "modules_to_save"),
])
def test_lora_refusals_name_the_setting(family, targets, config, setting):
    from megatron_plugin.errors import MegatronPluginConfigError
    from megatron_plugin.models.lora import lora_spec_of

    with pytest.raises(MegatronPluginConfigError) as err:
        lora_spec_of(_peft(family, targets, **config))
    assert err.value.setting == setting


def test_lora_refuses_other_methods_and_several_adapters():
    from peft import IA3Config, LoraConfig, get_peft_model

    from megatron_plugin.errors import MegatronPluginConfigError
    from megatron_plugin.models.lora import lora_spec_of
    from tests.models import tiny_moe

    pm = _peft("llama", ["q_proj"])
    pm.add_adapter("other", LoraConfig(r=2, target_modules=["v_proj"]))
    with pytest.raises(MegatronPluginConfigError, match="peft_config"):
        lora_spec_of(pm)
    ia3 = get_peft_model(_hf("llama"), IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(MegatronPluginConfigError, match="peft_type"):
        lora_spec_of(ia3)
    moe = get_peft_model(tiny_moe("qwen2_moe"), LoraConfig(r=2, target_modules=["q_proj", "shared_expert_gate"]))
    with pytest.raises(MegatronPluginConfigError, match="shared_expert_gate.*router and shared-expert gate"):
        lora_spec_of(moe)  # the shared expert's sigmoid gate (an nn.Linear peft wraps)
    # transformers 5 stacks the routed experts (no nn.Linear): gate_proj is the shared expert's in MoE layers and
    # the dense MLP's in layer 1 (mlp_only_layers)
    moe = get_peft_model(tiny_moe("qwen2_moe"), LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    spec = lora_spec_of(moe)
    assert spec.layer_targets == ("mlp.gate_proj", "mlp.shared_expert.gate_proj", "self_attn.q_proj")
    assert [t.hf for t in spec.targets("moe")] == ["mlp.shared_expert.gate_proj", "self_attn.q_proj"]
    assert [t.hf for t in spec.targets("dense")] == ["mlp.gate_proj", "self_attn.q_proj"]
    with pytest.raises(MegatronPluginConfigError, match="model"):
        lora_spec_of(_hf("llama"))
    from megatron_plugin.models.lora import check_lora_layout

    spec = lora_spec_of(_peft("llama", ["k_proj"]))  # 2 KV heads: not over 4 TP ranks
    check_lora_layout(spec, _hf("llama").config, 2)
    with pytest.raises(MegatronPluginConfigError, match="tp_degree"):
        check_lora_layout(spec, _hf("llama").config, 4)
    spec = lora_spec_of(_peft("gpt2", ["c_proj"]))  # both of GPT-2's c_proj: the attention's and the MLP's
    assert spec.target_modules == ("c_proj",) and spec.layer_targets == ("attn.c_proj", "mlp.c_proj")


def test_a_compiled_peft_model_is_refused_with_the_fix():
    """torch.compile(PeftModel) hides the PeftModel (an OptimizedModule): prepare says to pass the PeftModel itself
    (it compiles the Megatron layers), instead of taking its weights as a plain model's."""
    from megatron_plugin.engine.lora import peft_inputs
    from megatron_plugin.errors import MegatronPluginConfigError

    pm = _peft("llama", ["q_proj"])
    with pytest.raises(MegatronPluginConfigError) as err:
        peft_inputs((torch.compile(pm),))
    assert err.value.setting == "model" and "pass the PeftModel itself" in str(err.value)
    args, run = peft_inputs((pm,))
    assert run is not None and args[0] is pm.get_base_model()
