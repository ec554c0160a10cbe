"""The plugin's model settings on CPU: dropouts into every family's TransformerConfig and forward, the attention
backend's SDPA kernels, the fp32 softmax, rotary positions, Megatron-LM's sequence lengths, an uneven last
pipeline stage (stage plans against megatron-core's own layer offsets), and the refusals of what the HF
model cannot honour."""

import os

import pytest
import torch

from tests.errors import check_refusal, refusal
from tests.models import gpt2_config, llama_config, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from tests.spawn import run_on_ranks

FAMILIES = {"gpt2": lambda: tiny_gpt2("tied"), "llama": lambda: tiny_llama("llama"),
            "bert": lambda: tiny_bert("bert", "mlm"), "t5": lambda: tiny_t5("t5_v1_0")}
# each HF config's own dropouts, made non-zero: (attention, hidden) as the family maps them
HF_DROPOUTS = {
    "gpt2": (dict(attn_pdrop=0.11, resid_pdrop=0.13, embd_pdrop=0.13), (0.11, 0.13)),
    "llama": (dict(attention_dropout=0.11), (0.11, 0.0)),
    "bert": (dict(attention_probs_dropout_prob=0.11, hidden_dropout_prob=0.13), (0.11, 0.13)),
    "t5": (dict(dropout_rate=0.13), (0.13, 0.13)),
}


def _forward(model, family, ids):
    """The model's output (logits) for a fixed batch, HF inputs."""
    if family == "t5":
        return model(ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids[:, :5])
    if family == "bert":
        return model(ids, attention_mask=torch.ones_like(ids))[0]
    return model(ids)


def _dropout_worker():
    from megatron_plugin import MegatronLMPlugin
    from tests.models import megatron_twin

    out = {}
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    for family, build in FAMILIES.items():
        hf = build()
        for key, value in HF_DROPOUTS[family][0].items():
            setattr(hf.config, key, value)
        for name, kwargs in (("hf", {}), ("off", dict(attention_dropout=0.0, hidden_dropout=0.0)),
                             ("on", dict(attention_dropout=0.3, hidden_dropout=0.2))):
            model = megatron_twin(hf, MegatronLMPlugin(**kwargs))
            with torch.no_grad():
                model.eval()
                ref = _forward(model, family, ids)
                model.train()
                torch.manual_seed(1)
                train = _forward(model, family, ids)
            out[(family, name)] = dict(config=(model.config.attention_dropout, model.config.hidden_dropout),
                                       same_as_eval=torch.equal(train, ref), diff=(train - ref).abs().max().item())
    return out


def test_dropouts_reach_every_family():
    """None keeps the HF config's dropouts; a value replaces them: 0.0 makes a training forward the eval one,
    bit for bit (attention, residual, embedding and T5's MLP and stack dropouts all read it); > 0 changes it."""
    ((got,),) = [run_on_ranks(_dropout_worker, 1)]
    for family, (_, hf_values) in HF_DROPOUTS.items():
        assert got[(family, "hf")]["config"] == pytest.approx(hf_values), family
        assert not got[(family, "hf")]["same_as_eval"], family  # the HF config's dropout is on
        assert got[(family, "off")]["config"] == (0.0, 0.0) and got[(family, "off")]["same_as_eval"], (family, got)
        assert got[(family, "on")]["config"] == pytest.approx((0.3, 0.2)), family
        assert got[(family, "on")]["diff"] > 1e-3, (family, got)


def test_dropout_conflicting_with_other_megatron_args_is_refused():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model

    plugin = MegatronLMPlugin(attention_dropout=0.1, other_megatron_args={"attention_dropout": 0.2})
    check_refusal(refusal(check_model, plugin, gpt2_config()), "other_megatron_args['attention_dropout']", "0.1")
    same = MegatronLMPlugin(attention_dropout=0.1, other_megatron_args={"attention_dropout": 0.1})
    assert refusal(check_model, same, gpt2_config()) is None


# -- attention: kernels and softmax precision -----------------------------------------------------------------
def _attention(backend, training=False, dropout=0.0):
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_plugin.layers.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=dropout,
                               attention_backend=AttnBackend[backend], use_cpu_initialization=True)
    return SDPAttention(config, 1, AttnMaskType.causal, "self").train(training)


def _qkv():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(10, 2, 4, 16, generator=g) for _ in range(3)]  # [s, b, heads, dim]


def _reference(kernel, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    with sdpa_kernel([getattr(SDPBackend, kernel)]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=16 ** -0.5)
    return out.permute(2, 0, 1, 3).reshape(10, 2, 64)


def test_attention_backend_picks_the_sdpa_kernel():
    """'unfused' and 'local' run torch's math path, 'flash' its flash kernel (CPU has one), 'auto' torch's
    choice: each bit for bit the kernel's own result; math and flash differ in rounding, so the choice shows."""
    q, k, v = _qkv()
    with torch.no_grad():
        got = {b: _attention(b)(q, k, v, None) for b in ("auto", "flash", "unfused", "local")}
        math, flash = _reference("MATH", q, k, v), _reference("FLASH_ATTENTION", q, k, v)
    assert torch.equal(got["unfused"], math) and torch.equal(got["local"], math)
    assert torch.equal(got["flash"], flash)
    assert not torch.equal(math, flash) and (math - flash).abs().max() < 1e-5
    auto = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                            is_causal=True, scale=16 ** -0.5)
    assert torch.equal(got["auto"], auto.permute(2, 0, 1, 3).reshape(10, 2, 64))


def test_a_kernel_that_cannot_run_the_attention_is_named():
    from megatron_plugin import MegatronPluginConfigError

    q, k, v = _qkv()
    with pytest.raises(MegatronPluginConfigError, match="'auto'") as err:
        _attention("flash", training=True, dropout=0.1)(q, k, v, None)  # torch's CPU flash kernel has no dropout
    assert err.value.setting == "attention_backend" and err.value.value == "flash"


def _backend_worker():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.layers.attention import SDPAttention
    from tests.models import megatron_twin

    hf = tiny_gpt2("tied")
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    out = {}
    for backend in ("unfused", "flash", True):
        for key in [k for k in os.environ if k.startswith("NVTE_")]:
            del os.environ[key]  # megatron-core sets TE's switches from the backend and refuses to change them
        model = megatron_twin(hf, MegatronLMPlugin(attention_backend=backend)).eval()
        kernels = {m.kernels and tuple(k.name for k in m.kernels) for m in model.modules()
                   if isinstance(m, SDPAttention)}
        with torch.no_grad():
            err = (model(ids) - ref).abs().max().item()
        out[str(backend)] = (model.config.attention_backend.name, kernels, err)
    return out


def test_attention_backend_reaches_every_layer():
    ((got,),) = [run_on_ranks(_backend_worker, 1)]
    assert got["unfused"][:2] == ("unfused", {("MATH",)})
    assert got["flash"][:2] == ("flash", {("FLASH_ATTENTION",)})
    assert got["True"][:2] == ("auto", {None})  # accelerate's bool: torch picks, as 'auto'
    for backend, (_, _, err) in got.items():
        assert err < 1e-5, (backend, err)


def test_attention_settings_refused_by_name():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model

    check_refusal(refusal(check_model, MegatronLMPlugin(attention_softmax_in_fp32=False), gpt2_config()),
                  "attention_softmax_in_fp32", "fp32", "leave it True")
    if not torch.cuda.is_available():
        check_refusal(refusal(check_model, MegatronLMPlugin(attention_backend="fused"), gpt2_config()),
                      "attention_backend", "CUDA", "'unfused'")
        check_refusal(refusal(check_model, MegatronLMPlugin(attention_backend="flash"), gpt2_config(attn_pdrop=0.1)),
                      "attention_backend", "dropout", "attention_dropout=0.0")
    check_refusal(refusal(check_model, MegatronLMPlugin(attention_backend="flash"), tiny_t5("t5_v1_0").config),
                  "attention_backend", "relative position biases")
    plugin = MegatronLMPlugin(attention_backend="unfused", other_megatron_args={"attention_backend": "flash"})
    check_refusal(refusal(check_model, plugin, gpt2_config()), "other_megatron_args['attention_backend']", "'unfused'")
    check_refusal(refusal(check_model, MegatronLMPlugin(other_megatron_args={"attention_backend": "cudnn"}),
                          gpt2_config()), "other_megatron_args['attention_backend']", "'flash'", exact=True)
    for ok in ("auto", "unfused", "local", "flash", True, False):
        assert refusal(check_model, MegatronLMPlugin(attention_backend=ok), gpt2_config()) is None, ok


# -- positions and sequence lengths ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,value", [("gpt2", True), ("bert", True), ("t5", True), ("llama", False)])
def test_rotary_setting_contradicting_the_model_is_refused(family, value):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model

    cfg = FAMILIES[family]().config
    check_refusal(refusal(check_model, MegatronLMPlugin(use_rotary_position_embeddings=value), cfg),
                  "use_rotary_position_embeddings", "fixed by its weights", "leave it unset")
    for ok in (None, not value):
        assert refusal(check_model, MegatronLMPlugin(use_rotary_position_embeddings=ok), cfg) is None


def test_sequence_lengths():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import get_family
    from megatron_plugin.models.fields import sequence_lengths

    def lengths(cfg, **kwargs):
        return sequence_lengths(MegatronLMPlugin(**kwargs), get_family(cfg), cfg)

    gpt2, bert, t5 = gpt2_config(), tiny_bert().config, tiny_t5().config
    # decoder-only: one length, by any of the three names (accelerate's GPT-2 parser reads decoder_seq_length)
    assert lengths(gpt2) == dict(seq_length=32, encoder_seq_length=32, decoder_seq_length=None)
    for name in ("seq_length", "encoder_seq_length", "decoder_seq_length"):
        assert lengths(gpt2, **{name: 16})["seq_length"] == 16, name
    assert lengths(gpt2, seq_length=16, encoder_seq_length=16)["encoder_seq_length"] == 16
    check_refusal(refusal(lengths, gpt2, seq_length=16, encoder_seq_length=24), "seq_length / encoder_seq_length",
                  "(16, 24)", "set one")
    check_refusal(refusal(lengths, gpt2, encoder_seq_length=64), "encoder_seq_length", "32 positions")
    assert lengths(llama_config(), seq_length=4096)["seq_length"] == 4096  # rotary: no table to outgrow
    # BERT: an encoder
    assert lengths(bert, encoder_seq_length=24)["seq_length"] == 24
    check_refusal(refusal(lengths, bert, decoder_seq_length=24), "decoder_seq_length", "no decoder")
    # T5: encoder and decoder lengths
    assert lengths(t5, encoder_seq_length=24, decoder_seq_length=8) == dict(
        seq_length=24, encoder_seq_length=24, decoder_seq_length=8)
    assert lengths(t5, seq_length=24)["decoder_seq_length"] == 512


# -- an uneven last pipeline stage ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,pp,last", [(7, 3, 1), (5, 2, 2), (9, 4, 3), (4, 2, 1), (6, 3, 2)])
def test_uneven_last_stage_plans_match_megatron_core(num_layers, pp, last):
    """Each stage's HF layers (StagePlan) are the layers megatron-core builds there (get_num_layers_to_build,
    get_transformer_layer_offset) from the TransformerConfig the plugin gives, for every pipeline rank."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model, get_family
    from megatron_plugin.models.gpt import build_transformer_config
    from megatron_plugin.models.mapping import StagePlan

    cfg = gpt2_config(n_layer=num_layers)
    plugin = MegatronLMPlugin(pp_degree=pp, decoder_last_pipeline_num_layers=last)
    check_model(plugin, cfg, world_size=pp)
    config = build_transformer_config(get_family(cfg), cfg, plugin)
    assert config.num_layers_in_last_pipeline_stage == last and config.num_layers_in_first_pipeline_stage is None
    covered = []
    for rank in range(pp):
        plan = StagePlan.for_rank(num_layers, pp, rank, last_stage_layers=config.num_layers_in_last_pipeline_stage)
        assert plan.num_layers == get_num_layers_to_build(config, None, rank), rank
        assert plan.layer_offset == get_transformer_layer_offset(config, None, rank), rank
        assert (plan.first, plan.last) == (rank == 0, rank == pp - 1)
        covered += range(plan.layer_offset, plan.layer_offset + plan.num_layers)
    assert covered == list(range(num_layers))
    assert StagePlan.for_rank(num_layers, pp, pp - 1, last_stage_layers=last).num_layers == last


def test_uneven_last_stage_refusals():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model

    cfg = gpt2_config(n_layer=7)
    check_refusal(refusal(check_model, MegatronLMPlugin(pp_degree=3, decoder_last_pipeline_num_layers=2), cfg),
                  "decoder_last_pipeline_num_layers", "5 layers", "multiple of 2")
    check_refusal(refusal(check_model, MegatronLMPlugin(pp_degree=3, decoder_last_pipeline_num_layers=6), cfg),
                  "decoder_last_pipeline_num_layers", "at least one each")
    check_refusal(refusal(check_model, MegatronLMPlugin(decoder_last_pipeline_num_layers=1), cfg),
                  "decoder_last_pipeline_num_layers", "pp_degree > 1")
    vpp = MegatronLMPlugin(pp_degree=2, decoder_last_pipeline_num_layers=1, num_layers_per_virtual_pipeline_stage=1)
    check_refusal(refusal(check_model, vpp, gpt2_config(n_layer=5)), "decoder_last_pipeline_num_layers", "virtual")
    for key, value in (("num_layers_in_first_pipeline_stage", 3), ("num_layers_in_last_pipeline_stage", 2),
                       ("account_for_loss_in_pipeline_split", True)):
        plugin = MegatronLMPlugin(pp_degree=3, decoder_last_pipeline_num_layers=1, other_megatron_args={key: value})
        check_refusal(refusal(check_model, plugin, cfg), f"other_megatron_args[{key!r}]", "remove the key")
    # 7 layers over 3 stages: even is impossible, 3 + 3 + 1 is Megatron's uneven split
    assert refusal(check_model, MegatronLMPlugin(pp_degree=3), cfg) is not None
    assert refusal(check_model, MegatronLMPlugin(pp_degree=3, decoder_last_pipeline_num_layers=1), cfg) is None


def test_per_token_loss_reaches_the_transformer_config():
    """megatron-core's DDP (sum over data-parallel ranks) and schedules (token count to finalize_model_grads) read
    it there on the CUDA engine; other_megatron_args cannot set it behind the train step's back."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models import check_model, get_family
    from megatron_plugin.models.gpt import build_transformer_config

    cfg = gpt2_config()
    for value in (True, False):
        config = build_transformer_config(get_family(cfg), cfg, MegatronLMPlugin(calculate_per_token_loss=value))
        assert config.calculate_per_token_loss is value
    check_refusal(refusal(check_model, MegatronLMPlugin(other_megatron_args={"calculate_per_token_loss": True}), cfg),
                  "other_megatron_args['calculate_per_token_loss']", "calculate_per_token_loss=")
