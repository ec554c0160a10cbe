"""Megatron-LM's hooks as accelerate's integration takes them: a custom get_batch / loss function replaces
the train step's (and trains like the same loss in plain HF); a model provider builds the modules (ours:
trains exactly like the converted model given the same weights; another: trains, HF export refused by
name); a datasets provider feeds MegatronLMDummyDataLoader."""

import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import WARMUP, optimizer_for, reference_losses, token_dataset

STEPS = 4
HALF = 6  # the custom get_batch keeps the loss off the first HALF positions


# -- custom_get_batch_function / custom_loss_function -------------------------------------------------
def accelerate_style_get_batch(data_iterator):
    """As accelerate's GPT get_batch returns it: tokens, labels (the next tokens), loss_mask, attention_mask
    (Megatron's: True = masked), position_ids."""
    data = next(data_iterator)
    tokens = data["input_ids"].long()
    b, s = tokens.shape
    labels = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    loss_mask = torch.ones(b, s)
    loss_mask[:, :HALF] = 0
    loss_mask[:, -1] = 0
    attention_mask = ~torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()[None, None]
    position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return tokens, labels, loss_mask.to(tokens.device), attention_mask, position_ids


def masked_loss(loss_mask, output_tensor):
    from megatron_plugin import avg_losses_across_data_parallel_group

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"masked lm loss": avg_losses_across_data_parallel_group([loss])[0]}


def hf_masked_loss(batch, logits):
    ids = batch["input_ids"]
    per_token = torch.nn.functional.cross_entropy(logits[:, HALF:-1].flatten(0, 1), ids[:, HALF + 1:].flatten())
    return per_token


def _run(plugin_kwargs, steps, micro=2, num_micro=2, model=None, data=None):
    """Train a tiny GPT-2 through prepare; (losses, the engine's logged keys, the engine)."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    hf = model if model is not None else tiny_gpt2()
    data = data if data is not None else token_dataset(steps * micro * num_micro, hf.config.vocab_size)  # as reference_losses
    opt = optimizer_for(hf)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=min(WARMUP, steps - 1))
    plugin = MegatronLMPlugin(num_micro_batches=num_micro, **plugin_kwargs)
    acc = Accelerator(megatron_lm_plugin=plugin)
    engine, opt, sched, loader = acc.prepare(hf, opt, sched, DataLoader(data, batch_size=micro))
    engine.train()
    losses, keys = [], set()
    for batch in loader:
        out = engine(**batch)
        losses.append(out.loss.item())
        keys |= set(engine.metrics)
        if len(losses) == steps:
            break
    return losses, keys, engine, acc


def _custom_functions_worker():
    losses, keys, _, acc = _run(dict(tp_degree=2, custom_get_batch_function=accelerate_style_get_batch,
                                     custom_loss_function=masked_loss), STEPS)
    step = acc._engine.train_step_handler
    return losses, keys, step.get_batch is accelerate_style_get_batch, step.loss_func is masked_loss


def test_custom_get_batch_and_loss_function_train_like_hf():
    ref = reference_losses(STEPS, 4, loss_fn=hf_masked_loss)
    plain = reference_losses(STEPS, 4)
    assert abs(ref[0] - plain[0]) > 1e-3  # the mask changes the loss, so this test sees the functions used
    for losses, keys, batch_used, loss_used in run_on_ranks(_custom_functions_worker, 2):
        assert batch_used and loss_used
        assert keys == {"masked lm loss"}, keys  # the logs are the user's loss function's
        for step, (a, b) in enumerate(zip(losses, ref)):
            assert abs(a - b) / b < 1e-4, f"step {step}: {a} vs {b}"


# -- custom_model_provider_function / custom_prepare_model_function -----------------------------------
def _provider_worker(kind):
    """kind 'converted': prepare's own conversion; 'ours': a provider building our family's GPTModel and
    copying the converted twin's weights in (as one would load a Megatron-LM checkpoint)."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.models.modeling import MegatronModel

    calls = []
    kwargs = dict(tp_degree=2)
    if kind == "ours":
        def provider(pre_process=True, post_process=True):
            calls.append((pre_process, post_process))
            build_plugin = MegatronLMPlugin(tp_degree=2)
            fresh = MegatronModel(tiny_gpt2().config, build_plugin).module  # weights not initialized
            fresh.load_state_dict(MegatronModel.from_hf(tiny_gpt2(), build_plugin).module.state_dict())
            return fresh

        kwargs["custom_model_provider_function"] = provider
    losses, _, engine, acc = _run(kwargs, STEPS)
    weights = {k: v.clone() for k, v in engine.hf_state_dict().items()}
    return losses, weights, calls, [c.provided for c in engine.chunks], [c.maps_to_hf for c in engine.chunks]


def test_provider_of_our_module_trains_like_the_converted_model():
    converted = run_on_ranks(_provider_worker, 2, "converted")
    provided = run_on_ranks(_provider_worker, 2, "ours")
    for (ref_losses, ref_weights, _, ref_provided, _), (losses, weights, calls, was_provided, maps) in zip(converted, provided):
        assert calls == [(True, True)] and was_provided == [True] and ref_provided == [False] and maps == [True]
        assert all(math.isfinite(x) for x in losses)
        assert losses == ref_losses, (losses, ref_losses)
        assert weights.keys() == ref_weights.keys()
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def _foreign_worker(tmp):
    """A plain megatron-core GPTModel from the provider (through custom_prepare_model_function): it trains;
    what writes HF names is refused, naming the provider, before any collective."""
    from megatron.core.models.gpt import GPTModel

    from megatron_plugin.layers.spec import block_spec
    from megatron_plugin.models import get_family
    from megatron_plugin.models.gpt import build_transformer_config

    hf = tiny_gpt2()
    prepared_with = []

    def provider(pre_process=True, post_process=True):
        from megatron_plugin import MegatronLMPlugin

        config = build_transformer_config(get_family(hf.config), hf.config, MegatronLMPlugin(tp_degree=2))
        config.perform_initialization = True  # random weights, as Megatron-LM's model providers give them
        return GPTModel(config=config, transformer_layer_spec=block_spec(config, config.num_layers, "local"),
                        vocab_size=1024, max_sequence_length=32, pre_process=pre_process, post_process=post_process)

    def prepare_model(model_provider):
        prepared_with.append(model_provider)
        return [model_provider(pre_process=True, post_process=True)]

    losses, _, engine, acc = _run(dict(tp_degree=2, custom_model_provider_function=provider,
                                       custom_prepare_model_function=prepare_model), 2, model=hf)
    errors = {}
    for name, fn in (("save_model", lambda: acc.save_model(engine, tmp)), ("get_state_dict", lambda: acc.get_state_dict(engine)),
                     ("iter_hf_weights", lambda: engine.iter_hf_weights()), ("hf_state_dict", lambda: engine.hf_state_dict())):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the test reads which
            errors[name] = (getattr(err, "setting", type(err).__name__), str(err))
    return losses, prepared_with == [provider], errors, [c.maps_to_hf for c in engine.chunks]


def test_provider_of_another_module_trains_and_refuses_hf_export(tmp_path):
    for losses, prepared, errors, maps in run_on_ranks(_foreign_worker, 2, str(tmp_path / "hf")):
        assert prepared and maps == [False]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        assert sorted(errors) == ["get_state_dict", "hf_state_dict", "iter_hf_weights", "save_model"]
        for what, got in errors.items():
            check_refusal(got, "custom_model_provider_function", what, "GPTModel", "save_state", exact=True, where=what)
    assert not (tmp_path / "hf").exists()


def test_provider_hooks_are_checked_at_construction():
    from megatron_plugin import MegatronLMPlugin, MegatronPluginConfigError

    with pytest.raises(MegatronPluginConfigError) as err:
        MegatronLMPlugin(custom_model_provider_function="model_provider")
    assert err.value.setting == "custom_model_provider_function"


# -- custom_megatron_datasets_provider_function ----------------------------------------------------------
SEQ = 16


def _indexed_prefix(folder):
    """A tiny Megatron indexed dataset: MegatronLMDummyDataLoader needs a data_path even with a provider."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = f"{folder}/docs"
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for i in range(40):
        builder.add_document(torch.arange(i, i + 30) % 300, [30])
    builder.finalize(prefix + ".idx")
    return prefix


def _text_samples(n, offset):
    return [{"text": (np.arange(SEQ + 1) * 3 + i + offset) % 900} for i in range(n)]


def _datasets_worker(folder):
    from megatron_plugin import Accelerator, MegatronLMDummyDataLoader, MegatronLMDummyScheduler, MegatronLMPlugin

    asked = []

    def provider(train_val_test_num_samples):
        asked.append(list(train_val_test_num_samples))
        return _text_samples(64, 0), _text_samples(16, 500), None

    hf = tiny_gpt2()
    opt = optimizer_for(hf)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=3, warmup_num_steps=1)
    loader = MegatronLMDummyDataLoader(data_path=_indexed_prefix(folder), splits_string="90,10,0", seq_length=SEQ,
                                       micro_batch_size=2, eval_iters=2)
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin(num_micro_batches=2,
                                                          custom_megatron_datasets_provider_function=provider))
    engine, opt, sched, train_it, valid_it = acc.prepare(hf, opt, sched, loader, loader)
    first, valid = next(train_it), next(valid_it)
    engine.train()
    loss = engine(**first).loss.item()
    return asked, first, valid, loss


def test_datasets_provider_feeds_the_dummy_loader(tmp_path):
    ((asked, first, valid, loss),) = run_on_ranks(_datasets_worker, 1, str(tmp_path))
    g = 2 * 2  # micro-batch x micro-batches x one data-parallel rank
    assert asked == [[3 * g, (3 // 1000 + 1) * 2 * g, 0]]  # Megatron-LM's sizes: train_iters, evals x eval_iters, none
    texts = torch.stack([torch.as_tensor(s["text"]) for s in _text_samples(4, 0)]).long()
    assert torch.equal(first["input_ids"], texts[:, :-1]) and torch.equal(first["shift_labels"], texts[:, 1:])
    assert torch.equal(valid["input_ids"][0], torch.as_tensor(_text_samples(1, 500)[0]["text"][:-1]).long())
    assert math.isfinite(loss)


def test_datasets_provider_samples_of_unknown_kind_are_refused():
    from megatron_plugin import MegatronPluginConfigError
    from megatron_plugin.build import _provided_datasets

    with pytest.raises(MegatronPluginConfigError) as err:
        _provided_datasets(lambda n: ([{"ids": [1, 2]}], None, None), [4, 0, 0], 1)
    assert err.value.setting == "custom_megatron_datasets_provider_function" and "'text'" in err.value.fix
    with pytest.raises(MegatronPluginConfigError, match="return a valid dataset"):
        _provided_datasets(lambda n: (_text_samples(4, 0), None, None), [4, 4, 0], 2)
