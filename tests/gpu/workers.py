"""GPU runs of the user's workflow (Accelerator + prepare + engine), one layout per launch."""

import os

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

SEQ, MICRO, NUM_MICRO, STEPS = 64, 4, 2, 50


def gpu_model(seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=1000, n_positions=128, n_embd=256, n_layer=4, n_head=8, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def dataset(n, vocab=1000, seed=3):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % vocab
    return [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()} for x in ids]


def run_layout(tp=1, pp=1, sp=False, distopt=False, vpp_layers=None, precision="bf16", mode="train",
               steps=STEPS, total_steps=STEPS, save_dir=None, load_dir=None, recompute=False, compile=None):
    """compile: None (eager), "plugin" (MegatronLMPlugin(torch_compile=True)) or "accelerate"
    (Accelerator(dynamo_backend="inductor"), as `accelerate config` sets it)."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    world = int(os.environ["WORLD_SIZE"])
    dp = world // (tp * pp)
    plugin = MegatronLMPlugin(
        tp_degree=tp, pp_degree=pp, sequence_parallelism=sp, use_distributed_optimizer=distopt,
        num_layers_per_virtual_pipeline_stage=vpp_layers, num_micro_batches=NUM_MICRO,
        return_logits=mode == "logits", recompute_activations=recompute, torch_compile=compile == "plugin",
    )
    extra = {"dynamo_backend": "inductor"} if compile == "accelerate" else {}
    acc = Accelerator(megatron_lm_plugin=plugin, mixed_precision=precision, **extra)
    hf = gpu_model()
    # the same global batch (and so the same samples per step) for every layout
    data = dataset(total_steps * MICRO * NUM_MICRO)
    loader = DataLoader(data, batch_size=MICRO // dp, shuffle=False, drop_last=True)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.01)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=total_steps, warmup_num_steps=5)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, loader)

    if mode == "logits":
        batch = next(iter(loader))
        engine.eval()
        with torch.no_grad():
            out = engine(**batch)
        ref_model = gpu_model().cuda().eval()
        with torch.no_grad():
            ref = ref_model(**batch).logits.float()
            hf_bf16 = ref_model.to(torch.bfloat16)(**batch).logits.float()
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
    return losses
