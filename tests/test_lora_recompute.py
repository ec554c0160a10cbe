"""LoRA with activation recompute, on the CPU side (the recompute itself runs on the CUDA engine only:
tests/gpu/test_lora_gpu_recompute.py). megatron-core's full recompute checkpoints layers through a reentrant
autograd function, whose output requires grad only if an input does; the frozen embedding's output does not,
so every checkpointed layer's adapters would get no gradient. Here the layers are checkpointed with torch's
reentrant checkpoint (the same autograd contract, without CUDA RNG states): the embedding hook
(engine/recompute.embedding_output_requires_grad) gives the adapters exactly the gradients of an unchecked run,
and `build` installs it whenever recompute is on (selective recompute may checkpoint the MLP too)."""

import types

import torch

from tests.models import max_rel, padded_ids
from tests.spawn import run_on_ranks
from tests.test_lora import _peft, _twin

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _checkpoint_layers(model):
    from torch.utils.checkpoint import checkpoint

    for layer in model.module.decoder.layers:
        def forward(hidden_states, _orig=layer.forward, **kw):
            return checkpoint(lambda h: _orig(hidden_states=h, **kw), hidden_states, use_reentrant=True)

        layer.forward = forward


def _hook_worker():
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.recompute import embedding_output_requires_grad
    from megatron_plugin.models.lora import lora_hf_state_dict

    pm = _peft("llama", TARGETS)
    plain, _ = _twin(pm, MegatronLMPlugin())
    checked, _ = _twin(pm, MegatronLMPlugin())
    _checkpoint_layers(checked)
    ids, mask, _ = padded_ids(pm.config.vocab_size, 3, {}, 12)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1).masked_fill(mask == 0, -100)
    seen = []

    def run(model):
        """(the first layer's input requires grad, the loss requires grad, the adapter gradients)."""
        seen.clear()
        handle = model.module.decoder.layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["hidden_states"].requires_grad), with_kwargs=True)
        model.module.zero_grad(set_to_none=True)
        per_token = model(ids, attention_mask=mask, labels=labels)
        handle.remove()
        keep = (labels != -100).float()
        loss = (per_token * keep).sum() / keep.sum()
        if loss.requires_grad:
            loss.backward()
        return seen[0], loss.requires_grad, lora_hf_state_dict(model, grads=True), loss.detach()

    out = {"plain": run(plain), "checkpointed": run(checked)}
    out["plain_holds_embedding"] = embedding_output_requires_grad(plain)
    embedding_output_requires_grad(checked)
    out["plain_hooked"], out["checkpointed_hooked"] = run(plain), run(checked)
    return out


def test_embedding_hook_gives_checkpointed_layers_their_adapter_gradients():
    (out,) = run_on_ranks(_hook_worker, 1)
    first_in, loss_grad, ref, ref_loss = out["plain"]
    assert not first_in and loss_grad  # without recompute the adapters train without the hook
    assert all(g.abs().max() > 0 for g in ref.values())
    # the failure the hook fixes: checkpointed layers on a frozen embedding leave nothing to differentiate
    first_in, loss_grad, _, loss = out["checkpointed"]
    assert not first_in and not loss_grad and torch.equal(loss, ref_loss)
    assert out["plain_holds_embedding"]
    for case in ("plain_hooked", "checkpointed_hooked"):
        first_in, loss_grad, grads, loss = out[case]
        assert first_in and loss_grad and torch.equal(loss, ref_loss), case
        assert set(grads) == set(ref)
        assert max(max_rel(grads[k], ref[k]) for k in ref) < 1e-6, case


def _installed_worker():
    """Whether the embedding is hooked, per recompute setting (the model is only built: recompute's
    forward needs CUDA)."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.engine.lora import lora_chunks, peft_inputs
    from megatron_plugin.engine.recompute import _output_requires_grad, hook_embeddings_for_recompute

    out = {}
    initialize(MegatronLMPlugin(), _peft("llama", TARGETS).get_base_model().config)
    for name, kw in {"none": {}, "selective": dict(recompute_granularity="selective"),
                     "full": dict(recompute_granularity="full")}.items():
        pm = _peft("llama", TARGETS)
        _, run = peft_inputs((pm,))
        spec = types.SimpleNamespace(plugin=MegatronLMPlugin(**kw), params_dtype=torch.float32, reader=None)
        (chunk,) = lora_chunks(spec, run)
        hook_embeddings_for_recompute([chunk], spec.plugin)  # as build does after the chunks exist
        out[name] = [h is _output_requires_grad for h in chunk.module.embedding._forward_hooks.values()]
    return out


def test_lora_chunks_hook_the_embedding_when_recomputing():
    (out,) = run_on_ranks(_installed_worker, 1)
    assert out == {"none": [], "selective": [True], "full": [True]}
