"""Goodput: the share of a run's wall time spent on productive training steps, across restarts.

Where the rest of the time went is counted in named buckets (seconds), per process start, and kept
in ``<output_dir>/goodput.json`` so that a restarted run adds to it instead of starting over::

    productive        training steps that advanced the run (their data waits excluded)
    recomputed        steps taken again after a failure: every step at or below the highest step any
                      earlier process of the run reached (the work since its last checkpoint was lost),
                      and a replica group's step thrown away because a peer died during it
    data              waiting for batches
    compile           graph capture and compilation
    checkpoint_save   checkpoint saves (the step's and the emergency save's; an async save's staging)
    checkpoint_load   loading the checkpoint a process resumed from
    validation        validation passes
    startup           the first process, from its start to its first step (imports, building the run)
    restart           a later process's start-up, plus the time between the previous process's last
                      record and this start (the job down, and any work done after that record); a
                      replica group's waits for a new quorum and its recovery from a peer
    other             what none of the above covers (logging, metrics): wall time minus their sum

Wall time is from the first process's start to the latest record of the latest process. Rank 0
keeps the ledger; it is written (temporary file + rename, so a kill leaves the previous version)
whenever a metrics row is, and at the end of a process.

    processes: [{"start": unix time, "last": unix time, "step_start": 5, "step_last": 12,
                 "seconds": {bucket: seconds}, "recomputed_steps": 3}, ...]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FILE = "goodput.json"
BUCKETS = ("productive", "recomputed", "data", "compile", "checkpoint_save", "checkpoint_load", "validation",
           "startup", "restart", "other")
_IMPORTED_AT = time.time()
_launched_at: list[float] = []  # set by the command line: the training process's own start


def process_start_time() -> float:
    """When this process started (unix time): from /proc on Linux, else when this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


def mark_launch() -> None:
    """`titan-tpu train`: this process exists to train, so its start-up counts from the process's start."""
    _launched_at[:] = [process_start_time()]


def start_time(created: float) -> float:
    """A run's start in this process: the process's start under the command line, else `created` (a
    trainer built inside a longer-lived process: a test, a notebook)."""
    return min(_launched_at[0], created) if _launched_at else created


def read_processes(run_dir: str | Path) -> list[dict]:
    """The ledger's process records of a run directory ([] when there is none or it is unreadable)."""
    path = Path(run_dir) / FILE
    try:
        return list(json.loads(path.read_text())["processes"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def totals(processes: list[dict]) -> dict:
    """Seconds per bucket over every process, wall time, goodput (percent) and recomputed steps."""
    seconds = dict.fromkeys(BUCKETS, 0.0)
    for i, p in enumerate(processes):
        for bucket, value in p.get("seconds", {}).items():
            seconds[bucket] = seconds.get(bucket, 0.0) + value
        if i > 0:  # the time the run was down: from the previous process's last record to this start
            seconds["restart"] += max(0.0, p["start"] - processes[i - 1]["last"])
    wall = processes[-1]["last"] - processes[0]["start"] if processes else 0.0
    seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
    return {"seconds": seconds, "wall": wall, "goodput": 100.0 * seconds["productive"] / wall if wall > 0 else 0.0,
            "recomputed_steps": sum(p.get("recomputed_steps", 0) for p in processes),
            "restarts": max(len(processes) - 1, 0)}


def describe(t: dict) -> str:
    """One line: "goodput 81.3% of 2m10s wall (1 restart, 3 steps recomputed): productive 1m46s, ..."."""
    from titan_tpu.train.metrics import format_duration

    parts = [f"{bucket.replace('_', ' ')} {_seconds(t['seconds'][bucket])}" for bucket in BUCKETS
             if t["seconds"][bucket] >= 0.05]
    restarts = f"{t['restarts']} restart{'s' if t['restarts'] != 1 else ''}"
    return (f"goodput {t['goodput']:.1f}% of {format_duration(t['wall'])} wall ({restarts}, "
            f"{t['recomputed_steps']} steps recomputed): {', '.join(parts)}")


def _seconds(value: float) -> str:
    return f"{value:.1f}s" if value < 60 else f"{value / 60:.1f}min"


class GoodputLedger:
    """Rank 0's ledger of one process, added to the run's earlier processes (module docstring)."""

    def __init__(self, run_dir: str | Path, *, step: int, start: float, clock=time.time):
        self.path = Path(run_dir) / FILE
        self._clock = clock
        self.earlier = read_processes(run_dir)
        # Steps up to here were reached before a failure; taking them again is recomputation.
        self.reached = max((p.get("step_last", 0) for p in self.earlier), default=0)
        now = clock()
        self.record = {"start": min(start, now), "last": now,
                       "step_start": step, "step_last": step, "seconds": dict.fromkeys(BUCKETS[:-1], 0.0),
                       "recomputed_steps": 0}

    def add(self, bucket: str, seconds: float) -> None:
        assert bucket in self.record["seconds"], bucket
        self.record["seconds"][bucket] += max(0.0, seconds)

    def begin_loop(self) -> None:
        """The loop starts: what this process spent since it started, less what was already counted
        (checkpoint load, compile), was start-up (the first process) or restart (a later one)."""
        spent = self._clock() - self.record["start"] - sum(self.record["seconds"].values())
        self.add("restart" if self.earlier else "startup", spent)

    def lost_step(self, seconds: float) -> None:
        """A step computed and thrown away (replica fault tolerance: a peer died during it); it is taken again."""
        self.add("recomputed", seconds)
        self.record["recomputed_steps"] += 1

    def step(self, step: int, *, seconds: float, data_seconds: float) -> None:
        """A training step of `seconds`, of which `data_seconds` waited for batches."""
        self.add("data", data_seconds)
        if step <= self.reached:
            self.add("recomputed", seconds - data_seconds)
            self.record["recomputed_steps"] += 1
        else:
            self.add("productive", seconds - data_seconds)
        self.record["step_last"] = max(self.record["step_last"], step)

    def totals(self) -> dict:
        self.record["last"] = self._clock()
        return totals([*self.earlier, self.record])

    def flush(self) -> None:
        """Write the ledger (every process's record) atomically."""
        self.record["last"] = self._clock()
        tmp = self.path.with_name(f".{FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"version": 1, "processes": [*self.earlier, self.record]}) + "\n")
        os.replace(tmp, self.path)
