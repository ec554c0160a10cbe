"""GPU runs of the user's workflow (Accelerator + prepare + engine), one layout per launch."""

import math
import os

import torch
from torch.utils.data import DataLoader

SEQ, MICRO, NUM_MICRO, STEPS = 64, 4, 2, 50
FROZEN = {"gpt2": ("transformer.wte.", "transformer.h.0.attn."), "llama": ("model.embed_tokens.", "model.layers.0.self_attn.")}


def gpu_model(family="gpt2", seed=0):
    from transformers import (BertConfig, BertForPreTraining, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM, T5Config, T5ForConditionalGeneration)

    torch.manual_seed(seed)
    if family == "bert":  # post-LN, MLM + next-sentence heads
        return BertForPreTraining(BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                             intermediate_size=1024, max_position_embeddings=128,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if family == "t5":  # v1.1-style: gated GELU
        return T5ForConditionalGeneration(T5Config(vocab_size=1000, d_model=256, d_kv=32, d_ff=512, num_layers=4,
                                                   num_heads=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                                                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    # grouped-query attention (2 KV heads: one per rank at TP=2), llama3 rope scaling, untied head
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def dataset(n, vocab=1000, seed=3, family="gpt2"):
    if family in ("bert", "t5"):
        from tests.training import mlm_dataset, seq2seq_dataset

        return mlm_dataset(n, vocab, nsp=True, seed=seed) if family == "bert" else seq2seq_dataset(n, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % vocab
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def run_layout(*args, cpp_wrapper=None, **kwargs):
    """`_run_layout`; cpp_wrapper True / False: every compiled layer under Inductor's C++ / Python wrapper, whatever
    the engine's rule (engine/gpu.wants_cpp_wrapper) would give it; None: the rule's choice."""
    if cpp_wrapper is None:
        return _run_layout(*args, **kwargs)
    from megatron_plugin.engine import gpu

    rule = gpu.wants_cpp_wrapper
    gpu.wants_cpp_wrapper = lambda layer, compile_kwargs: cpp_wrapper
    try:
        return _run_layout(*args, **kwargs)
    finally:
        gpu.wants_cpp_wrapper = rule  # the process serves later tasks (tests/spawn.py)


def _run_layout(tp=1, pp=1, cp=1, sp=False, distopt=False, vpp_layers=None, precision="bf16", mode="train",
                steps=STEPS, total_steps=STEPS, save_dir=None, load_dir=None, recompute=False, compile=None,
                family="gpt2", frozen=False, wgrad_fusion=None, tp_comm_overlap=False):
    """compile: None (eager), "plugin" (MegatronLMPlugin(torch_compile=True)), "accelerate"
    (Accelerator(dynamo_backend="inductor"), as `accelerate config` sets it) or "cuda_graphs" (accelerate's
    TorchDynamoPlugin with mode="reduce-overhead")."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // (tp * pp * cp)
    plugin = MegatronLMPlugin(
        tp_degree=tp, pp_degree=pp, context_parallel_size=cp, sequence_parallelism=sp, use_distributed_optimizer=distopt,
        num_layers_per_virtual_pipeline_stage=vpp_layers, num_micro_batches=NUM_MICRO,
        return_logits=mode == "logits", recompute_activations=recompute, torch_compile=compile == "plugin",
        gradient_accumulation_fusion=wgrad_fusion,
        other_megatron_args={"tp_comm_overlap": True} if tp_comm_overlap else {},
    )
    extra = {"dynamo_backend": "inductor"} if compile == "accelerate" else {}
    if compile == "cuda_graphs":  # accelerate's dynamo plugin in reduce-overhead mode
        from accelerate.utils import TorchDynamoPlugin

        extra = {"dynamo_plugin": TorchDynamoPlugin(backend="inductor", mode="reduce-overhead")}
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision=precision, **extra)
    hf = gpu_model(family)
    initial = {k: v.clone() for k, v in hf.state_dict().items()}
    if frozen:
        for name, p in hf.named_parameters():
            if name.startswith(FROZEN[family]):
                p.requires_grad_(False)
    # the same global batch (and so the same samples per step) for every layout
    data = dataset(total_steps * MICRO * NUM_MICRO, family=family)
    loader = DataLoader(data, batch_size=MICRO // dp, shuffle=False, drop_last=True)
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=total_steps, warmup_num_steps=5)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)

    if mode == "logits":
        batch = next(iter(loader))
        engine.eval()
        with torch.no_grad():
            out = engine(**batch)
        ref_model = gpu_model(family).cuda().eval()
        def logits(out):
            return (out.prediction_logits if hasattr(out, "prediction_logits") else out.logits).float()

        with torch.no_grad():
            ref = logits(ref_model(**batch))
            hf_bf16 = logits(ref_model.to(torch.bfloat16)(**batch))
        if out.logits is None:
            return {"last_stage": False, "loss": out.loss.item()}
        return {
            "last_stage": True,
            "ours_err": (out.logits.float() - ref).abs().mean().item(),
            "hf_bf16_err": (hf_bf16 - ref).abs().mean().item(),
            "ours_max": (out.logits.float() - ref).abs().max().item(),
        }

    start = 0
    if load_dir:
        start = acc.load_state(load_dir)["iteration"]
    engine.train()
    losses = []
    for i, batch in enumerate(loader):
        if i < start:
            continue
        out = engine(**batch)
        losses.append(out.loss.item())
        if len(losses) == steps:
            break
    if save_dir:
        acc.save_state(save_dir)
    if frozen:
        state = engine.hf_state_dict()
        names = [k for k in state if k.startswith(FROZEN[family])]
        dtype = next(iter(state.values())).dtype
        return {"losses": losses, "frozen_names": names,
                "frozen_kept": all(torch.equal(state[k].cpu(), initial[k].to(dtype)) for k in names),
                "others_moved": any(not torch.equal(state[k].cpu(), initial[k].to(dtype)) for k in state if k not in names)}
    return losses


def generate_layout(tp=1, family="gpt2"):
    """Greedy generation (fp32) with and without CUDA graphs, and HF's on the same GPU."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=tp))
    hf = gpu_model(family)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    loader = DataLoader(dataset(8), batch_size=4)
    engine, opt, sched, loader = acc.prepare(hf, opt, MegatronLMDummyScheduler(opt, total_num_steps=2), loader)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 1000, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 5:] = 0
    graphs = engine.megatron_generate(ids, mask, max_new_tokens=40, eos_token_id=[], cuda_graphs=True)
    eager = engine.megatron_generate(ids, mask, max_new_tokens=40, eos_token_id=[], cuda_graphs=False)
    sampled = engine.megatron_generate(ids, mask, max_new_tokens=40, eos_token_id=[], top_k=20, random_seed=3)
    ref_model = gpu_model(family).cuda().eval()
    same = True
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        ref = ref_model.generate(ids[r:r + 1, :n].cuda(), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0].cpu()
        same = same and torch.equal(graphs[r, : ref.numel()].cpu(), ref)
    return {"graphs_equal_eager": torch.equal(graphs, eager), "equal_hf": same, "sampled_shape": tuple(sampled.shape)}


def clip_run(on_device=True, precision="no", clip=0.05, inf_step=None, steps=6):
    """Training with clipping active every step (`clip` below the norm), through the device-side clip
    (engine/device_clip.py) or mcore's own step. At `inf_step` one main gradient element is set to inf
    after the gradients are copied, as an overflow would."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    plugin = MegatronLMPlugin(num_micro_batches=NUM_MICRO, gradient_clipping=clip)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision=precision)
    hf = gpu_model()
    loader = DataLoader(dataset(steps * MICRO * NUM_MICRO), batch_size=MICRO, drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    engine, opt, loader = acc.prepare(hf, opt, loader)
    engine.clip_on_device = on_device and engine.clip_on_device
    mcore_opt = engine.optimizer
    subs = mcore_opt.chained_optimizers
    res = {"clip_on_device": engine.clip_on_device, "losses": [], "norms": [], "skipped": []}

    def poisoned():
        found = type(mcore_opt).prepare_grads(mcore_opt)
        [g for o in subs for g in o.get_main_grads_for_grad_norm()][0].view(-1)[0] = float("inf")
        return found

    def weights():
        return [p.detach().clone() for o in subs for g in o.optimizer.param_groups for p in g["params"]]

    engine.train()
    for i, batch in enumerate(loader):
        if i == inf_step:
            mcore_opt.prepare_grads = poisoned
            before = weights()
        out = engine(**batch)
        if i == inf_step:
            del mcore_opt.prepare_grads
            res["weights_kept"] = all(torch.equal(a, b) for a, b in zip(before, weights()))
        res["losses"].append(out.loss.item())
        res["norms"].append(float(acc.clip_grad_norm_(engine.parameters(), clip)))
        res["skipped"].append(opt.step_was_skipped)
    return res


def deferred_check_run():
    """The batch check read after the first forward is queued (engine/batch_check.py): a training step
    without masks to decide makes no synchronizing call, one with an attention mask exactly one (the
    check, which also answers the mask question for both micro-batches); ids or labels out of range
    raise the clear error and leave the weights and the GPU usable; a batch without loss tokens is
    skipped; training then goes on."""
    import warnings

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from megatron_plugin.errors import MegatronPluginConfigError

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=NUM_MICRO), mixed_precision="bf16")
    hf = gpu_model()
    loader = DataLoader(dataset(6 * MICRO * NUM_MICRO), batch_size=MICRO, drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    engine, opt, loader = acc.prepare(hf, opt, loader)
    engine.train()
    batches = iter(loader)
    res = {"deferred": engine.can_defer_batch_check(), "losses": []}

    def weights():
        return [p.detach().clone() for p in engine.parameters()]

    for _ in range(2):  # warm: allocator, first-step set-up
        res["losses"].append(engine(**next(batches)).loss.item())
    torch.cuda.synchronize()

    def syncs(batch):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = engine(**batch)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        res["losses"].append(out.loss.item())
        return [str(w.message)[:120] for w in caught if "called a synchronizing" in str(w.message)]

    # the loader's batches carry an all-ones attention mask: one read, for the check and both micro-batches
    res["syncs_with_mask"] = syncs(next(batches))
    res["syncs_without_mask"] = syncs({k: v for k, v in next(batches).items() if k != "attention_mask"})

    good = {k: v for k, v in next(batches).items() if k != "attention_mask"}  # deferred: no mask to decide
    for key, value in (("input_ids", 1000), ("labels", 5000)):
        bad = {k: v.clone() for k, v in good.items()}
        bad[key][1, 3] = value
        before = weights()
        try:
            engine(**bad)
            res[f"{key}_error"] = None
        except MegatronPluginConfigError as e:
            res[f"{key}_error"] = str(e)
        res[f"{key}_weights_kept"] = all(torch.equal(a, b) for a, b in zip(before, weights()))
    empty = {k: v.clone() for k, v in good.items()}
    empty["labels"].fill_(-100)
    before = weights()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine(**empty)
    res["empty_loss_nan"] = math.isnan(out.loss.item())
    res["empty_skipped"] = engine.last_step_skipped
    res["empty_weights_kept"] = all(torch.equal(a, b) for a, b in zip(before, weights()))
    res["losses"].append(engine(**good).loss.item())
    return res


def full_graph_run(graph=True, tp=1, sp=False, distopt=False, compile=True, family="gpt2", dropout=0.0, steps=10,
                   save_dir=None, fp8_recipe=None, reseed_at=None):
    """Training steps with Megatron's full-iteration CUDA graph (engine/full_graph.py; captured after 2 eager steps)
    or without it, the same data and seed: the losses, grad norms and the graph's counts. With `save_dir`, a
    save_state / load_state round trip after `steps - 3` steps (the RNG tracker's generators go through it). With
    `reseed_at`, the seeds set again before that step, as a second `prepare` in the process does."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // tp
    args = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration", "cuda_graph_warmup_steps": 2} if graph else {}
    if dropout:
        args.update(hidden_dropout=dropout, attention_dropout=dropout)
    fp8 = dict(fp8="hybrid", fp8_recipe=fp8_recipe) if fp8_recipe else {}
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp, use_distributed_optimizer=distopt,
                              num_micro_batches=NUM_MICRO, torch_compile=compile, other_megatron_args=args, **fp8)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    hf = gpu_model(family)
    loader = DataLoader(dataset(steps * MICRO * NUM_MICRO, family=family), batch_size=MICRO // dp, shuffle=False,
                        drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=2)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)
    engine.train()
    losses, norms, rng = [], [], []
    for i, batch in enumerate(loader):
        if i == reseed_at:
            from megatron_plugin.engine import distributed

            distributed.set_seed(plugin.seed, graph_safe=graph)
        out = engine(**batch)
        losses.append(out.loss.item())
        norms.append(float(engine.last_grad_norm))
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
        rng.append([engine.rng.state["cuda"].clone()] + [v.get_state() if isinstance(v, torch.Generator) else v.clone()
                                                          for _, v in sorted(tracker.items())])
        if save_dir and i == steps - 4:
            acc.save_state(save_dir)
            acc.load_state(save_dir)
    fg = getattr(engine, "full_graph", None)
    return {"losses": losses, "norms": norms, "captures": fg.captures if fg else 0, "replays": fg.replays if fg else 0,
            # each step drew from the default stream or megatron-core's tracker (SP's dropout)
            "rng_moved": all(any(not torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(rng, rng[1:]))}


def dropout_compiled_run(family="gpt2", tp=1, compile=True, steps=4, lora=False, sp=False):
    """Compiled layers with dropout on (hidden and attention 0.1, HF GPT-2's and BERT's defaults; with `lora`
    only peft's adapter dropout, 0.1, on the tiny Llama's adapters): `steps` training steps at learning rate 0 on
    one repeated batch (the weights stay put), then the same batch in eval mode. Dropout in effect shows as a
    new loss each step around the eval loss."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    args = {} if lora else {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=sp, num_micro_batches=NUM_MICRO,
                              torch_compile=compile, other_megatron_args=args)
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision="bf16")
    if lora:
        from tests.test_lora_training import peft_model

        hf = peft_model("llama", lora_dropout=0.1)
        batch = dataset(MICRO * NUM_MICRO, vocab=hf.config.vocab_size)
    else:
        hf = gpu_model(family)
        batch = dataset(MICRO * NUM_MICRO, family=family)
    loader = DataLoader(batch * (steps + 1), batch_size=MICRO // (world // tp), shuffle=False, drop_last=True)
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0)
    engine, opt, loader = acc.prepare(hf, opt, loader)
    engine.train()
    it = iter(loader)
    losses = [engine(**next(it)).loss.item() for _ in range(steps)]
    engine.eval()
    with torch.no_grad():
        eval_loss = engine(**next(it)).loss.item()
    return {"losses": losses, "eval": eval_loss}
