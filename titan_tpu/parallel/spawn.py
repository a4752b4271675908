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

Ranks are forked from multiprocessing's fork server, a clean process started once per calling
process that has imported torch, titan_tpu and the first caller's module (not from the caller, whose
threads and state a fork would copy). A fresh interpreter per rank ("spawn") imports torch again each
time: on a 2-core machine that was seconds per start, most of what a short multi-process test
costs. A forked rank gets the caller's environment, working directory and sys.path, as a spawned
one did.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_tpu.parallel.gloo import use_single_thread_gloo

__all__ = ["run_ranks"]

# Imported once by the fork server, so that no rank imports them again.
RANK_PRELOAD = ("torch", "torch.distributed.tensor", "titan_tpu.loops.pretrain")


def _worker(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, args: tuple, kwargs: dict,
            num_threads: int, environ: dict[str, str], pg_timeout_s: float | None = None) -> None:
    # Everything the fork server imported (torch, titan_tpu, the caller's module) lives as long as
    # the rank: move it out of the collector's generations, so that no collection walks it again.
    gc.freeze()
    # The fork server's environment is the caller's as it was when the server started: take the
    # caller's of now (multiprocessing passes the working directory and sys.path itself).
    os.environ.clear()
    os.environ.update(environ)
    # Ranks share the machine's cores; one thread each keeps them from oversubscribing it.
    torch.set_num_threads(num_threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)  # a client of the parent's server
    use_single_thread_gloo()  # gloo's transport is not safe with two collectives of a group at once
    timeout = None if pg_timeout_s is None else timedelta(seconds=pg_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(*args, **kwargs)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
        # A rank whose `fn` runs no collective could leave while another is still connecting its
        # gloo mesh, which then fails ("connection closed by peer"): every rank leaves together.
        # The wait is on the store, not a collective: `fn` may have set a short group timeout, or
        # left another rank in a collective of its own that is still timing out.
        _wait_for_every_rank(store, world_size)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization (the result is on disk): a gloo worker thread still
    # releasing a finished collective while Python finalizes is killed inside a noexcept
    # destructor, and the process aborts (docs/known-issues.md, 1b). A failure above skips this and
    # reaches torch.multiprocessing's error reporting as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _wait_for_every_rank(store: dist.TCPStore, world_size: int) -> None:
    """Return once every rank has called this (a barrier on the rendezvous store, which has no
    collective timeout; a rank that fails instead is reported by the parent, which stops the rest)."""
    if store.add("ranks_finished", 1) == world_size:
        store.set("all_ranks_finished", "1")
    store.wait(["all_ranks_finished"], timedelta(hours=1))


def run_ranks(fn: Callable, *, world_size: int, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 120.0, num_threads: int = 1, pg_timeout_s: float | None = None) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.
    `pg_timeout_s`: the process group's collective timeout (default: torch's, 30 minutes for gloo)."""
    # The store server: port 0 lets the OS pick a free port as it binds; ranks connect as clients.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    _preload_fork_server(fn)
    with tempfile.TemporaryDirectory(prefix="titan_tpu_dist_") as result_dir:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, store.port, result_dir, args, kwargs or {}, num_threads, dict(os.environ),
                  pg_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=0.5):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"distributed run of {fn.__name__} took longer than {timeout_s} s")
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _preload_fork_server(fn: Callable) -> None:
    """Name what the fork server imports when it starts (the first call in this process; later
    calls find it running and this has no effect): torch, titan_tpu's training stack, and `fn`'s
    module with its imports (in a test session: pytest and the test helpers). A module run as a
    script (`__main__`) is imported in each rank as under spawn."""
    modules = list(RANK_PRELOAD)
    if fn.__module__ != "__main__":
        modules.append(fn.__module__)
    mp.get_context("forkserver").set_forkserver_preload(modules)
