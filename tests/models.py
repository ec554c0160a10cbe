"""Tiny random HF models, built locally (no hub)."""

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
