"""Checkpoint folders across machines: every rank writes its own part of a checkpoint into the folder it is
given, so on several machines that folder must be one shared folder (a network file system). A folder
local to each machine would "save" fine and leave every machine with a fragment no load can use; the
check below finds that at the first save, before anything is written, and at a load.

Save: rank 0 makes the folder and writes a probe file holding a random nonce (the nonce is also in its
name: a client's cache of a name looked up earlier cannot hide it); every rank reads it back; one
all-gather tells every rank who saw it, and rank 0 removes it. A folder that passed is not probed again in
the same run (kept per engine): periodic saves into it cost one tiny all-gather, no file.

Load: every rank looks for the checkpoint itself (the format's `recognizes`); when rank 0 finds one and
other ranks find none, or one of another format, every rank raises one error naming the hosts that cannot
see it. (Ranks do not compare folder listings: a network file system's cached listing may lag right after
a save, and a checkpoint that differs is caught by the load's own checks.)
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import weakref
from collections import defaultdict
from typing import Callable, Optional

import torch.distributed as dist

from ...errors import MegatronPluginConfigError
from ...fs import check_writable

SAVE_SETTING = "save_state(output_dir)"
LOAD_SETTING = "load_state input_dir"
PROBE_PREFIX = ".megatron_plugin_shared_probe."
# A network file system may show another machine's new file late (attribute caching): a rank that does not
# see the probe looks again until this many seconds have passed, before calling the folder unshared. Only a
# failing check waits.
WAIT_ENV = "MEGATRON_PLUGIN_SHARED_DIR_WAIT_S"
DEFAULT_WAIT_S = 10.0

# engine -> folders (absolute paths) that passed the save check in its run
_VERIFIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wait_s() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_WAIT_S
    except ValueError:
        raise MegatronPluginConfigError(WAIT_ENV, raw, "must be a number of seconds, e.g. 10") from None


def _host() -> str:
    return socket.gethostname()


def _by_host(ranks_hosts) -> str:
    """'hostA (ranks 2, 3), hostB (rank 5)'"""
    hosts = defaultdict(list)
    for rank, host in ranks_hosts:
        hosts[host].append(rank)
    return ", ".join(f"{h} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for h, r in hosts.items())


def _sees(path: str, nonce: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        try:
            with open(path) as f:
                if f.read() == nonce:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def _write_probe(path: str):
    """Rank 0: (nonce, probe file, problem) with the folder made and the probe written, or the problem."""
    nonce, probe, problem = secrets.token_hex(16), None, None
    try:
        check_writable(path, SAVE_SETTING)
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, PROBE_PREFIX + nonce)
        with open(probe, "w") as f:
            f.write(nonce)
            f.flush()
            os.fsync(f.fileno())  # on the server before any rank looks
    except MegatronPluginConfigError as err:
        problem = (err.setting, err.value, err.fix)
    except OSError as err:
        problem = (SAVE_SETTING, path, f"cannot write there ({err.strerror}): choose another folder")
    return nonce, probe, problem


def check_shared_for_save(output_dir: str, owner=None) -> None:
    """Collective: raise on every rank, before anything is written, when some ranks cannot see the files
    rank 0 writes into `output_dir` (each rank passes its own path: ranks given different folders fail too).
    `owner` (the engine) keeps the folders that passed for the rest of its run: a save into one of them
    costs one tiny all-gather and no file (the ranks must decide together: a rank given another folder than
    the one that passed is probed again, with every rank)."""
    path = os.path.abspath(output_dir)
    verified = _VERIFIED.setdefault(owner, set()) if owner is not None else set()
    if dist.get_world_size() == 1:
        verified.add(path)
        return
    wait_s = _wait_s()  # a bad value fails on every rank alike, before any collective
    rank, world = dist.get_rank(), dist.get_world_size()
    known = path in verified
    made = rank == 0 and not os.path.exists(path)  # a refused save removes the folder its probe made
    nonce, probe, problem = _write_probe(path) if rank == 0 and not known else (None, None, None)
    everyone = [None] * world
    dist.all_gather_object(everyone, (known, nonce, problem))
    if all(k for k, _, _ in everyone):
        return
    _, nonce, problem = everyone[0]
    if nonce is None and problem is None:  # rank 0 knew its folder, another rank did not: probe it now
        box = [_write_probe(path)[::2] if rank == 0 else None]
        if rank == 0:
            probe = os.path.join(path, PROBE_PREFIX + box[0][0]) if box[0][1] is None else None
        dist.broadcast_object_list(box, src=0)
        nonce, problem = box[0]
    if problem is not None:
        raise MegatronPluginConfigError(*problem)
    seen = _sees(os.path.join(path, PROBE_PREFIX + nonce), nonce, wait_s)
    everyone = [None] * world
    dist.all_gather_object(everyone, (seen, _host()))
    if rank == 0 and probe is not None:  # every rank has looked
        try:
            os.remove(probe)
        except OSError:
            pass
    blind = [(r, host) for r, (ok, host) in enumerate(everyone) if not ok]
    if blind:
        verified.discard(path)
        if made:
            try:
                os.rmdir(path)  # only if empty: made for the probe, nothing else is in it
            except OSError:
                pass
        dist.barrier()  # the probe is gone before the error reaches any script: the folder is as it was
        raise MegatronPluginConfigError(
            SAVE_SETTING, path,
            f"{len(blind)} of {world} ranks (hosts: {_by_host(blind)}) do not see the files rank 0 "
            f"(host {everyone[0][1]}) writes there: the folder must be shared by every machine (a network file "
            "system); pass a shared path. Nothing was saved",
        )
    verified.add(path)


def _look(find: Callable[[], object]):
    """(what `find()` returned, None) or (None, its MegatronPluginConfigError as (setting, value, fix))."""
    try:
        return find(), None
    except MegatronPluginConfigError as err:
        return None, (err.setting, err.value, err.fix)


def find_for_load(input_dir, find: Callable[[], object]):
    """Collective: `find()` (the format that recognizes `input_dir`, or a MegatronPluginConfigError) on
    every rank. When rank 0 finds a checkpoint that some ranks do not (no folder there, no checkpoint, or one
    of another format), those look again for a while (a network file system may show new files late), then
    every rank raises one error naming the hosts that cannot see it; otherwise as `collective.agree`: any
    rank's error is raised on every rank (a rank's own where it has one)."""
    world, wait_s = dist.get_world_size(), _wait_s()  # a bad wait fails on every rank alike, before any collective
    here = os.path.abspath(input_dir) if input_dir is not None else None
    found, problem = _look(find)
    everyone = [None] * world
    dist.all_gather_object(everyone, (problem, getattr(found, "name", None), _host(), here))
    first_problem, first_name, first_host, first_path = everyone[0]
    if first_problem is None and any(p is not None or n != first_name for p, n, _, _ in everyone):
        if problem is not None or getattr(found, "name", None) != first_name:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                time.sleep(0.5)
                found, problem = _look(find)
                if problem is None and getattr(found, "name", None) == first_name:
                    break
        everyone = [None] * world
        dist.all_gather_object(everyone, (problem, getattr(found, "name", None), _host(), here))
        blind = [(r, host) for r, (p, n, host, _) in enumerate(everyone) if p is not None or n != first_name]
        if blind:
            raise MegatronPluginConfigError(
                LOAD_SETTING, input_dir,
                f"rank 0 (host {first_host}) finds a checkpoint in {first_path}, "
                f"but it is not visible on hosts {_by_host(blind)} ({len(blind)} of {world} ranks find no such "
                "folder or no checkpoint there, or another one): the folder must be shared by every machine (a "
                "network file system); pass a shared path",
            )
    if first_problem is None and problem is None:
        return found
    mine: Optional[tuple] = problem or next(p for p, _, _, _ in everyone if p is not None)
    raise MegatronPluginConfigError(*mine)
