"""LoRA through peft (issue 29) on CPU, TP=2 and DP=2, GPT-2 and Llama tiny models whose LoRA B starts
non-zero: eval logits and log-probs against the HF peft model, `disable_adapter()` against the base model,
20 training steps against HF peft training with the same optimizer, the base weights bit for bit, the adapter
folder `save_model` writes loaded back by `PeftModel.from_pretrained`, and save_state/load_state resuming
bit for bit."""

import os
import tempfile

import pytest
import torch
from torch.utils.data import DataLoader

from tests.models import tiny_gpt2, tiny_llama
from tests.spawn import run_on_ranks
from tests.training import WARMUP, token_dataset

STEPS = 20
LR = 3e-3
# fused parts on purpose (q and v without k, up without gate): an adapter must touch only its own rows
TARGETS = {"gpt2": ("c_attn", "c_proj", "c_fc"),
           "llama": ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")}


def base_model(name):
    return tiny_gpt2("tied") if name == "gpt2" else tiny_llama("llama")


def peft_model(name, seed=7, lora_dropout=0.0):
    """The tiny model with LoRA adapters whose A and B are both random (init_lora_weights=False), so the
    adapters change the output from the first step."""
    from peft import LoraConfig, get_peft_model

    hf = base_model(name)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=lora_dropout, target_modules=list(TARGETS[name]),
                        init_lora_weights=False)
    return get_peft_model(hf, config)


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.01)


def eval_batch(vocab, rows=4, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def token_log_probs(logits, ids):
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], 1)


def lora_state(model):
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def reference(name, global_batch):
    """HF peft on one process: the losses of STEPS steps, the trained adapters and the first eval."""
    from transformers import get_linear_schedule_with_warmup

    model = peft_model(name)
    batch = eval_batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    prompt = batch["input_ids"][:, :6]
    with torch.no_grad():
        generated = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    model.train()
    data = token_dataset(STEPS * global_batch, model.config.vocab_size)
    opt = make_optimizer(model)
    sched = get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses = []
    for step in range(STEPS):
        rows = data[step * global_batch:(step + 1) * global_batch]
        out = model(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]})
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return {"losses": losses, "lora": lora_state(model), "logits": logits, "generated": generated,
            "log_probs": token_log_probs(logits, batch["input_ids"])}


def prepare(name, tp, micro, ckpt_format="megatron_plugin"):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = peft_model(name)
    dp = int(os.environ["WORLD_SIZE"]) // tp
    loader = DataLoader(token_dataset(STEPS * micro * dp, model.config.vocab_size), batch_size=micro, shuffle=False)
    opt = make_optimizer(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=tp, gradient_clipping=1.0, return_logits=True, ckpt_format=ckpt_format)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    return accelerator, engine, loader


def train_worker(name, tp, micro, out_dir, ckpt_format):
    """On each rank: eval, log-probs and greedy decoding with and without adapters, STEPS steps (a checkpoint
    after half of them), then the adapter folder (both spellings) and the merged export."""
    from megatron_plugin.models.lora import lora_hf_state_dict

    accelerator, engine, loader = prepare(name, tp, micro, ckpt_format)
    base = {k: v.clone() for k, v in engine.model.module.state_dict().items()
            if "lora_adapters" not in k and not k.endswith("_extra_state")}
    frozen = sorted(n for n, p in engine.model.module.named_parameters() if not p.requires_grad)
    trainable = sorted(n for n, p in engine.model.module.named_parameters() if p.requires_grad)
    in_optimizer = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    params = dict(engine.model.module.named_parameters())
    optimizer_holds = sorted(n for n in params if id(params[n]) in in_optimizer)
    batch = eval_batch(engine.config.vocab_size)
    engine.eval()
    with torch.no_grad():
        logits = engine(**batch).logits
        with engine.disable_adapter():
            base_logits = engine(**batch).logits
        after_block = engine(**batch).logits
    log_probs = engine.compute_log_probs(batch)
    prompt = batch["input_ids"][:, :6]
    generated = engine.megatron_generate(prompt, torch.ones_like(prompt), max_new_tokens=6, eos_token_id=[])
    engine.train()
    losses = []
    ckpt = os.path.join(out_dir, "ckpt")
    for batch_ in loader:
        losses.append(engine(**batch_).loss.item())
        if len(losses) == STEPS // 2:
            accelerator.save_state(ckpt)
        if len(losses) == STEPS:
            break
    grad_free = all(p.grad is None for p in engine.model.module.parameters() if not p.requires_grad)
    state_count = len(engine.optimizer.state)
    still_base = all(torch.equal(v, base[k]) for k, v in engine.model.module.state_dict().items() if k in base)
    trained = lora_hf_state_dict(engine.model)
    engine.eval()
    with torch.no_grad():
        final_logits = engine(**batch).logits
    adapter_dir = os.path.join(out_dir, "adapter")
    accelerator.save_model(engine, adapter_dir)
    # HF scripts' spelling writes the same folder; merge_lora writes full HF weights
    accelerator.unwrap_model(engine).save_pretrained(os.path.join(out_dir, "unwrapped"))
    accelerator.save_model(engine, os.path.join(out_dir, "merged"), merge_lora=True)
    return {"losses": losses, "logits": logits, "generated": generated, "base_logits": base_logits,
            "after_block": after_block, "log_probs": log_probs, "final_logits": final_logits,
            "still_base": still_base, "frozen": frozen, "trainable": trainable, "grad_free": grad_free,
            "optimizer_holds": optimizer_holds, "state_count": state_count,
            "trained": trained, "adapter_dir": adapter_dir}


def resume_worker(name, tp, micro, out_dir, ckpt_format):
    """A fresh prepare of the same script resumes from the checkpoint saved halfway: the last STEPS // 2 steps."""
    accelerator, engine, loader = prepare(name, tp, micro, ckpt_format)
    accelerator.load_state(os.path.join(out_dir, "ckpt"))
    engine.train()
    batches = iter(loader)
    for _ in range(STEPS // 2):
        next(batches)
    return [engine(**b).loss.item() for b in batches]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,ckpt_format", [(2, "torch_dist"), (1, "megatron_plugin")], ids=["tp2", "dp2"])
def test_lora_trains_like_hf_peft(name, tp, ckpt_format):
    from peft import PeftModel

    micro = 4 // (2 // tp)
    ref = reference(name, 4)
    assert ref["losses"][-1] < ref["losses"][0]
    with torch.no_grad():
        base_logits = base_model(name)(input_ids=eval_batch(1000 if name == "gpt2" else 333)["input_ids"]).logits
    assert (ref["logits"] - base_logits).abs().max() > 1e-2  # the adapters matter from the start
    with tempfile.TemporaryDirectory() as out:
        results = run_on_ranks(train_worker, 2, name, tp, micro, out, ckpt_format)
        resumed = run_on_ranks(resume_worker, 2, name, tp, micro, out, ckpt_format)
        got = results[0]
        # the adapter folder, as peft loads it, gives our trained model's logits
        loaded = PeftModel.from_pretrained(base_model(name), got["adapter_dir"]).eval()
        assert os.path.isfile(os.path.join(got["adapter_dir"], "adapter_config.json"))
        with torch.no_grad():
            loaded_logits = loaded(input_ids=eval_batch(loaded.config.vocab_size)["input_ids"]).logits
        again = PeftModel.from_pretrained(base_model(name), os.path.join(out, "unwrapped"))
        assert all(torch.equal(v, lora_state(again)[k]) for k, v in lora_state(loaded).items())
        # merged export: what peft's merge_and_unload gives from the same adapters
        merged = type(base_model(name)).from_pretrained(os.path.join(out, "merged")).state_dict()
        want = loaded.merge_and_unload().state_dict()
        assert set(want) <= set(merged)
        merge_error = max(rel(merged[k], v) for k, v in want.items())
    for r in results:
        assert rel(r["logits"], ref["logits"]) < 1e-4
        assert (r["base_logits"] - base_logits).abs().max() < 1e-5
        assert torch.equal(r["after_block"], r["logits"])  # the adapters are back after the block
        assert (r["log_probs"] - ref["log_probs"]).abs().max() < 1e-4
        assert torch.equal(r["generated"], ref["generated"])  # greedy decoding with the adapters
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(a - b) / abs(b) < 1e-4, f"step {step}: megatron {a} vs peft {b}"
        assert r["still_base"]  # the frozen base, bit for bit
        assert r["frozen"] and all("lora_adapters" not in n for n in r["frozen"])
        assert r["trainable"] and all("lora_adapters" in n for n in r["trainable"])
        assert r["grad_free"] and r["optimizer_holds"] == r["trainable"]
        assert r["state_count"] == len(r["trainable"])  # optimizer state for the adapters only
    for r, again in zip(results, resumed):
        assert again == r["losses"][STEPS // 2:]  # bit for bit
    trained = results[0]["trained"]
    assert set(trained) == set(ref["lora"])
    for k, v in ref["lora"].items():
        assert rel(trained[k], v) < 1e-4, k
    assert (loaded_logits - results[0]["final_logits"]).abs().max() < 1e-5
    assert merge_error < 1e-6, merge_error


def refusals_worker():
    """(setting, whether Megatron's groups existed) of each bad LoRA prepare."""
    from megatron.core import parallel_state

    from megatron_plugin import Accelerator, MegatronLMPlugin
    from tests.errors import expecter

    out = {}
    expect = expecter(out, state=lambda name: parallel_state.model_parallel_is_initialized())

    def attempt(model, opt, **plugin_kwargs):
        loader = DataLoader(token_dataset(4, model.config.vocab_size), batch_size=4)
        Accelerator(megatron_lm_plugin=MegatronLMPlugin(**plugin_kwargs)).prepare(model, opt, loader)

    model = peft_model("gpt2")
    base_only = [p for n, p in model.named_parameters() if "lora_" not in n]
    expect("optimizer_without_adapters", attempt, model, torch.optim.AdamW(base_only, lr=1e-3))
    expect("provider", attempt, model, make_optimizer(model), custom_model_provider_function=lambda **kw: None)
    with torch.no_grad():
        base = base_model("gpt2")
        plain = base(input_ids=eval_batch(1000)["input_ids"]).logits
        with model.disable_adapter():  # the user's PeftModel is left as it was
            still = model(input_ids=eval_batch(1000)["input_ids"]).logits
    out["peft_model_untouched"] = torch.equal(plain, still)
    return out


def test_bad_lora_prepare_is_refused_before_any_group():
    out = run_on_ranks(refusals_worker, 1)[0]
    setting, message = out["optimizer_without_adapters"][:2]
    assert setting == "optimizer" and "lora_A" in message and "peft_model.parameters()" in message
    assert out["optimizer_without_adapters"][2] is False  # no Megatron group yet
    assert out["provider"][0] == "custom_model_provider_function" and out["provider"][2] is False
    assert out["peft_model_untouched"]


def groups_worker():
    """Each trainable Megatron parameter's learning rate, with the adapters in four optimizer groups (GPT-2's two
    c_proj apart, A apart from B)."""
    from megatron_plugin import Accelerator, MegatronLMPlugin

    model = peft_model("gpt2")
    lrs = {}

    def lr_of(name):
        where = "mlp" if ".mlp." in name else "attn"
        return {"attn": 1e-3, "mlp": 2e-3}[where] * (3 if ".lora_B." in name else 1)

    groups = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(lr_of(n), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": lr} for lr, ps in groups.items()])
    loader = DataLoader(token_dataset(4, 1000), batch_size=4)
    engine, opt, _ = Accelerator(megatron_lm_plugin=MegatronLMPlugin()).prepare(model, opt, loader)
    lr_of_param = {id(p): g["lr"] for g in engine.optimizer.param_groups for p in g["params"]}
    for n, p in engine.model.module.named_parameters():
        if p.requires_grad:
            lrs[n] = lr_of_param[id(p)]
    return lrs


def test_adapters_keep_their_optimizer_groups():
    lrs = run_on_ranks(groups_worker, 1)[0]
    assert len(lrs) == 2 * 2 * 4  # 2 layers x (A, B) x 4 adapted linears
    for name, lr in lrs.items():
        want = (2e-3 if ".mlp." in name else 1e-3) * (3 if name.endswith("lora_B") else 1)
        assert lr == pytest.approx(want), name


def sequence_parallel_worker(name):
    """STEPS steps under TP=2 with sequence parallelism: the adapters' gathers and scatters over the sequence."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    model = peft_model(name)
    loader = DataLoader(token_dataset(STEPS * 4, model.config.vocab_size), batch_size=4, shuffle=False)
    opt = make_optimizer(model)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=STEPS, warmup_num_steps=WARMUP)
    plugin = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True, gradient_clipping=1.0)
    engine, opt, sched, loader = Accelerator(megatron_lm_plugin=plugin).prepare(model, opt, sched, loader)
    engine.train()
    return [engine(**b).loss.item() for b in loader][:STEPS]


def test_lora_under_sequence_parallelism_trains_like_hf_peft():
    ref = reference("llama", 4)["losses"]
    for got in run_on_ranks(sequence_parallel_worker, 2, "llama"):
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, ref)):
            assert abs(a - b) / abs(b) < 1e-4, f"step {step}: megatron {a} vs peft {b}"


def fused_worker(fused):
    """Three steps of the tiny Llama at TP=1, with the adapters' up-projection inside the frozen GEMM
    (`layers/lora.fused_column_forward`) or forced off; how often the fused path ran. The patches are undone:
    the worker processes serve later tests."""
    from megatron_plugin.layers import linear as linear_layers
    from megatron_plugin.layers import lora as lora_layers

    calls = []
    run, chosen = lora_layers._FrozenLinearWithUp.apply, linear_layers.fused_column_forward
    lora_layers._FrozenLinearWithUp.apply = lambda *a: calls.append(1) or run(*a)
    if not fused:
        linear_layers.fused_column_forward = lambda linear, x: None
    try:
        _, engine, loader = prepare("llama", 1, 4)
        engine.train()
        losses = [engine(**b).loss.item() for b, _ in zip(loader, range(3))]
    finally:
        lora_layers._FrozenLinearWithUp.apply, linear_layers.fused_column_forward = run, chosen
    grads_free = [p.grad is None for p in engine.model.module.parameters() if not p.requires_grad]
    from megatron_plugin.models.lora import lora_hf_state_dict

    return {"calls": len(calls), "losses": losses, "lora": lora_hf_state_dict(engine.model), "frozen": all(grads_free)}


def test_fused_up_projection_equals_the_separate_one():
    (fused,) = run_on_ranks(fused_worker, 1, True)
    (plain,) = run_on_ranks(fused_worker, 1, False)
    assert fused["calls"] == 3 * 2 * 2  # steps x layers x (QKV, gate/up)
    assert plain["calls"] == 0
    for a, b in zip(fused["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b)
    for k, v in plain["lora"].items():
        assert rel(fused["lora"][k], v) < 1e-5, k
    assert fused["frozen"] and plain["frozen"]
