"""Experiment trackers through a real crash: a run with W&B (offline, no API key) is killed with
SIGKILL after a checkpoint, restarted, and its W&B history read back from the offline files."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import require_multiprocess_marker
from wandb_history import history

# Starts training processes one at a time and kills them, no ranks: scheduled with its file (tests/xdist_groups.py).
pytestmark = pytest.mark.multiprocess(ranks=False)

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


def command(run: Path, cache: Path) -> list[str]:
    require_multiprocess_marker()
    values = {"output_dir": run, "data.cache_dir": cache, "data.max_bytes": 1_500_000, "training.device": "cpu",
              "training.batch_size": 2, "training.seq_len": 64, "training.steps": 40, "metrics.log_freq": 1,
              "metrics.trackers": "tensorboard,wandb", "validation.enabled": "false", "checkpoint.interval": 5}
    return [sys.executable, "-m", "titan_tpu", "train", "--config", CONFIG,
            *[item for key, value in values.items() for item in (f"--{key}", str(value))]]


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no key: offline
    return dict(clean, OMP_NUM_THREADS="1")


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def wandb_flushed(run: Path) -> bool:
    """Whether the W&B service has written a history row to the offline file yet (its first flush
    can hold only the run's header records, so the file's size says nothing)."""
    return any(history(f)[1] for f in (run / "wandb").glob("offline-run-*/run-*.wandb"))


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def test_wandb_offline_run_resumes_the_same_run_after_kill_9(tmp_path, data_cache):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    proc = subprocess.Popen(command(run, data_cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env())
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 600  # generous: stress rounds share 2 cores with other sessions
    try:
        # Kill once a checkpoint exists, at least two steps past it are logged (they will be replayed)
        # and the W&B service has flushed some history to its file (every 2 s).
        while not (latest.exists() and max(logged_steps(run), default=0)
                   >= int(latest.read_text().strip().split("-")[1]) + 2 and wandb_flushed(run)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "timed out"
            time.sleep(0.2)
    finally:
        service = children(proc.pid)  # the W&B service the trainer started
        proc.send_signal(signal.SIGKILL)  # the trainer only, as the kernel's OOM killer would
        proc.wait()
        # The service sees its parent gone, writes what it was sent and exits on its own.
        deadline = time.time() + 60
        while any(Path(f"/proc/{pid}").exists() for pid in service) and time.time() < deadline:
            time.sleep(0.1)
        left = [pid for pid in service if Path(f"/proc/{pid}").exists()]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, "the W&B service outlived its killed trainer by a minute"
    checkpoint_step = int(latest.read_text().strip().split("-")[1])
    before = max(logged_steps(run))  # logged by the killed process
    assert before >= checkpoint_step + 2
    done = subprocess.run(command(run, data_cache), capture_output=True, text=True, timeout=600, env=env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"resumed from {latest.parent / f'step-{checkpoint_step:08d}'}" in done.stdout

    assert logged_steps(run) == list(range(1, 41))  # each step once, in order, across the crash
    offline = sorted((run / "wandb").glob("offline-run-*"))  # named by start time
    assert len(offline) == 2, offline
    ids, steps = [], []
    for directory in offline:
        run_id, rows = history(next(directory.glob("run-*.wandb")))
        ids.append(run_id)
        steps.append([row["_step"] for row in rows if "loss" in row])
    assert ids[0] and ids[0] == ids[1], ids  # one W&B run continued, not two
    saved = json.loads((run / "checkpoints" / "step-00000040" / "checkpoint.json").read_text())
    assert saved["trackers"] == {"wandb_run_id": ids[0]}
    # The killed process: a prefix of its steps (the service writes what reached it; the last rows
    # may not have).
    assert steps[0] and steps[0] == list(range(1, len(steps[0]) + 1)) and steps[0][-1] <= before, steps[0]
    # The resumed process: exactly the steps nobody had logged, so the history never repeats or goes back.
    assert steps[1] == list(range(before + 1, 41)), (before, steps[1])
