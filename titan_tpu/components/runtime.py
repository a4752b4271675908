"""The process a run lives in: its rank in the process group, the cache directory, the order in
which ranks fill a shared cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.device import Backend
from titan_tpu.parallel.gloo import use_single_thread_gloo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_cache_dir() -> Path:
    return Path(os.environ.get("TITAN_TPU_CACHE") or Path.home() / ".cache" / "titan_tpu")


def cached_bpe_tokenizer(source: str, texts: Callable[[], list[str]], *, kind: str, vocab_size: int, cache_dir: str,
                         log: Callable[[str], None]):
    """A byte-level BPE of the model's vocabulary trained on `texts()` (the text of `source`'s
    rows), cached under `cache_dir` by the source files' fingerprint, so a run and its resume read
    the same tokenizer. kind names the rows in the cache file and the log line ("preference",
    "prompt")."""
    import hashlib
    import json

    from titan_tpu.data.sources import files_fingerprint, resolve_files
    from titan_tpu.data.tokenizer import load_tokenizer, train_bpe_tokenizer

    key = hashlib.sha256(json.dumps([files_fingerprint(resolve_files(source)), vocab_size]).encode()).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / "tokenizers" / f"{kind}-{key}.json"
    if path.is_file():
        return load_tokenizer(path)
    rows = texts()
    path.parent.mkdir(parents=True, exist_ok=True)
    log(f"data: training a {vocab_size}-token BPE on the {kind} rows (no data.tokenizer_path)")
    tokenizer = train_bpe_tokenizer(rows, vocab_size=vocab_size, save_path=path)
    return load_tokenizer(path) if tokenizer.path is None else tokenizer


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
