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


def load_config(path: str) -> dict:
    """The YAML (or JSON) config as a dict, or a clear error naming the file and the line."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) if not path.endswith(".json") else __import__("json").load(f)
    except OSError as err:
        raise MegatronPluginConfigError("--config_file", path, f"cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise MegatronPluginConfigError(
            "--config_file", path, f"is not valid YAML{line} ({problem}): fix it, or write a new one with "
            "`megatron-plugin config`",
        ) from None
    if not isinstance(data, dict):
        raise MegatronPluginConfigError("--config_file", path, "must hold a mapping of settings (key: value)")
    return data


def check_config(data: dict, path: str) -> None:
    """Refuse settings `accelerate launch` would ignore or that cannot run."""
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


def check_launch() -> Optional[str]:
    """Check the config file of the `accelerate launch` that started this process, if there is one.
    Returns its path."""
    path = _launcher_config_file(os.getppid())
    if path is None:
        return None
    check_config(load_config(path), path)
    return path
