"""Sharded training checkpoints (torch.distributed.checkpoint) that are atomic, resume exactly and reshard.

Layout under ``<run>/checkpoints/``::

    step-00000100/
        .metadata             DCP's index of every tensor shard (written by rank 0)
        __0_0.distcp ...      DCP shard files, one or more per rank ("model" and "optimizer" tensors)
        rng-rank0.pt ...      each rank's RNG state (per-rank, so it cannot go through DCP, which dedups)
        checkpoint.json       global non-tensor state (step, data position, model identity), the world
                              size and the size of every file above; written last: the completion marker
    latest                    text file naming the newest *complete* checkpoint ("step-00000100")

Two commit protocols (``checkpoint.commit``), chosen per checkpoint directory:

- **rename** (local disks, NFS, Lustre): every rank writes into the hidden directory
  ``.step-XXXXXXXX.tmp``. Once all ranks have finished, rank 0 writes ``checkpoint.json``, fsyncs,
  renames the directory to ``step-XXXXXXXX``, moves ``latest`` (itself replaced atomically) and
  prunes old checkpoints. No partial directory is ever visible under a ``step-*`` name.
- **marker** (object-store mounts: gcsfuse, s3fs, mountpoint-s3, where renaming a directory copies
  every object one by one and is not atomic): every rank writes straight into the step's own
  directory, a name never written before (``step-XXXXXXXX``, or ``step-XXXXXXXX-K`` when an earlier
  attempt of the same step left that name: an object store's caches never see one name hold two
  objects), and rank 0 writes ``checkpoint.json`` last, once every rank's files are whole: a
  single object, which an object store creates whole or not at all. A directory is a checkpoint
  exactly when that marker is in it; one without it is an attempt that died, ignored by
  ``latest()`` and removed after the next commit. No directory is ever renamed; a checkpoint is
  removed marker first, so a kill halfway through removing it leaves no "complete" directory
  with missing shards. ``auto`` (the default) takes marker where /proc/self/mounts says the
  directory is on such a mount.

Either way a process killed at any moment leaves ``latest`` on a complete checkpoint, and the
previous checkpoints untouched.

A save that fails (no space, no permission, an I/O error) on any rank fails on every rank, as one
``CheckpointSaveError`` whose line names the checkpoint, the directory, the cause (with the bytes it
needs and the bytes free when space ran out) and the previous checkpoint, which is untouched; the
staging directory is removed so that its space is free for the next attempt.

Loading goes through DCP into the caller's own tensors: their placements (plain tensors, or DTensors
on any mesh) define the target sharding, so a checkpoint saved on N ranks loads on M ranks.
Works with or without an initialized process group.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import re
import shutil
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner

from titan_tpu.errors import RunError

if TYPE_CHECKING:
    from titan_tpu.config import CheckpointConfig

# DCP warns on every single-process save/load that it "assumes" a single process; that is our intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "checkpoint.json"  # global state + completion marker
DCP_METADATA = ".metadata"  # DCP's own index file
LATEST = "latest"
FORMAT_VERSION = 1
COMMIT_MODES = ("auto", "rename", "marker")
# Mounts of an object store, by their type in /proc/self/mounts (mountpoint-s3 mounts as plain "fuse"
# with the source "mountpoint-s3"): there a directory rename is a copy of every object, not atomic.
OBJECT_STORE_FILESYSTEMS = frozenset({"fuse.gcsfuse", "fuse.s3fs", "fuse.goofys", "fuse.blobfuse", "fuse.blobfuse2",
                                      "fuse.rclone", "fuse.geesefs", "fuse.mountpoint-s3"})
OBJECT_STORE_SOURCES = frozenset({"mountpoint-s3", "gcsfuse"})
_STEP_DIR = re.compile(r"step-(\d+)(?:-(\d+))?")

# Keys of the state dict whose tensors go through DCP (sharded, resharded on load). Non-tensor leaves
# inside them (the optimizer's step count) are stored by DCP as pickled bytes and loaded back in place.
TENSOR_KEYS = ("model", "optimizer")
# Per-rank state, saved as one small file per rank.
RNG_KEY = "rng"
# Every other key is global (identical on all ranks) and must be JSON-serialisable.


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_file_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint directory (``step-00000120``, or ``step-00000120-1``: a marker-commit
    save of a step an earlier attempt had started)."""
    match = _STEP_DIR.fullmatch(Path(path).name)
    assert match is not None, path
    return int(match.group(1))


def _order(path: Path) -> tuple[int, int]:
    """Checkpoints of one directory in the order they were written: by step, then attempt."""
    match = _STEP_DIR.fullmatch(path.name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (-1, -1)


# ---------------------------------------------------------------------------------------------
# where a checkpoint directory lives: a filesystem, or an object store mounted as one


def _unescape_mount_field(field: str) -> str:
    """/proc/self/mounts writes a space, tab, newline and backslash in a path as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | Path, *, mounts: str | Path = "/proc/self/mounts") -> tuple[str, str, str] | None:
    """(mount point, filesystem type, source) of the mount holding ``path`` (or its nearest existing
    parent), from ``mounts``; None where that cannot be read (not Linux)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        source, point, fstype = _unescape_mount_field(fields[0]), _unescape_mount_field(fields[1]), fields[2]
        if (path == Path(point) or Path(point) in path.parents) and (best is None or len(point) >= len(best[0])):
            best = (point, fstype, source)
    return best


def commit_mode(directory: str | Path, requested: str = "auto", *, mounts: str | Path = "/proc/self/mounts") -> str:
    """The commit protocol for checkpoints under ``directory`` (module docstring): ``requested``
    unless it is ``auto``, which takes ``marker`` on an object-store mount, else ``rename``."""
    if requested not in COMMIT_MODES:
        raise ValueError(f"checkpoint.commit = {requested!r}: use one of {', '.join(COMMIT_MODES)}")
    if requested != "auto":
        return requested
    mount = mount_of(directory, mounts=mounts)
    on_object_store = mount is not None and (mount[1] in OBJECT_STORE_FILESYSTEMS or
                                             (mount[1] == "fuse" and mount[2] in OBJECT_STORE_SOURCES))
    return "marker" if on_object_store else "rename"


# ---------------------------------------------------------------------------------------------
# RNG


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


# ---------------------------------------------------------------------------------------------
# small helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_durably(tmp, text.encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _json_normalized(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), so comparisons match saved data."""
    return json.loads(json.dumps(value))


def _cause(e: BaseException) -> str:
    """One line naming the underlying error (a DCP CheckpointException wraps every rank's failure)."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        e = inner
    first_line = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first_line}"


def _split_state(state: dict[str, Any]) -> tuple[dict, Any, dict]:
    """(tensor part for DCP, this rank's RNG state or None, global JSON part)."""
    tensors = {k: state[k] for k in TENSOR_KEYS if k in state}
    meta = {k: v for k, v in state.items() if k not in TENSOR_KEYS and k != RNG_KEY}
    try:
        json.dumps(meta)
    except TypeError as e:
        raise ValueError(f"checkpoint state outside {TENSOR_KEYS} must be JSON-serialisable ({e}); put tensors "
                         "under 'model' or 'optimizer'") from None
    return tensors, state.get(RNG_KEY), meta


# ---------------------------------------------------------------------------------------------
# saving


class CheckpointSaveError(RunError):
    """A checkpoint could not be written. Raised on every rank alike; the message is one line."""


def _errno_of(e: BaseException) -> int | None:
    """The OS error number behind ``e``, looking through DCP's per-rank wrapper and exception chains."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _tensor_bytes(tree: dict) -> int:
    """Bytes of every tensor in ``tree``, at their global size (a DTensor counts whole): about what
    a checkpoint of it takes on disk, all ranks together."""
    return sum(v.numel() * v.element_size() for v in _flatten(tree).values() if isinstance(v, torch.Tensor))


def _free_bytes(path: Path) -> int:
    """Free bytes (for this user) on the filesystem of ``path`` or of its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _first_error(local: str | None) -> str | None:
    """The first rank's error message if any rank has one (collective: every rank calls it)."""
    if not _distributed():
        return local
    gathered: list[str | None] = [None] * _world_size()
    dist.all_gather_object(gathered, local)
    return next((m for m in gathered if m is not None), None)


class Checkpointer:
    """Writes step checkpoints under ``checkpoint_dir``; every rank must call ``save``/``wait``/``close``.

    With ``async_save=True`` the tensors are copied to host memory (DCP's staging) and written by a
    background thread, so training continues; the step directory appears (rename + ``latest``) as
    soon as the write finishes. Call ``close()`` before the process exits. A failed write raises
    ``CheckpointSaveError`` (on every rank): from ``save`` when synchronous, from the next
    ``wait``/``save``/``close`` when asynchronous. ``log`` receives warnings (rank 0 prints them).
    """

    def __init__(self, checkpoint_dir: str | Path, *, keep_latest_k: int = 0, async_save: bool = False,
                 log: Callable[[str], None] | None = None, commit: str = "auto"):
        self.dir = Path(checkpoint_dir)
        self.keep_latest_k = keep_latest_k
        self.async_save = async_save
        self.commit = commit_mode(self.dir, commit)  # "rename" or "marker" (module docstring)
        self.log = log or (lambda message: print(message, flush=True) if _rank() == 0 else None)
        self._pending: _PendingSave | None = None
        self._async_group = None
        if async_save and _distributed():
            # DCP's background thread runs its own collectives (plan exchange, completion). On the
            # training group they would interleave with the step's collectives in a different order
            # on each rank; a separate gloo group also works for any device (async save needs CPU).
            # new_group is collective: every rank constructs its Checkpointer at the same point.
            self._async_group = dist.new_group(backend="gloo")

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig, run_dir: str | Path, *,
                    log: Callable[[str], None] | None = None) -> Checkpointer:
        """The [checkpoint] section's checkpointer, writing under checkpoint.folder (default
        <run_dir>/checkpoints; a relative folder is under run_dir)."""
        return cls(Path(run_dir) / (checkpoint.folder or "checkpoints"), keep_latest_k=checkpoint.keep_latest_k,
                   async_save=checkpoint.async_save, log=log, commit=checkpoint.commit)

    # -- public API --------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, planner: SavePlanner | None = None) -> Path:
        """Write ``state`` as the checkpoint of ``step``; returns its (final) directory. ``planner``:
        DCP's save planner, for one that reads the tensors as they are written (a conversion's
        placeholders, train/checkpoint_sources.py); synchronous saves only.

        Synchronous saves return once the directory is complete and ``latest`` names it; async
        saves return once the tensors are staged, and the directory appears later (see ``wait``).
        Raises ``CheckpointSaveError`` when the write fails; the previous checkpoints stay as they were.
        """
        self.wait()  # one save in flight at a time; the previous one must be complete first
        tensors, rng, meta = _split_state(state)
        rank = _rank()
        needed = _tensor_bytes(tensors)
        name = step_dir_name(step)
        if rank == 0:
            self._warn_if_short_of_space(name, needed)
        # Rank 0 makes the directory every rank writes into (the staging directory, or under marker
        # commits the step's own, a fresh name) and names it to the others.
        made: list[Path | None] = [None]
        error = self._attempt(lambda: made.__setitem__(0, self._make_write_dir(name)) if rank == 0 else None,
                              name, needed)
        self._raise_agreed(error, None)  # the directory exists before any rank writes into it
        tmp = Path(_from_rank_0(str(made[0]) if made[0] else None))
        final = tmp if self.commit == "marker" else self.dir / name
        meta = {**meta, "format": FORMAT_VERSION, "world_size": _world_size()}
        # Without a process group DCP must not attempt collectives (it would infer this too, noisily).
        no_dist = not _distributed()
        writer = FileSystemWriter(tmp)  # sync_files=True: every shard is fsynced
        if not self.async_save:
            # DCP gathers every rank's write errors and raises them on all ranks alike.
            error = self._attempt(lambda: dcp.save(tensors, storage_writer=writer, no_dist=no_dist, planner=planner),
                                  final.name, needed)
            if error is None and rng is not None:
                error = self._attempt(lambda: _write_durably(tmp / rng_file_name(rank), _torch_bytes(rng)),
                                      final.name, needed)
            self._raise_agreed(error, tmp)
            if rank == 0:
                error = self._attempt(lambda: self._finalize(tmp, final, meta), final.name, needed)
            self._raise_agreed(error, tmp)  # no rank races ahead (e.g. reads ``latest``) before the rename
            return final
        assert planner is None, "a save planner is for synchronous saves"
        error = None
        if rng is not None:  # small: written now, from the main thread
            error = self._attempt(lambda: _write_durably(tmp / rng_file_name(rank), _torch_bytes(rng)),
                                  final.name, needed)
        self._raise_agreed(error, tmp)
        future = dcp.async_save(tensors, storage_writer=writer, process_group=self._async_group, no_dist=no_dist)
        self._pending = _PendingSave(future, finalize=(lambda: self._finalize(tmp, final, meta)) if rank == 0 else None,
                                     name=final.name, tmp=tmp, needed=needed)
        return final

    def wait(self) -> None:
        """Block until the async save in flight (if any) is written and renamed into place."""
        pending, self._pending = self._pending, None
        if pending is not None:
            error = self._attempt(pending.result, pending.name, pending.needed)
            self._raise_agreed(error, pending.tmp)

    def close(self) -> None:
        """Finish any async save; call before exit (also safe for synchronous checkpointers)."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first (hidden temporary ones are ignored)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.glob("step-*") if _STEP_DIR.fullmatch(p.name) and _is_complete(p)]
        return sorted(found, key=_order)

    def agreed_latest(self) -> Path | None:
        """``latest()`` as rank 0 sees it, on every rank (collective: every rank calls it). Hosts whose
        view of shared storage lags (NFS attribute caches, gcsfuse's stat cache) then still resume
        from the checkpoint rank 0 chose."""
        found = self.latest() if _rank() == 0 else None
        chosen = _from_rank_0(str(found) if found is not None else None)
        return Path(chosen) if chosen is not None else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint: the one ``latest`` names, else the newest on disk.

        A pointer naming a directory that is not complete (deleted, or copied in part) is a warning
        naming both that directory and the one used instead."""
        pointer = self.dir / LATEST
        found = self.complete_checkpoints()
        if pointer.is_file():
            name = pointer.read_text().strip()
            named = self.dir / name
            if _is_complete(named):
                return named
            instead = (f"using the newest complete one, {found[-1].name}" if found
                       else "there is no complete checkpoint, so the run starts from step 0")
            self.log(f"warning: {pointer} names {name}, which is not a complete checkpoint "
                     f"({'missing' if not named.exists() else f'no {STATE_FILE} or {DCP_METADATA}'}); {instead}")
        return found[-1] if found else None

    def load(self, path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
        """Same as the module-level ``load`` (here for symmetry with ``save``)."""
        return load(path, state)

    # -- internals -----------------------------------------------------------------------------

    def _make_write_dir(self, name: str) -> Path:
        """Rank 0: the directory this save's ranks write into. rename: the hidden staging directory
        (debris of a save that died there is removed first). marker: the step's own directory under
        a name no earlier attempt used (``name``, else ``name-K``): debris stays until the next commit."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.commit == "marker":
            taken = [p for p in self.dir.glob(f"{name}*") if _STEP_DIR.fullmatch(p.name)]
            target = self.dir / (f"{name}-{max(_order(p)[1] for p in taken) + 1}" if taken else name)
            target.mkdir()
            return target
        tmp = self.dir / f".{name}.tmp"
        if tmp.exists():  # debris of a save that died
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def _warn_if_short_of_space(self, name: str, needed: int) -> None:
        free = _free_bytes(self.dir)
        if free < needed:
            self.log(f"warning: checkpoint {name} needs about {_mb(needed)} and {self.dir} has {_mb(free)} free; "
                     "the save will likely fail: free some space, lower checkpoint.keep_latest_k or use another "
                     "--output_dir")

    def _attempt(self, fn: Callable[[], Any], name: str, needed: int) -> str | None:
        """Run ``fn``; None if it worked, else the one-line description of its failure."""
        try:
            fn()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            return self._describe_failure(e, name, needed)
        return None

    def _describe_failure(self, e: BaseException, name: str, needed: int) -> str:
        free = _free_bytes(self.dir)
        code = _errno_of(e)
        if code == errno.ENOSPC or (code is None and free < needed):
            why = f"no space left on the device (it needs about {_mb(needed)}, {_mb(free)} are free)"
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            why = f"no permission to write there ({_cause(e)})"
        else:
            why = _cause(e)
        previous = [p for p in self.complete_checkpoints() if p.name != name]
        intact = (f"the previous checkpoint {previous[-1].name} is intact and is the one a restart resumes from"
                  if previous else "no earlier checkpoint exists")
        return f"checkpoint {name} could not be saved in {self.dir}: {why}; {intact}"

    def _raise_agreed(self, local: str | None, tmp: Path | None) -> None:
        """Every rank learns whether any rank failed; then all raise the first failure (rank 0
        removing the directory they wrote into first: the staging directory, or the uncommitted
        step directory of a marker commit), or all go on together."""
        error = _first_error(local)
        if error is None:
            return
        if _rank() == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(error)

    def _finalize(self, tmp: Path, final: Path, meta: dict) -> None:
        """Rank 0, after every rank's files are written: marker, fsync, rename (rename commits),
        pointer, prune."""
        # Record every file's size, so a truncated or missing shard is caught before DCP reads it.
        meta = {**meta, "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}}
        _write_durably(tmp / STATE_FILE, (json.dumps(meta, indent=1) + "\n").encode())  # marker: the commit
        _fsync_dir(tmp)
        if self.commit == "marker":
            _atomic_write_text(self.dir / LATEST, final.name + "\n")  # a file's rename: one object, copied whole
            self._prune(committed=final)
            return
        old = final.with_name(f".{final.name}.old")
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            # Moved aside in one rename, not deleted in place: a kill halfway through deleting it
            # could leave a step directory that still looks complete but has lost shards.
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        _atomic_write_text(self.dir / LATEST, final.name + "\n")
        self._prune()

    def _prune(self, *, committed: Path | None = None) -> None:
        # Hidden directories of saves that died (only one save is ever in flight, and it just finished).
        for stale in [*self.dir.glob(".step-*.tmp"), *self.dir.glob(".step-*.old")]:
            shutil.rmtree(stale, ignore_errors=True)
        if committed is not None:  # marker commits: attempts that died, and older saves of this step
            step = checkpoint_step(committed)
            for stale in self.dir.glob("step-*"):
                if stale != committed and _STEP_DIR.fullmatch(stale.name) and (
                        not _is_complete(stale) or checkpoint_step(stale) == step):
                    _remove_checkpoint(stale)
        if self.keep_latest_k <= 0:
            return
        for old in self.complete_checkpoints()[: -self.keep_latest_k]:
            _remove_checkpoint(old)


class _PendingSave:
    """An async DCP save whose directory rank 0 renames into place as soon as the write finishes.

    The rename runs in DCP's completion callback (file operations only, no collectives), so a
    finished checkpoint becomes visible without waiting for the next ``save``/``close``.
    """

    def __init__(self, future: Future, *, finalize, name: str, tmp: Path, needed: int):
        self.future = future
        self.name, self.tmp, self.needed = name, tmp, needed
        self.done = threading.Event()
        self.error: BaseException | None = None

        def on_done(f: Future) -> None:
            try:
                if f.exception() is None and finalize is not None:
                    finalize()
            except BaseException as e:  # surfaced by result() in the main thread
                self.error = e
            finally:
                self.done.set()

        future.add_done_callback(on_done)

    def result(self) -> None:
        self.future.result()  # raises the write's own error, if any
        self.done.wait()
        if self.error is not None:
            raise self.error


def _remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint directory marker first: a kill halfway through leaves an incomplete
    directory (ignored, removed later), never a "complete" one with missing shards."""
    with contextlib.suppress(OSError):
        (path / STATE_FILE).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _from_rank_0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (collective); ``value`` itself without a process group."""
    if not _distributed():
        return value
    gathered: list[Any] = [None] * _world_size()
    dist.all_gather_object(gathered, value)  # the collective _first_error uses: no device to choose
    return gathered[0]


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# loading


def _is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / DCP_METADATA).is_file()


def _fallback(path: Path) -> str:
    """What to do about the damaged checkpoint ``path``: the next older complete one, and how to use it."""
    older = [p for p in Checkpointer(path.parent, commit="rename").complete_checkpoints() if _order(p) < _order(path)]
    if not older:
        return "there is no older complete checkpoint beside it: move it away to start from step 0"
    return (f"the next older complete checkpoint is {older[-1].name}: move {path.name} out of {path.parent} (or "
            f"delete it) and a restart resumes from {older[-1].name}, or pass that directory where a checkpoint "
            "path is asked for")


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The global state of a checkpoint (step, data, model identity, world size), after checking
    that the directory is a complete, untruncated checkpoint. One-line errors otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}; point at a step-XXXXXXXX directory under "
                                "<run>/checkpoints")
    if not _is_complete(path):
        raise ValueError(f"{path} is not a complete checkpoint (no {STATE_FILE} or {DCP_METADATA}); point at a "
                         "step-XXXXXXXX directory under <run>/checkpoints")
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path} is damaged ({STATE_FILE}: {e}); {_fallback(path)}") from None
    for name, size in meta.get("files", {}).items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes instead of {size}"
            raise ValueError(f"checkpoint {path} is damaged ({name} is {found}); {_fallback(path)}")
    return meta


def check_model_identity(path: Path, meta: dict, *, model_name: Any, model_args: Any) -> None:
    if meta.get("model_name") != model_name or meta.get("model_args") != _json_normalized(model_args):
        raise ValueError(f"checkpoint {path} holds a {meta.get('model_name')} model with other dimensions than "
                         f"{model_name}; use another --output_dir or the matching --model.name/--model.flavor")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}, the names DCP gives the entries it saves."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _check_targets(path: Path, reader: FileSystemReader, targets: dict[str, Any]) -> None:
    """Shape/presence errors as one clear line, before DCP reports them wrapped per rank."""
    saved = reader.read_metadata().state_dict_metadata
    for key, value in _flatten(targets).items():
        if key not in saved:
            raise ValueError(f"checkpoint {path} has no {key!r}; it was saved without it (e.g. a weights-only "
                             "checkpoint): load only the parts it holds")
        md = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and md.size != value.shape:
            raise ValueError(f"checkpoint {path} holds {key} of shape {tuple(md.size)}, the model expects "
                             f"{tuple(value.shape)}; use the matching --model.* settings")


def load(path: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Load checkpoint ``path`` IN PLACE into ``state``; every rank must call it. Returns the rest.

    ``state`` has the shape of what was saved, holding the tensors to fill: ``state["model"]`` and
    ``state["optimizer"]`` (either may be absent; plain tensors or DTensors, whose placements define
    the target sharding, whatever the sharding at save time). Non-tensor leaves in them (the
    optimizer's ``step``) are replaced in the dicts. If ``state`` has ``model_name``/``model_args``,
    they must match the checkpoint's (ValueError otherwise).

    Returns the checkpoint's global state -- ``step``, ``data``, ``model_name``, ``model_args`` and
    any other global key that was saved -- plus ``world_size`` (of the run that saved it) and ``rng``:
    this rank's RNG state if the world size is unchanged, else None (per-rank RNG streams have no
    meaning on another number of ranks; the caller keeps its freshly seeded RNG).
    """
    path = Path(path)
    meta = read_checkpoint_meta(path)
    if "model_name" in state or "model_args" in state:
        check_model_identity(path, meta, model_name=state.get("model_name"), model_args=state.get("model_args"))
    targets = {k: state[k] for k in TENSOR_KEYS if k in state}
    reader = FileSystemReader(path)
    try:
        _check_targets(path, reader, targets)
        dcp.load(targets, storage_reader=reader, no_dist=not _distributed())
    except ValueError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise ValueError(f"checkpoint {path} cannot be read ({_cause(e)}); it is damaged: {_fallback(path)}") from None
    result = {k: v for k, v in meta.items() if k not in ("format", "files")}
    result["rng"] = None
    rng_file = path / rng_file_name(_rank())
    if meta.get("world_size") == _world_size() and rng_file.is_file():
        result["rng"] = torch.load(rng_file, map_location="cpu", weights_only=False)
    return result


def load_full_state_dict(path: str | Path, *, key: str = "model") -> dict[str, Any]:
    """The full (unsharded) plain tensors saved under ``state[key]``, read by this process alone.

    Keys are flat, as saved under ``key`` (for the model: its state-dict names). Non-tensor leaves
    come back too (for the optimizer: ``"step"``; nested groups as ``"exp_avg.<name>"``). For export
    and conversion (e.g. to Hugging Face): needs no process group and works for a checkpoint saved on
    any number of ranks. Holds the whole of ``state[key]`` in host memory.
    """
    path = Path(path)
    read_checkpoint_meta(path)
    reader = FileSystemReader(path)
    prefix = key + "."
    try:
        saved = reader.read_metadata().state_dict_metadata
        # DCP flattens nested dicts by joining keys with "."; a flat target with the same joined
        # names maps onto the same entries. Non-tensor entries get a placeholder that DCP replaces.
        targets = {
            fqn[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
            if isinstance(md, TensorStorageMetadata) else None
            for fqn, md in saved.items() if fqn.startswith(prefix)
        }
        dcp.load({key: targets}, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise ValueError(f"checkpoint {path} cannot be read ({_cause(e)}); it is damaged: {_fallback(path)}") from None
    return targets


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Single-process view of a checkpoint, in the shape it was saved: its global state plus
    ``model`` (and ``optimizer``, if saved) as full plain tensors, ``world_size`` and ``rng``
    (the saving process's RNG state if it was a single process, else None)."""
    path = Path(path)
    meta = read_checkpoint_meta(path)
    result = {k: v for k, v in meta.items() if k not in ("format", "files")}
    result["model"] = load_full_state_dict(path)
    flat_optimizer = load_full_state_dict(path, key="optimizer")
    if flat_optimizer:
        # Our optimizer state is one level deep: {"step": int, "exp_avg": {name: tensor}, ...}.
        optimizer: dict[str, Any] = {}
        for name, value in flat_optimizer.items():
            group, _, tensor_name = name.partition(".")
            if tensor_name:
                optimizer.setdefault(group, {})[tensor_name] = value
            else:
                optimizer[group] = value
        result["optimizer"] = optimizer
    rng_file = path / rng_file_name(0)
    single = meta.get("world_size") == 1 and rng_file.is_file()
    result["rng"] = torch.load(rng_file, map_location="cpu", weights_only=False) if single else None
    return result
