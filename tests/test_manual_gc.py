"""Megatron-LM's manual garbage collection (engine/manual_gc.py): with `manual_gc` Python's threshold collector is
off from the first training step, and full collections happen only at the chosen points: every
`manual_gc_interval` steps, and where evaluation starts and ends (`manual_gc_eval`)."""

import pytest

from megatron_plugin import MegatronLMPlugin
from tests.errors import check_refusal, refusal
from tests.spawn import run_on_ranks


def _run(manual_gc, interval, at_eval):
    import gc

    from tests.training import prepared_gpt2

    full, young = [], []  # the step index at each full collection (generation 2), and at the others
    step = [0]

    def on_gc(phase, info):
        if phase == "start":
            (full if info["generation"] == 2 else young).append(step[0])

    gc.callbacks.append(on_gc)
    acc, engine, batches = prepared_gpt2(steps_before=0, manual_gc=manual_gc, manual_gc_interval=interval,
                                         manual_gc_eval=at_eval)
    enabled_before = gc.isenabled()
    losses = []
    for i in range(1, 5):
        step[0] = i
        losses.append(engine(**next(batches)).loss.item())
        # garbage a threshold collector would have collected by now: 200k cycles
        for _ in range(200_000):
            a = []
            a.append(a)
    step[0] = "log_probs"  # compute_log_probs switches to eval() and back: not an evaluation's edges
    engine.compute_log_probs(next(batches))
    step[0] = "eval"
    engine.eval()
    step[0] = "train"
    engine.train()
    enabled_after = gc.isenabled()
    step[0] = 0  # what end_training itself collects is not counted
    acc.end_training()
    enabled_at_end = gc.isenabled()
    gc.callbacks.remove(on_gc)
    gc.enable()  # the worker process serves later tests
    # collections during prepare and end_training (step 0) are theirs
    return dict(enabled_before=enabled_before, enabled_after=enabled_after, enabled_at_end=enabled_at_end,
                full=[s for s in full if s != 0], young=[s for s in young if s != 0], losses=losses)


@pytest.mark.parametrize("interval,at_eval", [(2, True), (0, False)])
def test_manual_gc_collects_at_the_chosen_points_only(interval, at_eval):
    (got,) = run_on_ranks(_run, 1, True, interval, at_eval)
    assert got["enabled_before"] and not got["enabled_after"] and got["enabled_at_end"]  # end_training: back on
    # the first step's own collection, then every `interval` steps (the step counted after it), then eval's two
    want = [1] + [i for i in range(1, 5) if interval and i % interval == 0] + (["eval", "train"] if at_eval else [])
    assert got["full"] == want and got["young"] == [], got
    (plain,) = run_on_ranks(_run, 1, False, 0, True)
    assert plain["enabled_after"]
    # the threshold collector ran on its own over the 800k cycles; the losses are the same either way
    assert len(plain["young"]) > 100 and plain["full"] != want, plain
    assert plain["losses"] == got["losses"]


def test_manual_gc_refusals():
    cases = {
        "flag": (dict(manual_gc="yes"), "manual_gc", "True or False"),
        "eval": (dict(manual_gc_eval=1), "manual_gc_eval", "True or False"),
        "negative": (dict(manual_gc=True, manual_gc_interval=-1), "manual_gc_interval", ">= 0"),
        "float": (dict(manual_gc=True, manual_gc_interval=2.5), "manual_gc_interval", ">= 0"),
    }
    for name, (kwargs, setting, words) in cases.items():
        check_refusal(refusal(MegatronLMPlugin, **kwargs), setting, words, exact=True, where=name)
