"""Run a function on N CPU processes over gloo, as `accelerate launch` would, and collect results."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

TIMEOUT_S = int(os.environ.get("MP_TEST_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, out_dir, fn, args, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report it to the parent, whatever it is
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        from megatron_plugin.distributed import destroy

        destroy()


def run_on_ranks(fn, world_size: int, *args, env: dict | None = None):
    """Spawn `world_size` processes running `fn(*args)`; return the list of their return values.
    Raises with the failing rank's traceback, or if the processes outlive the timeout."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world_size, _free_port(), out_dir, fn, args, env or {}),
            nprocs=world_size, join=False, start_method="spawn",
        )
        import time

        def load(rank):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            return torch.load(path, weights_only=False) if os.path.exists(path) else None

        def failure():
            for rank in range(world_size):
                got = load(rank)
                if got is not None and not got["ok"]:
                    return f"rank {rank} of {world_size} failed:\n{got['error']}"

        deadline = time.time() + TIMEOUT_S
        while not ctx.join(timeout=2):
            # A failed rank leaves its peers waiting in a collective: stop them now.
            error = failure() or (time.time() > deadline and f"{fn.__name__} timed out after {TIMEOUT_S}s")
            if error:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(error)
        error = failure()
        if error:
            raise AssertionError(error)
        return [load(rank)["result"] for rank in range(world_size)]
