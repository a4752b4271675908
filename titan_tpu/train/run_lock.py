"""One writer per output directory: a lock that rank 0 holds for the life of a run.

Two runs writing into one output_dir (the same command started twice, or a second host on a shared
filesystem) would interleave checkpoints and append every metrics row twice. So rank 0 takes an
exclusive ``fcntl.flock`` on ``<output_dir>/.lock`` before anything is written, and writes its host,
pid and start time into the file; a second run finds the lock taken and stops at once, naming the
holder. The kernel drops the lock when the holding process ends, however it ends (kill -9
included), so a dead run never blocks the next one; the file's content, left behind, only lets the
next run note whom it took over from.

A lock that is still held although the holder's pid is gone on this host (a child that inherited
the descriptor through fork outlived it) is stale: the file is replaced by a fresh one, which the
new run locks, with a note. A holder on another host cannot be checked from here and is always
respected. Several ``RunLock`` objects of one process on one directory share one lock (tests and
tools build several trainers in one process; that is not a second launch).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from titan_tpu.errors import RunError

LOCK_FILE = ".lock"


class OutputDirLocked(RunError):
    """Another live run holds the output directory."""


# realpath of the lock file -> [open file descriptor, number of RunLock objects of this process using it]
_held: dict[str, list[int]] = {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {when})"


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").strip()
    try:
        holder = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """``acquire()`` the output directory's lock (raising ``OutputDirLocked`` if a live run holds
    it), ``release()`` it at the end; also a context manager."""

    def __init__(self, run_dir: str | Path, *, log: Callable[[str], None] = print):
        self.path = Path(run_dir) / LOCK_FILE
        self.log = log
        self._key: str | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in _held:
            _held[key][1] += 1
        else:
            _held[key] = [self._lock_file(), 1]
        self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        entry = _held[self._key]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self._key]
            os.ftruncate(entry[0], 0)  # a clean end leaves no holder to report
            os.close(entry[0])  # closing drops the flock
        self._key = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _lock_file(self) -> int:
        for attempt in range(2):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if attempt == 0 and self._stale(holder):
                    self.log(f"note: {self.path} was held by {_describe(holder)}, which is no longer running on this "
                             "host (a forked child kept the lock): taking it over")
                    self.path.unlink(missing_ok=True)  # the stale holder keeps the old file; we lock a new one
                    continue
                raise OutputDirLocked(
                    f"output_dir {self.path.parent} is in use by another run: {_describe(holder)} holds {self.path}; "
                    "wait for it to finish (or stop it), or pass another --output_dir") from None
            previous = _read_holder(fd)
            if previous.get("pid") is not None:
                self.log(f"note: {self.path} was left by {_describe(previous)}, which ended without releasing it "
                         "(killed?); taking it over")
            me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
            return fd
        raise AssertionError("unreachable")

    @staticmethod
    def _stale(holder: dict) -> bool:
        pid = holder.get("pid")
        return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid)
