"""`megatron_generate`: text generation with the tensor-parallel model, as in the Megatron-LM guide.

Prompts are right-padded (attention_mask marks the tokens); every row continues from its own length.
Each step recomputes the whole prefix (no KV cache yet), so it suits short generations and tests.
Sampling is decided on TP rank 0 and broadcast, so all TP ranks write the same token.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def megatron_generate(engine, inputs: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      max_length: Optional[int] = None, max_new_tokens: Optional[int] = None,
                      num_beams: Optional[int] = None, temperature: Optional[float] = None,
                      top_k: Optional[int] = None, top_p: Optional[float] = None, top_p_decay: float = 0.0,
                      top_p_bound: float = 0.0, length_penalty: Optional[float] = None, add_BOS: bool = False,
                      eos_token_id: Optional[int] = None, **kwargs) -> torch.Tensor:
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise MegatronPluginConfigError("pp_degree", parallel_state.get_pipeline_model_parallel_world_size(),
                                        "megatron_generate supports pp_degree=1 so far")
    if engine.plugin.sequence_parallelism or engine.plugin.recompute_granularity:
        raise MegatronPluginConfigError("sequence_parallelism/recompute_activations", True,
                                        "megatron_generate needs both off, as Megatron-LM's does")
    if num_beams not in (None, 1):
        raise MegatronPluginConfigError("num_beams", num_beams, "beam search is not implemented yet; use greedy or sampling")
    if kwargs:
        raise MegatronPluginConfigError("megatron_generate", sorted(kwargs), "unknown arguments")
    model = engine.model
    cfg = model.hf_config
    device = engine.device
    tokens = inputs.to(device).long()
    mask = torch.ones_like(tokens) if attention_mask is None else attention_mask.to(device).long()
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    if add_BOS:
        bos = torch.full_like(tokens[:, :1], cfg.bos_token_id)
        tokens, mask = torch.cat([bos, tokens], 1), torch.cat([torch.ones_like(mask[:, :1]), mask], 1)
    lengths = mask.sum(1)
    if max_length is None:
        max_length = tokens.shape[1] + (max_new_tokens if max_new_tokens is not None else 20)
    max_length = min(max_length, model.family.max_positions(cfg))
    b = tokens.shape[0]
    out = torch.full((b, max_length), eos if eos is not None else 0, dtype=torch.long, device=device)
    out[:, : tokens.shape[1]] = tokens.masked_fill(mask == 0, eos if eos is not None else 0)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    greedy = not top_k and not top_p and temperature in (None, 1.0) or top_k == 1
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    was_training = engine.training
    engine.eval()
    try:
        for pos in range(int(lengths.min()), max_length):
            logits = model(out[:, :pos])[:, -1, :].float()  # the next-token logits of every row
            if greedy:
                nxt = logits.argmax(-1)
            else:
                logits = _filter_top_k_top_p(logits / (temperature or 1.0), top_k or 0, top_p or 0.0)
                nxt = torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
                if top_p and top_p_decay:
                    top_p = max(top_p * top_p_decay, top_p_bound)
            dist.broadcast(nxt, src=src, group=group)
            writing = (pos >= lengths) & ~done  # rows still inside their prompt keep the prompt token
            out[:, pos] = torch.where(writing, nxt, out[:, pos])
            if eos is not None:
                done |= writing & (nxt == eos)
                if bool(done.all()):
                    return out[:, : pos + 1]
    finally:
        engine.train(was_training)
    return out
