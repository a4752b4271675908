"""kill -9 of a training run and the checks that make a kill test able to fail: the kill landed on a
running process before the run's last step, and the restart resumed from the checkpoint the killed
process left and took again the steps the kill lost (goodput's ledger, train/goodput.py). Without
them, a run that finished before the kill, or a restart that trained from step 1, would pass a
comparison of losses too. What the kill -9 tests of test_train_dist.py, test_pipeline_train.py,
test_lora_dist.py and tpu/test_jax_path.py share."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from titan_tpu.train.goodput import read_processes, totals


def kill_9(proc: subprocess.Popen, *, group: bool = False) -> None:
    """SIGKILL `proc` (with `group`, its whole process group: a launcher and its ranks, started with
    start_new_session=True) and reap it, asserting it was still running when the signal landed."""
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill"
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    # A process that exited on its own between the poll and the signal reports its own status, not -9.
    assert proc.returncode == -signal.SIGKILL, f"the run exited with {proc.returncode}, not by the kill"


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
