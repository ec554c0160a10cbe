"""Run a function on N CPU processes over gloo, as `accelerate launch` would, and collect results.

Importing torch, transformers and megatron-core costs a process about 9 s on the CI machine, more than
most tests take. So the processes of each world size are started once and kept: every call hands them
a task, and each task gets a fresh process group (new port), a clean environment and clean accelerate
and Megatron state. A task that fails or times out takes its workers down; the next call starts new
ones. `MP_TEST_FRESH=1` starts new processes for every call instead.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

TIMEOUT_S = int(os.environ.get("MP_TEST_TIMEOUT", "600"))
FRESH = os.environ.get("MP_TEST_FRESH", "0") == "1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_process_state():
    from megatron_plugin import patches
    from megatron_plugin.engine.distributed import destroy

    destroy()
    # the engine sets Inductor's C++ wrapper for the whole process (engine/gpu.use_cpp_wrapper): the next task
    # starts with the default, as a new script's process does
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.cpp_wrapper = False
    # the run's patches go; accelerate's hint stays: a process installs it once, at its first use of a
    # public name (cached after), as a script's process does
    patches.undo(*(n for n in patches.installed() if n != "accelerate_megatron_hint"))
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:  # accelerate not imported by the task
        pass


def _run_task(rank, world_size, task):
    port, out_dir, fn, args, env = task
    saved_env = dict(os.environ)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        report = {"ok": True, "result": fn(*args)}
    except BaseException:  # report it to the parent, whatever it is
        report = {"ok": False, "error": traceback.format_exc()}
    try:
        torch.save(report, path + ".tmp")  # renamed when complete: the parent never reads half a file
        os.replace(path + ".tmp", path)
    finally:
        _reset_process_state()
        os.environ.clear()
        os.environ.update(saved_env)


def _worker(rank, world_size, tasks, stack_path):
    torch.set_num_threads(1)
    # a timed-out task asks its workers for their stacks (SIGUSR1) before killing them: where a GPU run hung, in a
    # task or in the teardown after one (kept for the process's life: the teardown runs after the task's report)
    stacks = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import warnings

    warnings.filterwarnings("ignore")
    seed = torch.initial_seed()
    while True:
        task = tasks.get()
        if task is None:
            return
        torch.manual_seed(seed)  # every task starts from the RNG state of a new process
        _run_task(rank, world_size, task)


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self.queues = [ctx.Queue() for _ in range(world_size)]
        self.stack_dir = tempfile.mkdtemp(prefix="spawn_stacks_")
        self.stack_paths = [os.path.join(self.stack_dir, f"rank{r}.txt") for r in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.queues[r], self.stack_paths[r]),
                                  daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        shutil.rmtree(self.stack_dir, ignore_errors=True)

    def close(self):
        for q in self.queues:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()


_POOLS: dict = {}


def _pool(world_size: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool


@atexit.register
def _close_pools():
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _stacks(pool: _Pool) -> str:
    """Every worker's Python stacks (all threads), asked for by SIGUSR1: where each rank waits."""
    sizes = [os.path.getsize(p) if os.path.exists(p) else 0 for p in pool.stack_paths]
    for p in pool.procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2)
    parts = []
    for rank, (path, size) in enumerate(zip(pool.stack_paths, sizes)):
        try:
            with open(path) as f:
                f.seek(size)
                parts.append(f"\n--- rank {rank} stacks ---\n{f.read()}")
        except OSError:
            pass
    return "".join(parts)


def run_on_ranks(fn, world_size: int, *args, env: dict | None = None):
    """Run `fn(*args)` on `world_size` processes; return the list of their return values.
    Raises with the failing rank's traceback, or if the processes outlive the timeout.
    The rendezvous port is picked free but can be taken before rank 0 listens on it (seen once on the
    GPU machine): then the task runs again on another port, in fresh processes."""
    for attempt in range(3):
        try:
            return _run_on_ranks_once(fn, world_size, *args, env=env)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def _run_on_ranks_once(fn, world_size: int, *args, env: dict | None = None):
    with tempfile.TemporaryDirectory() as out_dir:
        pool = _pool(world_size)
        task = (_free_port(), out_dir, fn, args, env or {})
        for q in pool.queues:
            q.put(task)

        def load(rank):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            return torch.load(path, weights_only=False) if os.path.exists(path) else None

        def failure():
            for rank in range(world_size):
                got = load(rank)
                if got is not None and not got["ok"]:
                    return f"rank {rank} of {world_size} failed:\n{got['error']}"

        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))
        deadline = time.time() + TIMEOUT_S
        while True:
            done = all(os.path.exists(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world_size))
            if done:
                break
            # A failed rank leaves its peers waiting in a collective: stop them now.
            error = failure() or (time.time() > deadline and f"{name} timed out after {TIMEOUT_S}s"
                                  + _stacks(pool))
            if not error and not pool.alive():
                error = f"a worker process died while running {name}"
            if error:
                pool.kill()
                _POOLS.pop(world_size, None)
                raise AssertionError(error)
            time.sleep(0.05)
        results = [load(rank) for rank in range(world_size)]
        if FRESH:
            pool.close()
            _POOLS.pop(world_size, None)
        for rank, got in enumerate(results):
            if not got["ok"]:
                pool.kill()
                _POOLS.pop(world_size, None)
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{got['error']}")
        return [got["result"] for got in results]
