"""Run a function on N local gloo ranks in spawned processes and collect what each returns.

Used by the tests (tests/dist_utils.py) and by checks that need a few CPU ranks without torchrun
(`titan-tpu hf-sweep`). `fn` must be a module-level function (spawned processes import it by
name) and return something `torch.save` can write; a rank that raises is re-raised here with that
rank's traceback; a hang is killed after `timeout_s`.

The rendezvous store (a TCPStore server) lives in this, the parent, process and the ranks are its
clients, as under torchrun, whose agent hosts the store: the OS picks the port as the server binds
it, so no other process can take it in between, and no rank runs a store server thread. A rank
that finished leaves with os._exit, skipping interpreter finalization, which a gloo worker thread
can abort (docs/known-issues.md, 1b).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_tpu.parallel.gloo import use_single_thread_gloo

__all__ = ["run_ranks"]


def _worker(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, args: tuple, kwargs: dict,
            num_threads: int) -> None:
    # Ranks share the machine's cores; one thread each keeps them from oversubscribing it.
    torch.set_num_threads(num_threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)  # a client of the parent's server
    use_single_thread_gloo()  # gloo's transport is not safe with two collectives of a group at once
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(*args, **kwargs)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization (the result is on disk): a gloo worker thread still
    # releasing a finished collective while Python finalizes is killed inside a noexcept
    # destructor, and the process aborts (docs/known-issues.md, 1b). A failure above skips this and
    # reaches torch.multiprocessing's error reporting as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, *, world_size: int, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 120.0, num_threads: int = 1) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results."""
    # The store server: port 0 lets the OS pick a free port as it binds; ranks connect as clients.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="titan_tpu_dist_") as result_dir:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, store.port, result_dir, args, kwargs or {}, num_threads),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=0.5):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"distributed run of {fn.__name__} took longer than {timeout_s} s")
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
