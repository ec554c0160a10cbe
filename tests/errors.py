"""The bad-input tests' one utility: try a call, keep the MegatronPluginConfigError it raises (the setting
it names and its message), and check that the error names the setting and the fix.

A module of its own rather than a part of tests/training.py (the tiny training run): the checks of plugin
settings, launch configs and converters run in the pytest process and use it without any training, and
the launched workers hand what it collects back to their test."""

from __future__ import annotations


def _config_error():
    from megatron_plugin import MegatronPluginConfigError

    return MegatronPluginConfigError


def refusal(fn, *args, **kwargs):
    """(setting, message) of the MegatronPluginConfigError `fn(*args, **kwargs)` raises; None when it
    returns. Any other exception propagates."""
    try:
        fn(*args, **kwargs)
    except _config_error() as err:
        return err.setting, str(err)
    return None


def expecter(out: dict, state=None, keep_result=False, message_only=False):
    """`expect(name, fn, *args, **kwargs)`: calls `fn(*args, **kwargs)` and records in `out[name]` the
    (setting, message) of the MegatronPluginConfigError it raises, followed by `state(name)` when `state`
    is given (read as the error is caught: e.g. whether Megatron's groups existed yet); with
    `message_only`, the message alone. A call that returns records None, or its return value with
    `keep_result`. Any other exception propagates."""
    assert not (message_only and state is not None), "message_only records the message alone"

    def expect(name, fn, *args, **kwargs):
        try:
            value = fn(*args, **kwargs)
        except _config_error() as err:
            if message_only:
                out[name] = str(err)
            else:
                out[name] = (err.setting, str(err)) + ((state(name),) if state is not None else ())
        else:
            out[name] = value if keep_result else None
        return out[name]

    return expect


def check_refusal(got, setting, *words, exact=False, where=None):
    """`got`, a recorded refusal, names `setting` (is it, with `exact`) and its message holds every one of
    `words`: the value and the fix the error must state. `where` names the case in a failure."""
    assert got is not None, f"{where}: no error" if where is not None else "no error"
    assert (got[0] == setting) if exact else (setting in got[0]), (where, got) if where is not None else got
    for w in words:
        assert w in got[1], (where, w, got) if where is not None else (w, got)
