"""A process saving checkpoints in a loop, killed with SIGKILL somewhere inside a save, and the check
that a checkpoint it left holds one save whole: what the kill -9 tests of both commit protocols
(rename: test_checkpoint.py, marker: test_checkpoint_marker.py) share."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from titan_tpu.train.checkpoint import load_checkpoint

SAVE_LOOP = textwrap.dedent("""
    import sys, torch
    from titan_tpu.train.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep_latest_k=2, commit=sys.argv[2])
    step = 0
    while True:
        step += 1
        # ~48 MB, every value equal to the step, so a mix of two saves would show.
        model = {f"w{i}": torch.full((3_000_000,), float(step)) for i in range(4)}
        ckpt.save(step, {"step": step, "model": model, "model_name": "m", "model_args": {}})
        print(step, flush=True)
""")


def kill_during_saves(directory: Path, *, commit: str) -> None:
    """Save into `directory` in a loop under `commit`; once the first save is complete, kill -9
    the process at a random moment (somewhere inside a later save)."""
    proc = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(directory), commit], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        assert proc.stdout.readline().strip() == "1", "the first save did not complete"
        time.sleep(random.uniform(0.0, 1.5))  # somewhere inside a later save (each takes ~0.3-1 s)
    finally:
        proc.kill()
        proc.wait()


def assert_one_whole_save(path: Path) -> int:
    """The checkpoint at `path` loads and holds one save of the loop whole; returns its step."""
    state = load_checkpoint(path)
    step = state["step"]
    assert path.name == f"step-{step:08d}" and step >= 1
    for w in state["model"].values():
        assert w.shape == (3_000_000,) and bool((w == step).all())
    return step
