"""kill -9 of a training run and the checks that make a kill test able to fail: the kill landed on a
running process before the run's last step, and the restart resumed from the checkpoint the killed
process left and took again the steps the kill lost (goodput's ledger, train/goodput.py). Without
them, a run that finished before the kill, or a restart that trained from step 1, would pass a
comparison of losses too. What the kill -9 tests of test_train_dist.py, test_pipeline_train.py,
test_lora_dist.py and tpu/test_jax_path.py share."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from titan_tpu.train.goodput import read_processes, totals


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc), children before theirs."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            pass
    return [d for c in children for d in (c, *_descendants(c))]


def kill_9(proc: subprocess.Popen, *, tree: bool = False) -> None:
    """SIGKILL `proc` (with `tree`, every process below it too: torchrun starts each rank in a session of
    its own, so killing the launcher's process group leaves the ranks running on) and reap it,
    asserting it was still running when the signal landed."""
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill"
    below = _descendants(proc.pid) if tree else []
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    # A process that exited on its own between the poll and the signal reports its own status, not -9.
    assert proc.returncode == -signal.SIGKILL, f"the run exited with {proc.returncode}, not by the kill"
    # SIGKILL is delivered asynchronously: each rank is gone (or a zombie until init reaps it) soon after.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in below):
        assert time.monotonic() < deadline, [pid for pid in below if _alive(pid)]
        time.sleep(0.05)


def _rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step rows so far; a torn last line (the run is writing it) is left out."""
    rows = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "loss" in row:
            rows.append(row)
    return rows


def kill_9_at_step(proc: subprocess.Popen, run_dir: Path, first: int, last: int, *, timeout: float,
                   tree: bool = False) -> int:
    """kill_9 (`tree` as there) the run `proc` trains into `run_dir` at an arbitrary moment, mid-step or
    mid-save alike: once a checkpoint is written and a random step from `first` to `last` is logged,
    within one step's time of that (the last row's step_s). Pick `first` past the first checkpoint's
    step and `last` at least two steps before the run's end. A fixed sleep after an early step instead
    lets a run of tiny steps end before the kill (tests/stress.py caught it), which then tests
    nothing. Returns the step picked."""
    target = random.randint(first, last)
    deadline = time.monotonic() + timeout
    while True:
        rows = _rows(run_dir)
        if (run_dir / "checkpoints" / "latest").exists() and rows and rows[-1]["step"] >= target:
            break
        if proc.poll() is not None:
            stderr = proc.communicate()[1] if proc.stderr else ""
            raise AssertionError(f"the run ended (exit {proc.returncode}) before step {target}: {stderr[-3000:]}")
        assert time.monotonic() < deadline, f"the run logged no step {target} in {timeout} s"
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, rows[-1]["step_s"]))
    kill_9(proc, tree=tree)
    return target


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def assert_resumed_once(run_dir: Path, restart_stdout: str, *, steps: int) -> int:
    """After one kill and one restart that ran to `steps`: the killed process had passed a checkpoint
    and stopped short of `steps`; the restart resumed from a checkpoint at or below the step the
    killed process reached and recomputed the steps between. Returns the step it resumed at."""
    processes = read_processes(run_dir)
    assert len(processes) == 2, processes  # the killed process and the restart
    killed, restarted = processes
    reached = killed["step_last"]  # its last ledger record (rank 0 writes one with each metrics row)
    assert reached < steps, f"the killed process had reached step {reached} of {steps}: the kill came after its end"
    resumed = re.findall(r"resumed from \S*step-(\d+) at step (\d+)", restart_stdout)
    assert len(resumed) == 1, restart_stdout[-3000:]
    resumed_at = int(resumed[0][1])
    assert 0 < resumed_at <= reached and restarted["step_start"] == resumed_at, (resumed_at, reached, restarted)
    assert restarted["step_last"] == steps, restarted
    total = totals(processes)
    assert total["restarts"] == 1 and total["recomputed_steps"] == reached - resumed_at, (reached, resumed_at, total)
    assert f"(1 restart, {reached - resumed_at} steps recomputed)" in restart_stdout, restart_stdout[-3000:]
    return resumed_at
