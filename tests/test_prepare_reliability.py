"""What a new user's script can do around `prepare` ends in a clear error or the right result, never a raw
traceback (issue 31): a checkpoint or export call before `prepare`, and an HF model compiled with
`torch.compile` before `prepare`."""

import warnings

import torch
from torch.utils.data import DataLoader

from tests.errors import check_refusal, expecter
from tests.models import tiny_gpt2
from tests.spawn import run_on_ranks
from tests.training import optimizer_for, token_dataset

# every call that needs the prepared model, with how a script calls it
BEFORE_PREPARE = {
    "save_state": lambda acc, folder: acc.save_state(folder),
    "load_state": lambda acc, folder: acc.load_state(folder),
    "get_state_dict": lambda acc, folder: acc.get_state_dict(None),
    "save_model": lambda acc, folder: acc.save_model(None, folder),
    "offload": lambda acc, folder: acc.offload(),
    "reload": lambda acc, folder: acc.reload(),
    "snapshot_weights": lambda acc, folder: acc.snapshot_weights(),
    "use_weights": lambda acc, folder: acc.use_weights({}),
}


def _before_prepare_worker(folder):
    from megatron_plugin import Accelerator, MegatronLMPlugin

    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin())
    errors = {}
    expect = expecter(errors)
    for name, call in BEFORE_PREPARE.items():
        expect(name, call, acc, folder)
    return errors


def test_calls_before_prepare_name_the_call_and_the_fix(tmp_path):
    """`accelerator.load_state(dir)` before `prepare` was an AttributeError on None (so were save_state,
    get_state_dict and save_model)."""
    (errors,) = run_on_ranks(_before_prepare_worker, 1, str(tmp_path))
    for name in BEFORE_PREPARE:
        check_refusal(errors[name], name, "before prepare", "accelerator.prepare(", exact=True, where=name)


def _eval_loss(model, compiled):
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin

    data = token_dataset(8, model.config.vocab_size)
    batch = {k: torch.stack([d[k] for d in data[:4]]) for k in data[0]}
    opt = optimizer_for(model)  # built over the HF model's parameters, as a script does before compiling
    acc = Accelerator(megatron_lm_plugin=MegatronLMPlugin())
    given = torch.compile(model) if compiled else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, _, _, _ = acc.prepare(given, opt, MegatronLMDummyScheduler(opt, total_num_steps=5),
                                      DataLoader(data, batch_size=4))
    engine.eval()
    with torch.no_grad():
        loss = engine(**batch).loss.item()
    return loss, [str(w.message) for w in caught if "torch.compile" in str(w.message)]


def _compiled_worker():
    from megatron_plugin import Accelerator, MegatronLMPlugin

    plain, plain_warnings = _eval_loss(tiny_gpt2(), compiled=False)
    compiled, compiled_warnings = _eval_loss(tiny_gpt2(), compiled=True)
    part = tiny_gpt2()  # one block compiled: its parameters are named transformer.h.0._orig_mod.*
    part.transformer.h[0] = torch.compile(part.transformer.h[0])
    opt = optimizer_for(part)
    errors = {}
    expecter(errors)("part", Accelerator(megatron_lm_plugin=MegatronLMPlugin()).prepare,
                     part, opt, DataLoader(token_dataset(8, part.config.vocab_size), batch_size=4))
    return plain, compiled, plain_warnings, compiled_warnings, errors["part"]


def test_torch_compiled_hf_model_is_unwrapped():
    """A model wrapped by torch.compile (an OptimizedModule, parameters named `_orig_mod.*`) raised KeyError
    inside prepare; now the HF model inside it is prepared, with one warning saying how the Megatron layers
    get compiled. A model with a compiled submodule is refused, naming the parameter."""
    ((plain, compiled, plain_warnings, compiled_warnings, part),) = run_on_ranks(_compiled_worker, 1)
    assert compiled == plain, (compiled, plain)
    assert plain_warnings == []
    assert len(compiled_warnings) == 1, compiled_warnings
    for words in ("_orig_mod", "torch_compile", "dynamo_backend"):
        assert words in compiled_warnings[0], compiled_warnings
    check_refusal(part, "model", "transformer.h.0._orig_mod.", "before compiling", exact=True)
