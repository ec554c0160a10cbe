"""Tiny random HF models, built locally (no hub), and the helpers that compare one with its Megatron-Core
twin (the parity tests' workers)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

# vocab sizes deliberately not multiples of 128 * tp, so padding rows are exercised
GPT2_CONFIGS = {
    "tied": dict(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2, n_head=4),
    "untied": dict(vocab_size=333, n_positions=32, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False),
}


def gpt2_config(name="tied", **overrides):
    kwargs = dict(GPT2_CONFIGS[name], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_gpt2(name="tied", lm_head=True, seed=0, **overrides):
    torch.manual_seed(seed)
    cls = GPT2LMHeadModel if lm_head else GPT2Model
    model = cls(gpt2_config(name, **overrides)).float()
    # HF's init leaves biases and norms at 0/1; randomize them so a mapping slip shows up.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# The Llama family, tiny and odd on purpose: vocabulary 333, 4 query heads per key/value head, 2 KV heads
# (fewer than TP=4), head_dim != hidden / heads, llama3 and linear rope scaling, biases, q/k norms, a window.
LLAMA_CONFIGS = {
    "llama": ("llama", dict(vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                            rope_theta=500000.0, tie_word_embeddings=False,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_tied_linear": ("llama", dict(vocab_size=333, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("mistral", dict(vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
                                sliding_window=5, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                            tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=False)),
}


def llama_config(name="llama", **overrides):
    from transformers import AutoConfig

    model_type, kwargs = LLAMA_CONFIGS[name]
    kwargs = dict(kwargs, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_llama(name="llama", lm_head=True, seed=0, **overrides):
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = llama_config(name, **overrides)
    cfg._attn_implementation = "sdpa"
    model = (AutoModelForCausalLM if lm_head else AutoModel).from_config(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms start at 1, biases at 0: randomize so a mapping slip shows
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# MoE families, tiny: 8 experts, top-2, odd vocabulary, 2 KV heads; Qwen2-MoE with its shared expert, QKV bias
# and a dense second layer (mlp_only_layers), top-k not renormalized; Qwen3-MoE renormalized, with q/k norms
MOE_CONFIGS = {
    "mixtral": ("mixtral", dict(vocab_size=333, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen2_moe": ("qwen2_moe", dict(vocab_size=333, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                                    norm_topk_prob=False, max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=333, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                    max_position_embeddings=64, tie_word_embeddings=True)),
}


def moe_config(name="mixtral", **overrides):
    from transformers import AutoConfig

    model_type, kwargs = MOE_CONFIGS[name]
    kwargs = dict(kwargs, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_moe(name="mixtral", lm_head=True, seed=0, **overrides):
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = moe_config(name, **overrides)
    cfg._attn_implementation = "sdpa"
    model = (AutoModelForCausalLM if lm_head else AutoModel).from_config(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:  # norms start at 1, biases at 0: randomize so a mapping slip shows
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith("gate.weight") and "shared" not in n:
                # a router decisive enough that no two experts tie for a token's k-th place
                p.copy_(torch.randn_like(p))
    return model.eval()


# BERT: post-LN `bert` and pre-LN `megatron-bert`, odd vocabulary, tied and untied MLM decoder
BERT_CONFIGS = {
    "bert": ("bert", dict(vocab_size=333, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          max_position_embeddings=32, type_vocab_size=2)),
    "bert_untied": ("bert", dict(vocab_size=333, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=32, type_vocab_size=2,
                                 tie_word_embeddings=False, hidden_act="gelu_new")),
    "megatron_bert": ("megatron-bert", dict(vocab_size=333, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, max_position_embeddings=32, type_vocab_size=2)),
}
BERT_CLASSES = {
    "bert": {"pretraining": "BertForPreTraining", "mlm": "BertForMaskedLM", "base": "BertModel"},
    "megatron-bert": {"pretraining": "MegatronBertForPreTraining", "mlm": "MegatronBertForMaskedLM",
                      "base": "MegatronBertModel"},
}


def tiny_bert(name="bert", variant="mlm", seed=0, **overrides):
    import transformers
    from transformers import AutoConfig

    torch.manual_seed(seed)
    model_type, kwargs = BERT_CONFIGS[name]
    cfg = AutoConfig.for_model(model_type, **dict(kwargs, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                  pad_token_id=0, **overrides))
    model = getattr(transformers, BERT_CLASSES[model_type][variant])(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# T5: v1.0 (ReLU, tied head, output scaling) and v1.1 (gated GELU, untied in transformers 4), odd vocabulary,
# d_kv * heads != d_model, more decoder than encoder layers
T5_CONFIGS = {
    "t5_v1_0": dict(vocab_size=333, d_model=64, d_kv=8, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4,
                    feed_forward_proj="relu", tie_word_embeddings=True, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16),
    "t5_v1_1": dict(vocab_size=333, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                    feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16),
}


def tiny_t5(name="t5_v1_0", lm_head=True, seed=0, **overrides):
    from transformers import T5Config, T5ForConditionalGeneration, T5Model

    torch.manual_seed(seed)
    cfg = T5Config(**dict(T5_CONFIGS[name], dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, **overrides))
    model = (T5ForConditionalGeneration if lm_head else T5Model)(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


# -- parity with the Megatron-Core twin --------------------------------------------------------------
def max_rel(a, b, floor=1e-12):
    """max |a - b| relative to max |b|, the latter at least `floor`."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


def padded_ids(vocab, low, left_pads, seq=12):
    """Three seeded rows of ids in [low, vocab), a right-padding mask (rows 0 and 2 padded) and a
    left-padding mask with `left_pads[row]` pads in front of each row it names."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(low, vocab, (3, seq), generator=g)
    right = torch.ones(3, seq, dtype=torch.long)
    right[0, 8:] = 0
    right[2, 5:] = 0
    left = torch.ones(3, seq, dtype=torch.long)
    for row, pads in left_pads.items():
        left[row, :pads] = 0
    return ids, right, left


def megatron_twin(hf, plugin):
    """This rank's Megatron-Core model of `hf`, with the process groups of `plugin` initialized."""
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel

    initialize(plugin, hf.config)
    return MegatronModel.from_hf(hf, plugin)


def token_mean(per_token, labels):
    """HF's mean cross-entropy from Megatron's per-token losses: over the positions labelled, not -100."""
    keep = (labels != -100).float()
    return (per_token * keep).sum() / keep.sum()


def grad_parity(grads, hf, floor=1e-12, reached_only=False):
    """(same names, max relative difference) of `grads` (HF name -> full gradient, from the twin) and the
    gradients on `hf`'s parameters: those `grads` names, or with `reached_only` every one HF's backward
    reached."""
    ref = {k: p.grad for k, p in hf.named_parameters() if (p.grad is not None if reached_only else k in grads)}
    return set(ref) == set(grads), max(max_rel(grads[k], ref[k], floor) for k in ref)


def decoder_parity(build, names, cases, grad_case, **hf_kwargs):
    """A launched rank's parity worker for causal LMs under TP = WORLD_SIZE: each tiny HF model
    `build(name, lm_head=...)` of `names`, with and without its head, against its twin. `cases(vocab)`:
    (case, input_ids, attention_mask, position_ids, valid positions), each compared forward (HF gets
    `hf_kwargs` too); the gradients of a padded cross-entropy are compared on the case named `grad_case`.
    Returns {(name, lm_head): {fwd_<case>, shape_ok, roundtrip_keys_equal, roundtrip_bit_exact,
    grad_names_equal, grad_max_rel}}."""
    import os

    from megatron_plugin import MegatronLMPlugin

    tp = int(os.environ["WORLD_SIZE"])
    plugin = MegatronLMPlugin(tp_degree=tp)
    out = {}
    for name in names:
        for lm_head in (True, False):
            hf = build(name, lm_head=lm_head)
            model = megatron_twin(hf, plugin).eval()
            res = {}
            for case, ids, mask, pos, valid in cases(hf.config.vocab_size):
                with torch.no_grad():
                    ref = hf(ids, attention_mask=mask, position_ids=pos, **hf_kwargs)
                    ref = ref.logits if lm_head else ref.last_hidden_state
                    got = model(ids, attention_mask=mask, position_ids=pos)
                res[f"fwd_{case}"] = (got - ref).abs()[valid].max().item()
                res["shape_ok"] = res.get("shape_ok", True) and got.shape == ref.shape

            # Round trip: HF -> Megatron(TP) -> HF, exact.
            back = model.hf_state_dict()
            tied = hf.config.tie_word_embeddings
            ref_sd = {k: v for k, v in hf.state_dict().items() if not (k == "lm_head.weight" and tied)}
            res["roundtrip_keys_equal"] = set(back) == set(ref_sd)
            res["roundtrip_bit_exact"] = all(torch.equal(back[k], ref_sd[k]) for k in ref_sd if k in back)

            if lm_head:
                # Gradients of a padded cross-entropy loss w.r.t. every HF parameter.
                _, ids, mask, pos, _ = next(c for c in cases(hf.config.vocab_size) if c[0] == grad_case)
                labels = ids.masked_fill(mask == 0, -100)
                hf.zero_grad()
                hf(ids, attention_mask=mask, position_ids=pos, labels=labels).loss.backward()
                shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
                per_token = model(ids, attention_mask=mask, position_ids=pos, labels=shifted)
                model.zero_grad()
                token_mean(per_token, shifted).backward()
                if tp > 1:  # q/k norms see only this rank's heads: the engines sum their grads over TP
                    import torch.distributed as dist
                    from megatron.core import parallel_state

                    for n, p in model.module.named_parameters():
                        if "q_layernorm" in n or "k_layernorm" in n:
                            dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
                res["grad_names_equal"], res["grad_max_rel"] = grad_parity(model.hf_state_dict(grads=True), hf)
            out[(name, lm_head)] = res
    return out


def check_decoder_parity(results, names, cases, world_size):
    """What each rank's `decoder_parity` must show: every model of `names`, the forward of every one of
    `cases` within 1e-4, the round trip bit for bit, the gradients within 1e-4 relative."""
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == 2 * len(names)
        for (name, lm_head), res in per_rank.items():
            where = f"rank {rank}/{world_size}, {name}, lm_head={lm_head}"
            assert res["shape_ok"], where
            for case in cases:
                assert res[f"fwd_{case}"] < 1e-4, (where, case, res)
            assert res["roundtrip_keys_equal"] and res["roundtrip_bit_exact"], (where, res)
            if lm_head:
                assert res["grad_names_equal"], where
                assert res["grad_max_rel"] < 1e-4, (where, res)
