"""Checks of the accelerate config YAML a run was launched with.

`accelerate launch` copies only the `megatron_lm_*` keys it knows into the environment and drops the
rest without a word, so a misspelled key (`megatron_lm_tp_degre: 2`) silently trains with TP=1. The
launched script cannot see the YAML, but its parent process is the launcher: we read the config file
from the launcher's command line (or accelerate's default config file) and refuse unknown keys.

The keys saying where processes run (num_machines, machine_rank, main_process_ip, ...) are checked as
torchrun will use them, with the launcher's own flags applied: on several machines one YAML is shared
and each machine's launcher gets its own --machine_rank.
"""

from __future__ import annotations

import difflib
import os
from typing import Optional

from .errors import MegatronPluginConfigError

# the keys saying where the processes run, which `accelerate launch` also takes as flags of the same name
MACHINE_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend", "same_network")
# torch.distributed.run's rendezvous backends (c10d and etcd need same_network: false, see check_machines)
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")


def known_megatron_keys() -> set:
    """The `megatron_lm_*` settings `accelerate launch` understands."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    return {a.dest for a in parser._actions if a.dest.startswith("megatron_lm_")}


def _launcher_argv(pid: int):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        return argv, os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None, None


def launcher_overrides(argv) -> dict:
    """The MACHINE_KEYS an `accelerate launch` command line (its whole argv) sets, read with accelerate's
    own parser; {} for anything else. rdzv_backend and same_network come back always: accelerate reads
    them from the command line only (their flags' defaults hide the YAML's values)."""
    from accelerate.commands.launch import launch_command_parser

    for i, arg in enumerate(argv):
        if arg == "accelerate.commands.launch" or (arg == "launch" and i and os.path.basename(argv[i - 1]) == "accelerate"):
            rest = argv[i + 1:]
            break
    else:
        return {}
    import contextlib
    import io

    parser = launch_command_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(rest)
    except SystemExit:  # a command line accelerate refused: not ours to judge
        return {}
    return {key: getattr(args, key) for key in MACHINE_KEYS if getattr(args, key, None) is not None}


def _launcher_config_file(pid: int) -> Optional[str]:
    """`--config_file` of an `accelerate launch` process, as an absolute path (None if it is not one)."""
    argv, cwd = _launcher_argv(pid)
    if argv is None:
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
    from accelerate.utils.constants import TORCH_DYNAMO_MODES

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
    if dynamo.get("dynamo_mode") is not None:
        _one_of("dynamo_config.dynamo_mode", str(dynamo["dynamo_mode"]), list(TORCH_DYNAMO_MODES), path)
    if launching and "num_processes" not in data:
        raise MegatronPluginConfigError(f"num_processes in {path}", None,
                                        "add `num_processes: N` (the processes to start: GPUs, or CPU processes)")


def check_config(data: dict, path: str, launching: bool = False, given: Optional[dict] = None,
                 launcher: str = "accelerate launch") -> None:
    """Refuse settings `accelerate launch` would ignore or that cannot run. `launching`: checked before
    `accelerate launch` runs, with the YAML all it gets (distributed_type and num_processes must be there).
    `given`: MACHINE_KEYS set on the command line of `launcher`, which win over the YAML's."""
    given = given or {}
    data = {**data, **given}

    def where(key):
        return f"--{key} of {launcher}" if key in given else f"{key} in {path}"

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
        raise MegatronPluginConfigError(where("num_processes"), n, "use a whole number >= 1")
    _check_top_level(data, path, launching)
    check_machines(data, where)


def _whole(where, key, value, low, fix):
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise MegatronPluginConfigError(where(key), value, fix)


def check_machines(data: dict, where) -> None:
    """The keys saying where the processes run, as accelerate launch and torchrun will read them.
    `where(key)` names a key in the error (the YAML's key, or the flag that set it).

    num_processes is the total over all machines (accelerate starts num_processes / num_machines on each)."""
    machines = data.get("num_machines", 1)
    _whole(where, "num_machines", machines, 1, "use a whole number >= 1: how many machines run this training")
    rank = data.get("machine_rank", 0)
    _whole(where, "machine_rank", rank, 0, f"use this machine's rank, a whole number from 0 to {machines - 1}")
    if rank >= machines:
        raise MegatronPluginConfigError(
            where("machine_rank"), rank, f"machine ranks run from 0 to num_machines-1={machines - 1}: give each machine "
            "its own rank (under SLURM: --machine_rank $SLURM_NODEID)")
    n = data.get("num_processes")
    if isinstance(n, int) and not isinstance(n, bool) and n % machines:
        raise MegatronPluginConfigError(
            where("num_processes"), n, f"num_processes is the total over all {machines} machines and each runs the same "
            f"number: use a multiple of num_machines={machines}, e.g. {machines * -(-n // machines)}")
    ip = data.get("main_process_ip")
    if ip is not None and (not isinstance(ip, str) or not ip.strip() or any(c.isspace() for c in ip) or "://" in ip):
        raise MegatronPluginConfigError(where("main_process_ip"), ip, "use the bare address (IP or hostname) of the "
                                        "machine of rank 0, e.g. 10.0.0.1; the port goes in main_process_port")
    if machines > 1 and ip is None:
        raise MegatronPluginConfigError(
            where("main_process_ip"), None, f"with num_machines={machines}, every machine must reach the machine of rank "
            "0: give its address (under SLURM: the first of `scontrol show hostnames $SLURM_JOB_NODELIST`)")
    port = data.get("main_process_port")
    if port is not None:
        _whole(where, "main_process_port", port, 0, "use a TCP port number from 1 to 65535, e.g. 29500")
        if port > 65535 or (port == 0 and machines > 1):
            raise MegatronPluginConfigError(
                where("main_process_port"), port, "use a TCP port number from 1 to 65535, e.g. 29500" +
                (" (0, a free port, is chosen on each machine apart: they would not meet)" if port == 0 else ""))
    backend = data.get("rdzv_backend", "static")
    if backend not in RDZV_BACKENDS:
        close = difflib.get_close_matches(str(backend), RDZV_BACKENDS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise MegatronPluginConfigError(where("rdzv_backend"), backend, hint + f"use one of {list(RDZV_BACKENDS)}: "
                                        "static (fixed machines, the default) or c10d (torchrun's elastic rendezvous)")
    same = data.get("same_network", False)
    if not isinstance(same, bool):
        raise MegatronPluginConfigError(where("same_network"), same, "use true or false")
    if machines > 1 and same and backend != "static":
        # torchrun then gets master_addr/port and no rendezvous endpoint, which only static rendezvous reads
        raise MegatronPluginConfigError(
            where("rdzv_backend"), backend, f"the {backend} rendezvous meets at main_process_ip:main_process_port, "
            "which accelerate hands to torchrun only with same_network: false: set same_network: false, or use static")


def check_launch() -> Optional[str]:
    """Check the config file of the `accelerate launch` that started this process, if there is one.
    Returns its path."""
    path = _launcher_config_file(os.getppid())
    if path is None:
        return None
    data = load_config(path)
    argv, _ = _launcher_argv(os.getppid())
    given = launcher_overrides(argv or [])
    # the launcher's flags win over the YAML (under SLURM: --machine_rank $SLURM_NODEID)
    check_config(data, path, given=given)
    backend = given.get("rdzv_backend", data.get("rdzv_backend", "static"))
    for key in ("rdzv_backend", "same_network"):
        if key == "same_network" and backend == "static":
            continue  # static rendezvous meets at the same address either way: nothing was lost
        if os.environ.get("LOCAL_RANK", "0") != "0":
            continue  # once per machine is enough
        if key in given and key in data and data[key] != given[key] and data.get("num_machines", 1) > 1:
            import logging

            logging.getLogger(__name__).warning(
                "%s: %r in %s was not used: accelerate launch reads it from its command line only (it ran with %r). "
                "Pass --%s to accelerate launch, or launch with `megatron-plugin launch`, which passes it on",
                key, data[key], path, given[key], key)
    return path
