"""`megatron_generate`: text generation with the tensor- and pipeline-parallel model, with the signature
and semantics of the Megatron-LM guide (accelerate's `megatron_generate`).

- Prompts may be right- or left-padded (the attention mask says which tokens are real); the output puts
  each row's prompt first, then its new tokens, then padding (pad token, else the stop token), as
  Megatron-LM does. Rows are decoded together: after a prefill of the shortest prompt, one position per
  step, where rows still inside their prompt keep their prompt token.
- Keys and values are cached (`cache.py`); each step feeds one token per row. On CUDA the decode step
  can be replayed as a CUDA graph (`cuda_graphs=True`, the default on CUDA without pipeline stages).
- Greedy by default; sampling with `temperature`, `top_k` or `top_p` (`top_p_decay`, `top_p_bound`), drawn
  from `random_seed`; beam search (`num_beams`) for one prompt, as HF's `generate` does it.
- Pipeline stages pass hidden states to the next stage; the last stage's logits (gathered over TP) are
  broadcast to every stage, and every rank takes the same decision from them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..errors import MegatronPluginConfigError
from ..layers.comm import gather_tensor_parallel_last_dim
from .cache import DecodeState, kv_cache
from .expert_peers import ExpertPeers
from .sequence_parallel import sequence_parallel_off


@dataclass
class Settings:
    max_new_tokens: int
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    top_p_decay: float
    top_p_bound: float
    num_beams: int
    length_penalty: float
    early_stopping: object
    stop_tokens: List[int]
    pad_token: int
    random_seed: Optional[int]


def _number(name, value, kind, low=None, high=None, low_open=False, fix=""):
    if value is None:
        return None
    whole = kind is int
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if whole else numbers.Real):
        raise MegatronPluginConfigError(name, value, f"pass a {'whole number' if whole else 'number'}{fix}")
    value = int(value) if whole else float(value)  # numpy scalars too, as Python numbers
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high) or (
            isinstance(value, float) and not math.isfinite(value)):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise MegatronPluginConfigError(name, value, f"it must be {bounds}{fix}")
    return value


def _flag(name: str, value, none_ok: bool = False, fix: str = "pass True or False"):
    if not isinstance(value, bool) and not (none_ok and value is None):
        raise MegatronPluginConfigError(name, value, fix)


def check_settings(hf_config, prompt_len: int, batch: int, vocab: int, position_limit: Optional[int], *,
                   max_length=None, max_new_tokens=None, num_beams=None, temperature=None, top_k=None, top_p=None,
                   top_p_decay=0.0, top_p_bound=0.0, length_penalty=None, early_stopping=False, stop_token=None,
                   eos_token_id=None, random_seed=None) -> Settings:
    """Every argument checked, with a clear error, before any collective."""
    if max_length is not None and max_new_tokens is not None:
        raise MegatronPluginConfigError("max_length/max_new_tokens", (max_length, max_new_tokens),
                                        "pass one of them: max_new_tokens counts new tokens, max_length the whole row")
    if max_length is None and max_new_tokens is None:
        raise MegatronPluginConfigError("max_new_tokens", None, "pass max_new_tokens (or max_length)")
    max_length = _number("max_length", max_length, int, 1)
    max_new_tokens = _number("max_new_tokens", max_new_tokens, int, 0)
    new = max_new_tokens if max_new_tokens is not None else max_length - prompt_len
    if new < 0:
        raise MegatronPluginConfigError("max_length", max_length, f"the prompts already have {prompt_len} tokens: "
                                        "pass a larger max_length, or max_new_tokens")
    if position_limit is not None and prompt_len + new > position_limit:
        fix = (f"prompts of {prompt_len} tokens already exceed the model's {position_limit} positions: shorten the prompts"
               if prompt_len > position_limit else
               f"prompts of {prompt_len} tokens plus {new} new ones exceed the model's {position_limit} positions: "
               f"ask for at most {position_limit - prompt_len} new tokens, or shorten the prompts")
        length = ("max_new_tokens", max_new_tokens) if max_new_tokens is not None else ("max_length", max_length)
        raise MegatronPluginConfigError(*length, fix)
    temperature = _number("temperature", temperature, (int, float), 0.0, 100.0, low_open=True,
                          fix=" (1.0 leaves the logits as they are)")
    top_k = _number("top_k", top_k, int, 0, vocab, fix=f" (the vocabulary has {vocab} tokens; 0 disables top-k)")
    top_p = _number("top_p", top_p, (int, float), 0.0, 1.0, fix=" (0 disables top-p)")
    top_p_decay = _number("top_p_decay", top_p_decay, (int, float), 0.0, 1.0)
    top_p_bound = _number("top_p_bound", top_p_bound, (int, float), 0.0, 1.0)
    if top_k and top_p:
        raise MegatronPluginConfigError("top_k/top_p", (top_k, top_p), "use top-k or top-p sampling, not both")
    num_beams = _number("num_beams", num_beams, int, 1)
    length_penalty = _number("length_penalty", length_penalty, (int, float))
    random_seed = _number("random_seed", random_seed, int, 0)
    if early_stopping not in (True, False, "never"):
        raise MegatronPluginConfigError("early_stopping", early_stopping, "use True, False or 'never' (as HF's generate)")
    beams = num_beams or 1
    sampling = bool(top_k and top_k > 1) or bool(top_p) or (temperature not in (None, 1.0, 1))
    if beams > 1:
        if batch > 1:
            raise MegatronPluginConfigError("num_beams", num_beams, f"beam search takes one prompt; got a batch of {batch}: "
                                            "generate prompt by prompt, or use greedy/sampling for batches")
        if sampling:
            raise MegatronPluginConfigError("num_beams", num_beams, "beam search here is deterministic: drop temperature/top_k/top_p")
    stops = stop_token if stop_token is not None else eos_token_id
    if stops is None:
        stops = getattr(hf_config, "eos_token_id", None)
    if torch.is_tensor(stops):
        stops = stops.tolist()
    stops = [] if stops is None else (list(stops) if isinstance(stops, (list, tuple)) else [stops])
    for t in stops:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
            raise MegatronPluginConfigError("stop_token", stop_token if stop_token is not None else eos_token_id,
                                            f"stop tokens are ids in [0, {vocab}): one id or a list of them")
    stops = [int(t) for t in stops]
    pad = getattr(hf_config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else (stops[0] if stops else 0)
    return Settings(
        max_new_tokens=new, greedy=not sampling, temperature=float(temperature or 1.0), top_k=int(top_k or 0),
        top_p=float(top_p or 0.0), top_p_decay=float(top_p_decay or 0.0), top_p_bound=float(top_p_bound or 0.0),
        num_beams=beams, length_penalty=1.0 if length_penalty is None else float(length_penalty),
        early_stopping=early_stopping, stop_tokens=stops, pad_token=pad, random_seed=random_seed,
    )


def right_padded(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]):
    """(tokens with each row's prompt first, lengths). Accepts right- or left-padded prompts."""
    if not torch.is_tensor(input_ids):
        raise MegatronPluginConfigError("inputs", type(input_ids).__name__, "pass the prompts' token ids as a torch "
                                        "tensor [batch, prompt length], e.g. tokenizer(texts, return_tensors='pt').input_ids")
    if (input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0 or input_ids.is_floating_point()
            or input_ids.is_complex() or input_ids.dtype == torch.bool):
        raise MegatronPluginConfigError("inputs", f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}",
                                        "pass integer token ids shaped [batch, prompt length]")
    if attention_mask is not None and not torch.is_tensor(attention_mask):
        raise MegatronPluginConfigError("attention_mask", type(attention_mask).__name__,
                                        "pass a torch tensor shaped like the inputs (1 for a token, 0 for padding), or None")
    if attention_mask is None:
        return input_ids.long(), torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
    if attention_mask.shape != input_ids.shape:
        raise MegatronPluginConfigError("attention_mask", tuple(attention_mask.shape),
                                        f"it must have the shape of the inputs, {tuple(input_ids.shape)}")
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(1)
    if bool((lengths == 0).any()):
        raise MegatronPluginConfigError("attention_mask", "a row without tokens", "every prompt needs at least one token")
    s = input_ids.shape[1]
    idx = torch.arange(s)
    right = (mask == (idx[None] < lengths[:, None])).all(1)
    left = (mask == (idx[None] >= (s - lengths)[:, None])).all(1)
    if not bool((right | left).all()):
        raise MegatronPluginConfigError("attention_mask", "holes inside a prompt",
                                        "each row's tokens must be contiguous (right or left padding)")
    tokens = input_ids.long().cpu().clone()
    for row in range(tokens.shape[0]):
        if not bool(right[row]):  # left-padded: move the prompt to the front
            tokens[row] = torch.roll(tokens[row], -int(s - lengths[row]))
    return tokens, lengths


class Decoder:
    """One forward of new tokens through this rank's pipeline stage, with the cache; the full-vocabulary
    logits of the last position (fp32) on every rank."""

    def __init__(self, model, device):
        self.model = model  # MegatronModel of this stage
        self.module = model.module
        self.device = device
        self.vocab = model.hf_config.vocab_size
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.hidden = model.config.hidden_size
        self.dtype = model.config.params_dtype

    def run(self, tokens: torch.Tensor, past: int = 0) -> torch.Tensor:
        """`tokens` [b, s] after `past` cached positions, made model inputs by the family's conversion, as
        a training batch is (positions count on from `past`; the cache does the masking)."""
        return self(*self.model.family.inputs(tokens, past=past))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s = tokens.shape
        if not self.first:
            h = torch.empty(s, b, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(h, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            self.module.set_input_tensor(h)
        out = self.module(tokens, positions, mask)
        if not self.last:
            dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            logits = torch.empty(b, self.vocab, dtype=torch.float32, device=self.device)
        else:
            logits = gather_tensor_parallel_last_dim(out[:, -1].float())[:, : self.vocab].contiguous()
        if self.pp > 1:
            dist.broadcast(logits, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _agree(t: torch.Tensor) -> torch.Tensor:
    """Every TP rank takes TP rank 0's decision (they compute the same one; this makes it certain)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(t, src=parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    return t


class _Step:
    """Runs the decode step: eagerly, or replaying a CUDA graph captured on first use."""

    def __init__(self, decoder: Decoder, state: DecodeState, batch: int, use_graph: bool):
        self.decoder, self.state, self.use_graph = decoder, state, use_graph
        self.graph = None
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=decoder.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=decoder.device)

    def __call__(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        if not self.use_graph:
            self.state.offset = pos
            return self.decoder.run(tokens, past=pos)
        # a replay reads its inputs from the buffers it was captured with: positions are written into one
        # rather than made from `pos`, which the graph would keep as it was at capture
        self.tokens.copy_(tokens)
        self.positions.fill_(pos)
        self.state.position.fill_(pos)
        if self.graph is None:
            self.state.static = True
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up outside the graph (allocator, lazy inits)
                for _ in range(2):
                    self.decoder(self.tokens, self.positions)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.decoder(self.tokens, self.positions)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], settings: Settings,
             device: torch.device, add_bos: Optional[int] = None, cuda_graphs: Optional[bool] = None,
             use_cache: bool = True) -> torch.Tensor:
    """The decoding loop on a MegatronModel stage (no virtual pipeline chunks). With MoE layers whose
    expert-parallel group spans data-parallel replicas, the group decodes its prompts together
    (expert_peers.py)."""
    tokens, lengths = right_padded(input_ids, attention_mask)
    if add_bos is not None:
        tokens = torch.cat([torch.full_like(tokens[:, :1], add_bos), tokens], 1)
        lengths = lengths + 1
    moe = bool(getattr(model.config, "num_moe_experts", None))
    if moe and cuda_graphs:
        raise MegatronPluginConfigError("cuda_graphs", True, "MoE layers route each step's tokens with host-side "
                                        "decisions a CUDA graph cannot replay: pass cuda_graphs=False (or None)")
    peers = ExpertPeers.of(model)
    if peers is not None:
        tokens, lengths = peers.union(tokens, lengths, settings)
        if settings.num_beams > 1:  # after the union: every member has the same settings, and raises alike
            raise MegatronPluginConfigError(
                "num_beams", settings.num_beams, "beam search decodes one prompt, and expert-parallel ranks of "
                "different data-parallel replicas decode together: use greedy decoding or sampling, or "
                "expert_model_parallel_size=1 for beam search")
        out = _decode(model, tokens, lengths, settings, device, False, use_cache, peers)
        return peers.own(out, settings.stop_tokens)
    return _decode(model, tokens, lengths, settings, device, False if moe else cuda_graphs, use_cache, None)


def _decode(model, tokens, lengths, settings: Settings, device, cuda_graphs, use_cache: bool, peers) -> torch.Tensor:
    b = tokens.shape[0]
    total = int(lengths.max()) + settings.max_new_tokens
    out = torch.full((b, total), settings.pad_token, dtype=torch.long)
    for row in range(b):
        out[row, : lengths[row]] = tokens[row, : lengths[row]]
    out, lengths = out.to(device), lengths.to(device)
    if settings.max_new_tokens == 0:
        return out
    decoder = Decoder(model, device)
    state = DecodeState(max_len=total, window=model.family.sliding_window(model.hf_config), device=device)
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda" and decoder.pp == 1
    if cuda_graphs and (device.type != "cuda" or decoder.pp > 1):
        raise MegatronPluginConfigError("cuda_graphs", True, "CUDA graphs of the decode step need CUDA and pp_degree=1")
    generator = None
    if settings.random_seed is not None:
        generator = torch.Generator(device=device).manual_seed(settings.random_seed)
    module = model.module
    was_training = module.training
    module.eval()
    module.last_position_logits = True
    try:
        if not use_cache:  # every step recomputes the whole prefix (a check of the cache, and a fallback)
            step = lambda tokens, pos: decoder.run(out[:, : pos + 1])
            return _sample_loop(decoder, step, state, out, lengths, settings, generator, peers)
        with kv_cache([module], state):
            if settings.num_beams > 1:
                return _beam_search(decoder, state, out, int(lengths[0]), settings)
            step = _Step(decoder, state, b, cuda_graphs)
            return _sample_loop(decoder, step, state, out, lengths, settings, generator, peers)
    finally:
        module.last_position_logits = False
        module.train(was_training)


def _choose(logits, settings: Settings, top_p: float, generator, peers=None):
    """The next token of every row (the same on every TP rank, and on every expert-parallel peer decoding
    with this one), and top_p after its decay."""
    if settings.greedy:
        nxt = logits.argmax(-1)
    else:
        scaled = filter_logits(logits / settings.temperature, settings.top_k, top_p)
        nxt = torch.multinomial(scaled.softmax(-1), 1, generator=generator).squeeze(-1)
        if top_p and settings.top_p_decay:
            top_p = max(top_p * settings.top_p_decay, settings.top_p_bound)
    nxt = _agree(nxt)
    return (nxt if peers is None else peers.agree(nxt)), top_p


def _seq2seq_generate(model, input_ids, attention_mask, settings: Settings, device, generator):
    """Encoder-decoder models (T5): the encoder runs once; the decoder starts from the model's
    decoder_start_token_id and decodes one token per step with its self-attention cached (cross-attention
    keeps the encoder's keys and values). Returns HF's layout: [batch, 1 + new tokens], start token first."""
    module, cfg = model.module, model.hf_config
    b, total = input_ids.shape[0], 1 + settings.max_new_tokens
    out = torch.full((b, total), settings.pad_token, dtype=torch.long, device=device)
    out[:, 0] = cfg.decoder_start_token_id
    if settings.max_new_tokens == 0:
        return out
    # the decoder's own inputs go in one step at a time below; the conversion gives the encoder's and the
    # cross-attention mask, as it does for a training batch
    inputs = model.family.inputs(input_ids.to(device), None if attention_mask is None else attention_mask.to(device),
                                 decoder_input_ids=out[:, :1])
    enc_mask = inputs.cross_mask
    state = DecodeState(max_len=total, device=device)
    state.cross_mask = None if enc_mask is None else ~enc_mask
    stops = torch.tensor(settings.stop_tokens, dtype=torch.long, device=device)
    was_training = module.training
    module.eval()
    module.last_position_logits = True
    try:
        encoded = module.encode(inputs.encoder_ids, inputs.encoder_mask)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        top_p = settings.top_p
        with kv_cache([module.decoder], state):
            for pos in range(1, total):
                state.offset = module.decoder_past = pos - 1
                local = module(None, out[:, pos - 1:pos], None, None, enc_mask, encoder_hidden_states=encoded)
                logits = gather_tensor_parallel_last_dim(local[:, -1].float())[:, : cfg.vocab_size]
                nxt, top_p = _choose(logits, settings, top_p, generator)
                out[:, pos] = torch.where(done, out[:, pos], nxt)
                if stops.numel():
                    done |= torch.isin(nxt, stops)
                    if bool(done.all()):
                        return out[:, : pos + 1]
        return out
    finally:
        module.decoder_past = 0
        module.last_position_logits = False
        module.train(was_training)


def _sample_loop(decoder, step, state, out, lengths, settings: Settings, generator, peers=None):
    b = out.shape[0]
    start = int(lengths.min())
    state.offset = 0
    logits = decoder.run(out[:, :start])
    done = torch.zeros(b, dtype=torch.bool, device=out.device)
    stops = torch.tensor(settings.stop_tokens, dtype=torch.long, device=out.device)
    top_p = settings.top_p
    for pos in range(start, out.shape[1]):
        nxt, top_p = _choose(logits, settings, top_p, generator, peers)
        writing = (pos >= lengths) & ~done  # rows still inside their prompt keep the prompt token
        out[:, pos] = torch.where(writing, nxt, out[:, pos])
        if stops.numel():
            done |= writing & torch.isin(nxt, stops)
            if bool(done.all()):
                return out[:, : pos + 1]
        if pos + 1 < out.shape[1]:
            logits = step(out[:, pos:pos + 1], pos)
    return out


def _beam_search(decoder, state, out, prompt_len: int, s: Settings):
    """HF's beam search (transformers' `_beam_search`) for one prompt: of the 2 * num_beams best
    candidates per step, the best num_beams that did not stop keep running; those among the top
    num_beams that stopped (stop token or length limit) join the finished hypotheses, scored
    sum(log p) / new_length ** length_penalty; `early_stopping` decides when no running beam can win."""
    k = s.num_beams
    device = out.device
    total = out.shape[1]
    keep = max(2, 1 + len(s.stop_tokens)) * k
    state.offset = 0
    logits = decoder.run(out[:, :prompt_len])
    for cache in _caches(decoder):  # every beam starts from the prompt's keys and values
        cache.k = cache.k.expand(k, *cache.k.shape[1:]).clone()
        cache.v = cache.v.expand(k, *cache.v.shape[1:]).clone()
    logits = logits.expand(k, -1)
    running = out.expand(k, -1).clone()
    running_scores = torch.zeros(k, device=device)
    running_scores[1:] = -1e9
    finished = running.clone()
    finished_scores = torch.full((k,), -1e9, device=device)
    finished_done = torch.zeros(k, dtype=torch.bool, device=device)
    finished_len = torch.full((k,), total, dtype=torch.long, device=device)
    improvable = True
    stops = torch.tensor(s.stop_tokens, dtype=torch.long, device=device)
    top_mask = torch.arange(keep, device=device) < k
    cur = prompt_len
    while True:
        log_probs = torch.log_softmax(logits, -1) + running_scores[:, None]
        vocab = log_probs.shape[-1]
        top_scores, top_idx = torch.topk(log_probs.reshape(-1), keep)
        top_scores, top_idx = _agree(top_scores), _agree(top_idx)
        beam, token = top_idx // vocab, top_idx % vocab
        candidates = running[beam].clone()
        candidates[:, cur] = token
        hit = torch.isin(token, stops) if stops.numel() else torch.zeros_like(token, dtype=torch.bool)
        if cur + 1 >= total:
            hit = torch.ones_like(hit)
        # the next running beams: the best candidates that did not stop
        live_scores = top_scores - hit.float() * 1e9
        order = torch.topk(live_scores, k).indices
        running, running_scores = candidates[order], live_scores[order]
        # finished hypotheses: the top num_beams candidates that stopped now, if they can still count
        scores = top_scores / ((cur + 1 - prompt_len) ** s.length_penalty)
        if bool(finished_done.all()) and s.early_stopping is True:
            scores = scores - 1e9
        if not improvable:
            scores = scores - 1e9
        just = hit & top_mask
        scores = scores - (~just).float() * 1e9
        best = torch.topk(torch.cat([finished_scores, scores]), k).indices
        finished = torch.cat([finished, candidates])[best]
        finished_scores = torch.cat([finished_scores, scores])[best]
        finished_done = torch.cat([finished_done, just])[best]
        finished_len = torch.cat([finished_len, torch.full((keep,), cur + 1, dtype=torch.long, device=device)])[best]
        for cache in _caches(decoder):
            cache.reorder(beam[order])
        cur += 1
        # can a running beam still beat the worst finished one?
        best_len = total - prompt_len if (s.early_stopping == "never" and s.length_penalty > 0.0) else cur - prompt_len
        best_running = running_scores[0] / (best_len ** s.length_penalty)
        worst = finished_scores.min() if bool(finished_done.all()) else torch.tensor(-1e9, device=device)
        improvable = improvable and bool(best_running > worst)
        if not improvable or (bool(finished_done.all()) and s.early_stopping is True) or bool(hit.all()):
            break
        state.offset = cur - 1
        logits = decoder.run(running[:, cur - 1:cur], past=cur - 1)
    return finished[:1, : int(finished_len[0])]


def _caches(decoder: Decoder):
    from .cache import attention_layers

    return [layer.kv_cache for layer in attention_layers(decoder.module) if layer.kv_cache is not None]


def megatron_generate(model, inputs: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      max_length: Optional[int] = None, max_new_tokens: Optional[int] = None,
                      num_beams: Optional[int] = None, temperature: Optional[float] = None,
                      top_k: Optional[int] = None, top_p: Optional[float] = None, top_p_decay: float = 0.0,
                      top_p_bound: float = 0.0, length_penalty: Optional[float] = None, early_stopping=False,
                      add_BOS: bool = False, stop_token=None, eos_token_id=None, random_seed: Optional[int] = None,
                      cuda_graphs: Optional[bool] = None, use_cache: bool = True, **kwargs) -> torch.Tensor:
    """Generate from prompts with the engine `accelerator.prepare` returned (or a MegatronModel stage).

    Returns token ids [batch, length]: each row's prompt, its new tokens, then padding. Greedy unless
    `temperature`, `top_k` (> 1) or `top_p` ask for sampling; `num_beams` > 1 runs beam search on one
    prompt. Stops a row at `stop_token` / `eos_token_id` (default: the model's eos). Every process of the
    model's TP/PP group calls it with the same prompts; data-parallel replicas generate independently (those
    sharing MoE experts over expert parallelism decode their prompts together: expert_peers.py). A model
    trained with sequence parallelism decodes without it (sequence_parallel.py).
    """
    if kwargs:
        raise MegatronPluginConfigError("megatron_generate", sorted(kwargs), "unknown arguments")
    cp = parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if cp > 1:
        # decoding adds one token at a time: nothing to split along the sequence, and the KV cache would be
        # split over the CP ranks
        raise MegatronPluginConfigError(
            "context_parallel_size", cp,
            "generate with a CP=1 layout: save the model (accelerator.save_state / save_pretrained) and load the "
            "same checkpoint in a run with context_parallel_size=1 (the data-parallel size grows by the CP size), "
            "or generate with an inference engine fed by model.iter_hf_weights()",
        )
    engine = model if hasattr(model, "chunks") else None
    stage = engine.model if engine is not None else model
    plugin = stage.plugin
    if engine is not None and len(engine.chunks) > 1:
        raise MegatronPluginConfigError("num_layers_per_virtual_pipeline_stage", plugin.num_layers_per_virtual_pipeline_stage,
                                        "generation runs without virtual pipeline stages: unset it for inference")
    if not stage.lm_head:
        raise MegatronPluginConfigError("model", type(stage.module).__name__, "a base model has no LM head to generate with")
    _flag("add_BOS", add_BOS)
    _flag("use_cache", use_cache)
    _flag("cuda_graphs", cuda_graphs, none_ok=True,
          fix="pass True, False or None (None: CUDA graphs on CUDA without pipeline stages)")
    cfg = stage.hf_config
    bos = None
    if add_BOS:
        bos = getattr(cfg, "bos_token_id", None)
        if not isinstance(bos, int):
            raise MegatronPluginConfigError("add_BOS", True, "the model's config has no bos_token_id: set it, or add the token yourself")
    tokens, lengths = right_padded(inputs, attention_mask)
    seq2seq = hasattr(stage.module, "encode")
    if seq2seq and (num_beams or 1) > 1:
        raise MegatronPluginConfigError("num_beams", num_beams, f"beam search is not implemented for {stage.family.name} "
                                        "yet: use greedy decoding or sampling")
    if seq2seq and add_BOS:
        raise MegatronPluginConfigError("add_BOS", True, f"{stage.family.name} decodes from its decoder_start_token_id")
    # an encoder-decoder's max_length counts the decoder's tokens, its start token included (as in HF)
    prompt_len = 1 if seq2seq else int(lengths.max()) + int(add_BOS)
    settings = check_settings(
        cfg, prompt_len, tokens.shape[0], cfg.vocab_size, stage.family.position_limit(cfg), max_length=max_length,
        max_new_tokens=max_new_tokens, num_beams=num_beams, temperature=temperature, top_k=top_k, top_p=top_p,
        top_p_decay=top_p_decay, top_p_bound=top_p_bound, length_penalty=length_penalty, early_stopping=early_stopping,
        stop_token=stop_token, eos_token_id=eos_token_id, random_seed=random_seed,
    )
    real = tokens[torch.arange(tokens.shape[1])[None] < lengths[:, None]]
    if bool((real.min() < 0) | (real.max() >= cfg.vocab_size)):
        raise MegatronPluginConfigError("inputs", f"ids in [{int(real.min())}, {int(real.max())}]",
                                        f"token ids must be in [0, {cfg.vocab_size}): use the model's tokenizer")
    device = engine.device if engine is not None else next(stage.parameters()).device
    if seq2seq:
        if cuda_graphs:
            raise MegatronPluginConfigError("cuda_graphs", True, f"{stage.family.name} decodes eagerly: drop cuda_graphs")
        generator = torch.Generator(device=device).manual_seed(settings.random_seed) if settings.random_seed is not None else None
        with sequence_parallel_off(stage.module):
            return _seq2seq_generate(stage, inputs, attention_mask, settings, device, generator)
    if not use_cache and (cuda_graphs or settings.num_beams > 1):
        raise MegatronPluginConfigError("use_cache", False, "beam search and CUDA graphs decode with the cache")
    # one token per row cannot be split over TP ranks: a model trained with sequence parallelism decodes without
    with sequence_parallel_off(stage.module):
        return generate(stage, inputs, attention_mask, settings, device, add_bos=bos,
                        cuda_graphs=cuda_graphs if use_cache else False, use_cache=use_cache)
