"""Checks of the accelerate config YAML a run was launched with.

`accelerate launch` copies only the `megatron_lm_*` keys it knows into the environment and drops the
rest without a word, so a misspelled key (`megatron_lm_tp_degre: 2`) silently trains with TP=1. The
launched script cannot see the YAML, but its parent process is the launcher: we read the config file
from the launcher's command line (or accelerate's default config file) and refuse unknown keys.
"""

from __future__ import annotations

import difflib
import os
from typing import Optional

from .errors import MegatronPluginConfigError


def known_megatron_keys() -> set:
    """The `megatron_lm_*` settings `accelerate launch` understands."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    return {a.dest for a in parser._actions if a.dest.startswith("megatron_lm_")}


def _launcher_config_file(pid: int) -> Optional[str]:
    """`--config_file` of an `accelerate launch` process, as an absolute path (None if it is not one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    # `accelerate launch ...` or `python -m accelerate.commands.launch ...`
    is_launcher = "accelerate.commands.launch" in argv or (
        "launch" in argv and any(os.path.basename(a) == "accelerate" for a in argv[:3]))
    if not is_launcher:
        return None
    for i, arg in enumerate(argv):
        if arg == "--config_file" and i + 1 < len(argv):
            return os.path.join(cwd, argv[i + 1])
        if arg.startswith("--config_file="):
            return os.path.join(cwd, arg.split("=", 1)[1])
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


def _unreadable(path: str, what: str, line: Optional[int], column: Optional[int], problem: str):
    where = f" at line {line}, column {column}" if line is not None else ""
    return MegatronPluginConfigError(
        "--config_file", path, f"is not valid {what}{where} ({problem}): fix it, or write a new one with "
        "`megatron-plugin config`",
    )


def load_config(path: str) -> dict:
    """The YAML (or JSON) config as a dict, or a clear error naming the file and the line."""
    import json

    import yaml

    what = "JSON" if path.endswith(".json") else "YAML"
    try:
        with open(path, encoding="utf-8") as f:  # as accelerate reads it
            data = json.load(f) if what == "JSON" else yaml.safe_load(f)
    except OSError as err:
        raise MegatronPluginConfigError("--config_file", path, f"cannot read it ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise _unreadable(path, what, None, None, f"not UTF-8 text: byte {err.start}") from None
    except json.JSONDecodeError as err:
        raise _unreadable(path, what, err.lineno, err.colno, err.msg) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise _unreadable(path, what, mark and mark.line + 1, mark and mark.column + 1, problem) from None
    if not isinstance(data, dict):
        raise MegatronPluginConfigError(
            "--config_file", path, ("is empty" if data is None else f"holds a {type(data).__name__}, not a mapping "
                                    "of settings (key: value)") + ": write one with `megatron-plugin config`",
        )
    return data


def _one_of(key: str, value, choices, path: str, fix: Optional[str] = None) -> None:
    """Refuse a value not among `choices`, with the closest one as a hint."""
    if value in choices:
        return
    if isinstance(value, bool):  # YAML reads a bare no/yes/off/on as a boolean
        fix = f"YAML reads a bare {'yes' if value else 'no'} as {value}: quote the value, e.g. {key}: 'no'"
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise MegatronPluginConfigError(f"{key} in {path}", value, hint + (fix or f"use one of {sorted(choices)}"))


def _check_top_level(data: dict, path: str, launching: bool) -> None:
    """What accelerate's config loader would refuse with a raw ValueError, or ignore without a word."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType, DynamoBackend, PrecisionType

    # fp16 and dynamo_backend: older spellings accelerate still reads
    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    for key in data:
        _one_of("key", key, known, path, "accelerate refuses keys it does not know: remove it, or fix its spelling")
    if "compute_environment" in data:
        _one_of("compute_environment", data["compute_environment"], ["LOCAL_MACHINE"], path,
                "use LOCAL_MACHINE (or remove the key): Megatron runs are launched on the machines themselves")
    if "distributed_type" in data:
        _one_of("distributed_type", data["distributed_type"], [t.value for t in DistributedType], path)
    elif launching:
        raise MegatronPluginConfigError(f"distributed_type in {path}", None, "add `distributed_type: MEGATRON_LM`")
    if data.get("megatron_lm_config") and data.get("distributed_type", "MEGATRON_LM") != "MEGATRON_LM":
        raise MegatronPluginConfigError(
            f"distributed_type in {path}", data["distributed_type"],
            "accelerate launch reads megatron_lm_config only with `distributed_type: MEGATRON_LM`: set it, or "
            "remove megatron_lm_config",
        )
    if data.get("mixed_precision") is not None:
        _one_of("mixed_precision", data["mixed_precision"], [p.value for p in PrecisionType], path)
    dynamo = data.get("dynamo_config") or {}
    if not isinstance(dynamo, dict):
        raise MegatronPluginConfigError(f"dynamo_config in {path}", dynamo, "must be a mapping, e.g. {dynamo_backend: INDUCTOR}")
    if dynamo.get("dynamo_backend") is not None:
        _one_of("dynamo_config.dynamo_backend", str(dynamo["dynamo_backend"]).upper(), [b.value for b in DynamoBackend], path)
    if launching and "num_processes" not in data:
        raise MegatronPluginConfigError(f"num_processes in {path}", None,
                                        "add `num_processes: N` (the processes to start: GPUs, or CPU processes)")


def check_config(data: dict, path: str, launching: bool = False) -> None:
    """Refuse settings `accelerate launch` would ignore or that cannot run. `launching`: checked before
    `accelerate launch` runs, with the YAML all it gets (distributed_type and num_processes must be there)."""
    megatron = data.get("megatron_lm_config") or {}
    if not isinstance(megatron, dict):
        raise MegatronPluginConfigError(f"megatron_lm_config in {path}", megatron, "must be a mapping of megatron_lm_* keys")
    known = known_megatron_keys()
    for key in megatron:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {sorted(known)}"
            raise MegatronPluginConfigError(
                f"megatron_lm_config.{key} in {path}", megatron[key],
                f"accelerate launch ignores unknown keys, so this setting would have no effect: {hint}",
            )
    n = data.get("num_processes")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise MegatronPluginConfigError(f"num_processes in {path}", n, "use a whole number >= 1")
    _check_top_level(data, path, launching)


def check_launch() -> Optional[str]:
    """Check the config file of the `accelerate launch` that started this process, if there is one.
    Returns its path."""
    path = _launcher_config_file(os.getppid())
    if path is None:
        return None
    check_config(load_config(path), path)
    return path
