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
