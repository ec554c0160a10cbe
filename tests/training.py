"""A tiny causal-LM training run, written once and run two ways: as the user's script under
megatron_plugin.Accelerator, and as plain HF + torch (the reference)."""

import contextlib
import os

import torch
from torch.utils.data import DataLoader

from tests.models import GPT2_CONFIGS, T5_CONFIGS, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5

SEQ = 16
LR = 3e-3
WARMUP = 3


def token_dataset(n, vocab, seed=2):
    # arithmetic progressions: learnable, so the loss falls within a few steps
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % vocab
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def sft_dataset(n, vocab, seed=3):
    """Prompt/response pairs as an SFT collator makes them: a prompt of 3-7 tokens, an arithmetic-
    progression response, right padding to SEQ; labels -100 on the prompt and the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(4, SEQ - 7, (1,), generator=g))
        prompt = torch.randint(3, vocab, (p,), generator=g)
        # responses use a small part of the vocabulary, so a few steps visibly lower the loss
        start, stride = int(torch.randint(0, 40, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        response = 3 + (start + stride * torch.arange(r)) % 60
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[: p + r] = torch.cat([prompt, response])
        mask = (torch.arange(SEQ) < p + r).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:p] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def mlm_dataset(n, vocab, nsp=False, seed=4):
    """BERT batches: 15% of the tokens masked ([MASK] = 4) with their labels, the rest -100; padding at
    the end of some rows; two segments; a next-sentence label when `nsp`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        # repeating patterns, so the masked tokens can be recovered from context and the loss falls
        period = int(torch.randint(2, 5, (1,), generator=g))
        base = torch.randint(5, 5 + 30, (period,), generator=g)
        ids = base.repeat(SEQ // period + 1)[:SEQ].clone()
        length = int(torch.randint(SEQ - 5, SEQ + 1, (1,), generator=g))
        mask = (torch.arange(SEQ) < length).long()
        chosen = (torch.rand(SEQ, generator=g) < 0.15) & (mask == 1)
        chosen[0] = True
        labels = ids.masked_fill(~chosen, -100)
        ids = ids.masked_fill(chosen, 4).masked_fill(mask == 0, 0)
        row = {"input_ids": ids, "attention_mask": mask, "labels": labels,
               "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long() * mask}
        if nsp:
            row["next_sentence_label"] = torch.randint(0, 2, (), generator=g)
        out.append(row)
    return out


def seq2seq_dataset(n, vocab, seed=5):
    """T5 batches: the target copies the first tokens of the (padded) input, then eos (1); shorter targets
    are padded with -100 and a decoder attention mask."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, 40, (SEQ,), generator=g)
        length = int(torch.randint(SEQ - 4, SEQ + 1, (1,), generator=g))
        mask = (torch.arange(SEQ) < length).long()
        ids = ids.masked_fill(mask == 0, 0)
        t = int(torch.randint(5, 9, (1,), generator=g))
        labels = torch.full((8,), -100)
        labels[:t] = torch.cat([ids[: t - 1], torch.tensor([1])])
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "decoder_attention_mask": (labels != -100).long()})
    return out


def build(model):
    """A tiny HF model by name: a GPT-2 config of tests.models.GPT2_CONFIGS, a Llama-family one, or
    'bert:<variant>' / 'megatron_bert:<variant>'."""
    if ":" in model:
        name, variant = model.split(":")
        return tiny_bert(name, variant)
    if model in T5_CONFIGS:
        return tiny_t5(model)
    return tiny_gpt2(model) if model in GPT2_CONFIGS else tiny_llama(model)


def dataset(data, n, vocab):
    if data == "mlm":
        return mlm_dataset(n, vocab)
    if data == "mlm_nsp":
        return mlm_dataset(n, vocab, nsp=True)
    if data == "seq2seq":
        return seq2seq_dataset(n, vocab)
    return token_dataset(n, vocab) if data == "lm" else sft_dataset(n, vocab)


def optimizer_for(model, weight_decay=0.1, trainable_only=False):
    """The usual run_clm grouping: no decay for biases and LayerNorm weights. `trainable_only`: one
    group over the parameters that require grad (the other usual idiom when some are frozen)."""
    if trainable_only:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95),
                                 eps=1e-8, weight_decay=0.0)
    no_decay = ("bias", "ln_", "ln_f", "norm", "LayerNorm", ".ln.", "layer_norm")
    decay = [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)]
    rest = [p for n, p in model.named_parameters() if any(k in n for k in no_decay)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95), eps=1e-8,
    )


# frozen parts for the freezing tests: embeddings (tied with the LM head) and layer 0's attention
FROZEN = ("transformer.wte.", "transformer.h.0.attn.")


def prepared_gpt2(steps_before=1, model_overrides=None, **plugin_kwargs):
    """A tiny GPT-2 prepared on one process (CPU engine) and trained `steps_before` steps: (accelerator,
    engine, the loader's remaining batches), for tests of what happens around a step (checkpoints).
    `plugin_kwargs` go to the MegatronLMPlugin (e.g. ckpt_format), `model_overrides` to the GPT-2 config."""
    from torch.utils.data import DataLoader

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = tiny_gpt2(**(model_overrides or {}))
    opt = optimizer_for(model)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(**plugin_kwargs))
    engine, opt, sched, loader = acc.prepare(
        model, opt, MegatronLMDummyScheduler(opt, total_num_steps=10), DataLoader(token_dataset(24, 1000), batch_size=4)
    )
    engine.train()
    batches = iter(loader)
    for _ in range(steps_before):
        engine(**next(batches))
    return acc, engine, batches


def model_weights(engine):
    """A copy of this rank's Megatron weights (every chunk's state dict but TE's extra state)."""
    return {k: v.clone() for k, v in engine.model.module.state_dict().items() if not k.endswith("_extra_state")}


@contextlib.contextmanager
def failing_save(how: str = "raise", active: bool = True, ckpt_format: str = "megatron_plugin"):
    """Inside the block (when `active`), the checkpoint format's writer writes its files and then fails:
    raises OSError ('raise') or ends the process ('exit'), a save dying part-way. The native format's writer
    is one rank's model file; torch_dist's is the collective write of every rank's shards, which this rank
    then fails after."""
    if ckpt_format == "torch_dist":
        import megatron_plugin.engine.checkpointing.megatron_lm_save as save_mod
        attr = "save_sharded"
    else:
        import megatron_plugin.engine.checkpointing.native_save as save_mod
        attr = "save_file"
    real = getattr(save_mod, attr)

    def dying(*args, **kwargs):
        real(*args, **kwargs)
        if how == "exit":
            os._exit(1)
        raise OSError("disk full (simulated)")

    if active:
        setattr(save_mod, attr, dying)
    try:
        yield
    finally:
        setattr(save_mod, attr, real)


def freeze(model, prefixes):
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)


def reference_losses(steps, global_batch, clip=1.0, loss_fn=None, frozen=(), autocast=None, return_state=False,
                     trainable_only=False, model="tied", data="lm"):
    """Plain HF + torch. `frozen`: name prefixes of parameters to freeze; `autocast`: a CPU autocast dtype;
    `model`: see `build`; `data`: 'lm' (token_dataset) or 'sft' (sft_dataset)."""
    import contextlib

    model = build(model).train()
    freeze(model, frozen)
    data = dataset(data, steps * global_batch, model.config.vocab_size)
    opt = optimizer_for(model, trainable_only=trainable_only)
    from transformers import get_linear_schedule_with_warmup

    sched = get_linear_schedule_with_warmup(opt, WARMUP, steps)
    losses = []
    for step in range(steps):
        chunk = data[step * global_batch:(step + 1) * global_batch]
        batch = {k: torch.stack([d[k] for d in chunk]) for k in chunk[0]}
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            out = model(**batch)
            loss = out.loss if loss_fn is None else loss_fn(batch, out.logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (losses, {k: v.detach().clone() for k, v in model.state_dict().items()}) if return_state else losses


def megatron_losses(tp, steps, micro, num_micro, clip=1.0, step_class=None, step_kwargs=None, frozen=(),
                    trainable_only=False, mixed_precision=None, return_state=False, model="tied", data="lm"):
    """Runs inside a launched process (one per rank). `trainable_only`: build the optimizer over the
    trainable parameters only (the other HF idiom for freezing)."""
    import os

    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // tp
    model = build(model)
    freeze(model, frozen)
    data = dataset(data, steps * micro * num_micro * dp, model.config.vocab_size)
    loader = DataLoader(data, batch_size=micro, shuffle=False)
    opt = optimizer_for(model, trainable_only=trainable_only)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=tp, num_micro_batches=num_micro, gradient_clipping=clip)
    if step_class is not None:
        plugin.custom_train_step_class = step_class
        plugin.custom_train_step_kwargs = step_kwargs or {}
    accelerator = Accelerator(megatron_lm_plugin=plugin, mixed_precision=mixed_precision)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    assert accelerator.state.megatron_lm_plugin.global_batch_size == micro * num_micro * dp
    model.train()
    losses = []
    for batch in loader:
        out = model(**batch)
        accelerator.backward(out.loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        assert not opt.step_was_skipped
        losses.append(out.loss.item())
        if len(losses) == steps:
            break
    if return_state:
        return losses, {k: v.clone() for k, v in model.hf_state_dict().items()}
    return losses
