"""The process a run lives in: its rank in the process group, the cache directory, the order in
which ranks fill a shared cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.device import Backend
from titan_tpu.parallel.gloo import use_single_thread_gloo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_TPU_CACHE") or Path.home() / ".cache" / "titan_tpu")


def init_distributed(backend: Backend) -> tuple[int, int]:
    """(rank, world size); joins the process group when launched by torchrun with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        use_single_thread_gloo()  # every gloo group, this one or later ones (docs/known-issues.md, 1d)
        dist.init_process_group(backend=backend.process_group_backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the body first (tokenizing, filling a cache), then the other ranks run it
    (finding the cache); every rank leaves together. A plain block on one process."""
    distributed = dist.is_initialized()
    is_main = not distributed or dist.get_rank() == 0
    if distributed and not is_main:
        dist.barrier()  # rank 0's turn
    yield
    if distributed and is_main:
        dist.barrier()  # the others' turn
    if distributed:
        dist.barrier()
