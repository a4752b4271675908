"""Single-process training checkpoints that are written atomically and resume exactly.

Layout under ``<run>/checkpoints/``::

    step-00000100/state.pt     model, optimizer, data position, RNG, step, model identity
    step-00000200/state.pt
    latest                     text file naming the newest *complete* checkpoint ("step-00000200")

A checkpoint is first written into a hidden temporary directory, flushed to disk and then renamed
into place; only after that does ``latest`` move (itself replaced atomically). A process killed at
any moment therefore leaves either the old or the new checkpoint complete, with ``latest`` on a
complete one. Sharded (DCP) checkpoints replace this file format in the SimpleFSDP issue; the
directory protocol stays.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class Checkpointer:
    def __init__(self, checkpoint_dir: str | Path, *, keep_latest_k: int = 0):
        self.dir = Path(checkpoint_dir)
        self.keep_latest_k = keep_latest_k

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step``; returns its directory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / step_dir_name(step)
        tmp = self.dir / f".{final.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with (tmp / STATE_FILE).open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        _atomic_write_text(self.dir / LATEST, final.name + "\n")
        self._prune()
        return final

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first (temporary ones are ignored)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.glob("step-*") if (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the one ``latest`` names, else the newest on disk."""
        pointer = self.dir / LATEST
        if pointer.is_file():
            named = self.dir / pointer.read_text().strip()
            if (named / STATE_FILE).is_file():
                return named
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for old in self.complete_checkpoints()[: -self.keep_latest_k]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.dir.glob(".step-*.tmp-*"):  # left behind by a process that died mid-save
            shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint directory (or its state.pt); one-line errors for missing or broken files."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: expected {file}; point at a step-XXXXXXXX directory "
                                "under <run>/checkpoints")
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or corrupted file
        raise ValueError(f"checkpoint {file} cannot be read ({type(e).__name__}: {e}); "
                         "it is damaged: delete it to fall back to an older checkpoint") from None
