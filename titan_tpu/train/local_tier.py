"""The local checkpoint tier: each rank's own shards in one file, written in seconds.

A persistent checkpoint (train/checkpoint.py) goes through DCP to shared storage and can take
longer than a preemption notice. The local tier is what a rank can write inside that notice:
its own pieces of the model and optimizer (a DTensor's local shard, with where it sits in the
global tensor), the data position, its RNG state; one ``torch.save`` to local storage (host
memory under /dev/shm by default), nothing exchanged but one agreement at the end::

    <local_dir>/step-00000120/
        rank-0-of-2.pt    rank 0's pieces, written to .rank-0-of-2.pt.tmp-<pid> then renamed
        rank-1-of-2.pt

A rank's file exists only once it is complete (temporary file, fsync, rename), so a process killed
while writing leaves the previous tier as it was: older tiers are removed only after every rank has
written the new one. A restart takes the newest tier that every rank can use: on the same number of
ranks a rank reads its own file; on another number each rank reads the pieces of every file that
overlap its own shards (all files must be visible: one host, or a shared local_dir).

The persistent tier stays the ground truth: a resume from the local tier writes a persistent
checkpoint of that step at once (the trainer: loops/pretrain.py), and a finished run removes its
local tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_tpu.errors import RunError
from titan_tpu.train import checkpoint
from titan_tpu.train.checkpoint import RNG_KEY, TENSOR_KEYS, _fsync_dir, _json_normalized

FORMAT = 1


class LocalTierError(RunError):
    """The local tier could not be written (on some rank); raised on every rank alike, one line."""
_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.pt")


def default_local_dir(run_dir: Path) -> Path:
    """Host memory (/dev/shm) where there is one, in a directory of this run's own; else beside the run."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
        return shm / f"titan_tpu-{os.getuid()}" / f"{Path(run_dir).name}-{key}"
    return Path(run_dir) / "checkpoints-local"


def _leaves(tree: dict, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path of keys, leaf) of a nested dict; paths, not joined names (parameter names hold dots)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        else:
            out.append(((*path, key), value))
    return out


def _set(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, the global shape, the local tensor's offset in the global tensor)."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(t.shape), tuple(offset)
    return t, tuple(t.shape), (0,) * t.dim()


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where it is a view into a larger storage (a layer of stacked scan weights):
    torch.save writes a tensor's whole storage."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


@contextlib.contextmanager
def _no_record_checksums():
    """torch.save without its CRC32 of every record: on host memory computing them took twice as
    long as the write (a 3.2 GB tier: 1.1 against 2.8 GB/s). The file needs none: it is renamed
    into place only once written and fsynced, and read back on the same host."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def _overlap(dst_offset, dst_shape, src_offset, src_shape) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """The slices of the destination and of the source piece that cover the same global elements."""
    dst, src = [], []
    for d_off, d_len, s_off, s_len in zip(dst_offset, dst_shape, src_offset, src_shape):
        lo, hi = max(d_off, s_off), min(d_off + d_len, s_off + s_len)
        if lo >= hi:
            return None
        dst.append(slice(lo - d_off, hi - d_off))
        src.append(slice(lo - s_off, hi - s_off))
    return tuple(dst), tuple(src)


class LocalTier:
    """One run's local tier under `directory` (module docstring); every rank calls save/newest/load."""

    def __init__(self, directory: str | Path, *, log: Callable[[str], None]):
        self.dir = Path(directory)
        self.log = log
        self.rank, self.world_size = checkpoint._rank(), checkpoint._world_size()

    # -- saving -----------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Write this rank's pieces of `state` (a Components.state_dict) as the tier of `step`; every
        rank together. Returns the seconds it took (the slowest rank's)."""
        start = time.perf_counter()
        pieces, rest = {}, {}
        for key in TENSOR_KEYS:
            for path, leaf in _leaves(state.get(key) or {}, (key,)):
                if isinstance(leaf, torch.Tensor):
                    local, shape, offset = _box(leaf)
                    pieces[path] = (_own_storage(local.detach().cpu()), shape, offset)
                else:
                    rest[path] = leaf
        meta = _json_normalized({k: v for k, v in state.items() if k not in TENSOR_KEYS and k != RNG_KEY})
        payload = {"format": FORMAT, "step": step, "rank": self.rank, "world_size": self.world_size, "pieces": pieces,
                   "leaves": rest, "meta": meta, "rng": state.get(RNG_KEY)}
        step_dir = self.dir / f"step-{step:08d}"
        error = None
        try:
            step_dir.mkdir(parents=True, exist_ok=True)
            final = step_dir / f"rank-{self.rank}-of-{self.world_size}.pt"
            tmp = step_dir / f".{final.name}.tmp-{os.getpid()}"
            with tmp.open("wb") as f, _no_record_checksums():
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(step_dir)
        except OSError as e:  # no space, no permission: every rank hears of it (none waits alone)
            error = f"{type(e).__name__}: {e}"
        # Every rank has written (or one failed, which all learn): only then may older tiers go.
        seconds = _agreed_max(time.perf_counter() - start if error is None else math.inf)
        if math.isinf(seconds):
            raise LocalTierError(f"the local tier of step {step} could not be written in {self.dir}"
                                 f"{f' ({error})' if error else ' (on another rank)'}; the previous tier is intact")
        self._prune(below=step)
        return seconds

    def _prune(self, *, below: int | None) -> None:
        """This rank's files of the steps before `below` (all: None) and their torn temporary files;
        emptied step directories. Never a later step's: another rank may be writing it already."""
        mine = (f"rank-{self.rank}-of-", f".rank-{self.rank}-of-")  # complete files, torn temporary ones
        for step_dir in list(self.dir.glob("step-*")):
            if below is not None and int(step_dir.name.split("-")[1]) >= below:
                continue
            try:
                for file in list(step_dir.iterdir()):
                    if file.name.startswith(mine):
                        file.unlink(missing_ok=True)
                step_dir.rmdir()
            except OSError:  # another rank's files are still there, or it removed the directory meanwhile
                pass

    def clear(self) -> None:
        """Remove this rank's files (a finished run); the last rank out removes the directories."""
        self._prune(below=None)
        if self.rank == 0:
            _barrier()
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            _barrier()

    # -- finding and loading ------------------------------------------------------------------

    def _usable_steps(self) -> dict[int, Path]:
        """Steps whose tier this rank can load: its own file on the same number of ranks, or every
        rank's file of the saving run."""
        usable = {}
        for step_dir in self.dir.glob("step-*"):
            found: dict[int, set[int]] = {}
            try:
                names = [file.name for file in step_dir.iterdir()]
            except OSError:  # removed meanwhile
                continue
            for name in names:
                m = _FILE.fullmatch(name)
                if m:
                    found.setdefault(int(m[2]), set()).add(int(m[1]))
            for world, ranks in found.items():
                own = world == self.world_size and self.rank in ranks
                if own or ranks == set(range(world)):
                    usable[int(step_dir.name.split("-")[1])] = step_dir
        return usable

    def newest(self) -> tuple[int, Path] | None:
        """(step, directory) of the newest tier every rank can use; None if there is none (collective)."""
        usable = self._usable_steps() if self.dir.is_dir() else {}
        steps = set(usable)
        if checkpoint._distributed():
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(steps))
            for other in gathered:
                steps &= set(other)
        if not steps:
            return None
        step = max(steps)
        return step, usable[step]

    def load(self, step_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Fill `state`'s model and optimizer tensors in place from the tier in `step_dir`; returns the
        rest as train/checkpoint.py `load` does (step, data, ...; rng None on another number of ranks)."""
        own = step_dir / f"rank-{self.rank}-of-{self.world_size}.pt"
        payloads = [torch.load(own, map_location="cpu", weights_only=False, mmap=True)] if own.is_file() else []
        targets = [(path, leaf) for key in TENSOR_KEYS for path, leaf in _leaves(state.get(key) or {}, (key,))]
        if not payloads or not all(_fill_exact(payloads[0], path, leaf) for path, leaf in targets
                                   if isinstance(leaf, torch.Tensor)):
            payloads = self._all_payloads(step_dir)
            for path, leaf in targets:
                if isinstance(leaf, torch.Tensor):
                    _fill_from_pieces(payloads, path, leaf, step_dir)
        first = payloads[0]
        for path, leaf in targets:
            if not isinstance(leaf, torch.Tensor):
                if path not in first["leaves"]:
                    raise ValueError(f"local checkpoint {step_dir} has no {'.'.join(path)}; it is of another run")
                _set(state, path, first["leaves"][path])
        rest = dict(first["meta"])
        rest["world_size"] = first["world_size"]
        # Per-rank RNG streams have no meaning on another number of ranks (train/checkpoint.py `load`).
        rest["rng"] = next((p["rng"] for p in payloads if p["world_size"] == self.world_size
                            and p["rank"] == self.rank), None)
        return rest

    def _all_payloads(self, step_dir: Path) -> list[dict]:
        files = sorted((int(m[1]), int(m[2]), f) for f in step_dir.iterdir() if (m := _FILE.fullmatch(f.name)))
        if not files:
            raise ValueError(f"local checkpoint {step_dir} holds no rank files")
        world = files[0][1]
        ranks = [r for r, w, _ in files if w == world]
        if ranks != list(range(world)):
            raise ValueError(f"local checkpoint {step_dir} was written by {world} ranks and this rank sees the files "
                             f"of ranks {ranks} only: resume on {world} ranks, or from the persistent checkpoint")
        return [torch.load(f, map_location="cpu", weights_only=False, mmap=True) for _, w, f in files if w == world]


def _fill_exact(payload: dict, path: tuple, target: torch.Tensor) -> bool:
    """Copy the saved piece into `target` if it is exactly the piece `target` holds; else False."""
    piece = payload["pieces"].get(path)
    local, shape, offset = _box(target)
    if piece is None or piece[1] != shape or piece[2] != offset or tuple(piece[0].shape) != tuple(local.shape):
        return False
    with torch.no_grad():
        local.copy_(piece[0])
    return True


def _fill_from_pieces(payloads: list[dict], path: tuple, target: torch.Tensor, step_dir: Path) -> None:
    """Copy every saved piece's overlap with `target`'s own piece (another number of ranks)."""
    local, shape, offset = _box(target)
    found = False
    for payload in payloads:
        piece = payload["pieces"].get(path)
        if piece is None:
            continue
        found = True
        if piece[1] != shape:
            raise ValueError(f"local checkpoint {step_dir} holds {'.'.join(path)} of shape {piece[1]}, the model "
                             f"expects {shape}; use the matching --model.* settings")
        slices = _overlap(offset, tuple(local.shape), piece[2], tuple(piece[0].shape))
        if slices is not None:
            with torch.no_grad():
                local[slices[0]].copy_(piece[0][slices[1]])
    if not found:
        raise ValueError(f"local checkpoint {step_dir} has no {'.'.join(path)}; it is of another run")


def _agreed_max(value: float) -> float:
    if not checkpoint._distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _barrier() -> None:
    if checkpoint._distributed():
        dist.barrier()
