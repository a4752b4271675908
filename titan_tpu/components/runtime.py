"""The process a run lives in: its rank in the process group, the order in which ranks fill a
shared cache (and how they wait for each other meanwhile, without a timeout)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from titan_tpu.device import Backend
from titan_tpu.parallel.gloo import use_single_thread_gloo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_distributed(backend: Backend) -> tuple[int, int]:
    """(rank, world size); joins the process group when launched by torchrun with WORLD_SIZE > 1,
    then starts the device's runtime (JAX's, for compile.backend jax)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        use_single_thread_gloo()  # every gloo group, this one or later ones (docs/known-issues.md, 1d)
        dist.init_process_group(backend=backend.process_group_backend)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    backend.start(rank, world_size)
    return rank, world_size


@contextmanager
def main_process_first(*, log: Callable[[str], None] | None = None, what: str = "rank 0") -> Iterator[None]:
    """Rank 0 runs the body first (tokenizing, filling a cache), then the other ranks run it
    (finding the cache, or filling their host's own); every rank leaves together. A plain block on
    one process. The ranks wait for each other on the rendezvous store (`wait_for_every_rank`), not
    in a collective, so a body that takes longer than the process group's timeout (a corpus
    tokenized on the fly) never fails the run; rank 0 logs, once a minute, that it is waiting for
    `what` when the others are the slow ones."""
    distributed = dist.is_initialized()
    is_main = not distributed or dist.get_rank() == 0
    if distributed and not is_main:
        wait_for_every_rank("main-first")  # rank 0's turn
    yield
    if distributed and is_main:
        wait_for_every_rank("main-first")  # the others' turn
    if distributed:
        wait_for_every_rank("main-first-done", log=log, what=what)


_WAITS: dict[str, int] = {}  # how many times this process has waited under each name


def wait_for_every_rank(name: str, *, log: Callable[[str], None] | None = None, what: str = "the other ranks",
                        note_every_s: float = 60.0) -> None:
    """Return once every rank of the default process group has called this with `name`, however
    long that takes: a barrier held on the rendezvous store (the TCPStore every backend's process
    group is built on), not a collective, so neither gloo's nor NCCL's timeout applies while one
    rank works (a `dist.barrier` waits at most the group's timeout, 30 minutes by default, and then
    fails the run). Each rank adds 1 to a counter and polls it until it reaches the world size. A
    rank that dies while the others wait ends the run as before: torchrun stops them, and a rank
    whose store server (rank 0, without torchrun) is gone fails its next poll. Rank 0 calls `log`
    once every `note_every_s` seconds while it waits, naming `what` it waits for. Every rank must
    call it the same number of times under a name, as with a collective."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    world = dist.get_world_size()
    count = _WAITS[name] = _WAITS.get(name, -1) + 1
    # Unique per launch of the ranks: torchrun's restarts of a job may share its store.
    key = f"titan_tpu/wait/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}/{count}"
    store = distributed_c10d._get_default_store()
    arrived = store.add(key, 1)
    start = time.monotonic()
    next_note, pause = start + note_every_s, 0.005
    while arrived < world:
        time.sleep(pause)
        pause = min(pause * 1.5, 1.0)
        arrived = store.add(key, 0)
        if log is not None and dist.get_rank() == 0 and time.monotonic() >= next_note:
            log(f"waiting for {what}: {world - arrived} of {world} ranks not there yet after "
                f"{time.monotonic() - start:.0f} s")
            next_note += note_every_s
