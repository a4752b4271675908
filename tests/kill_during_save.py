"""Kill -9 a training run at random moments inside its checkpoint saves, restart it each time, and
check that nothing is lost (issue 30).

    python tests/kill_during_save.py [--kills 20] [--seed 0] [--work DIR]

One uninterrupted run of the debug model (a few tiny steps, a checkpoint after every step) gives the
reference losses and the time a save takes. Then two chains of the same run, one with synchronous
and one with asynchronous saves, are each killed (SIGKILL) kills/2 times: the supervisor waits for a
save to start (its staging directory ``.step-N.tmp`` appears), sleeps a random fraction of a save's
duration and kills the process; after each kill it checks that the newest complete checkpoint loads
and that ``latest`` leads to it, then starts the same command again, which resumes. Each chain ends
with a run to the last step. Every loss any attempt logged, replayed steps included, must equal the
reference bitwise. Prints one summary line and exits non-zero on any difference.

It starts kills + 3 training processes of a few seconds each; run it under /work/notes/cpu run.
Not collected by pytest (no test_ prefix): it is a stress script, run many times in a row before a
change to the checkpoint code is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from titan_tpu.train.checkpoint import Checkpointer, load_checkpoint  # noqa: E402

STEPS = 8


def train_command(run_dir: Path, cache: Path, *, async_save: bool) -> list[str]:
    return [sys.executable, "-m", "titan_tpu.cli", "train", "--config", str(REPO / "configs" / "llama3_debug.toml"),
            "--output_dir", str(run_dir), "--data.cache_dir", str(cache), "--data.max_bytes", "400000",
            "--training.device", "cpu", "--training.deterministic", "true", "--training.batch_size", "2",
            "--training.seq_len", "64", "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_freq", "1", "--metrics.tensorboard", "false", "--metrics.console", "false",
            "--validation.enabled", "false", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
            "--checkpoint.async_save", str(async_save).lower()]


def staging_dirs(run_dir: Path) -> list[Path]:
    checkpoints = run_dir / "checkpoints"
    return list(checkpoints.glob(".step-*.tmp")) if checkpoints.is_dir() else []


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every (step, loss) row of metrics.jsonl, in the order written (replays of a step included)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row cut by the kill (one small write: not seen so far)
            print(f"note: unreadable metrics row {line[:80]!r}", flush=True)
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def run_watching_saves(cmd: list[str], run_dir: Path) -> list[float]:
    """Run to the end; return how long each save's staging directory existed (polled every ms)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    durations, seen = [], {}
    while proc.poll() is None:
        now = time.perf_counter()
        current = {p.name for p in staging_dirs(run_dir)}
        for name in current - set(seen):
            seen[name] = now
        for name in [n for n in seen if n not in current]:
            durations.append(now - seen.pop(name))
        time.sleep(0.001)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed: {proc.stderr.read()[-2000:]}")
    return durations


def kill_inside_a_save(cmd: list[str], run_dir: Path, delay: float) -> str:
    """Start the run, kill -9 it `delay` seconds after a save starts; say where the kill landed."""
    before = {p.name for p in staging_dirs(run_dir)}  # debris of an earlier kill is not a new save
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not {p.name for p in staging_dirs(run_dir)} - before:
        time.sleep(0.0005)
    if proc.poll() is not None:
        return "finished"  # the run ended before another save started
    time.sleep(delay)
    inside = bool(staging_dirs(run_dir))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return "inside" if inside else "after"


def check_newest_complete_loads(run_dir: Path) -> int:
    ckpt = Checkpointer(run_dir / "checkpoints", log=lambda message: None)
    complete = ckpt.complete_checkpoints()
    if not complete:
        return 0
    latest = ckpt.latest()
    assert latest == complete[-1] or (run_dir / "checkpoints" / "latest").read_text().strip() == latest.name, \
        (latest, complete)
    state = load_checkpoint(complete[-1])  # raises on a damaged checkpoint
    assert state["step"] == int(complete[-1].name.split("-")[1]) and state["model"], complete[-1]
    return state["step"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--work", help="working directory (default: a temporary one, removed)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill_during_save_"))
    cache = work / "cache"
    try:
        reference_dir = work / "reference"
        durations = run_watching_saves(train_command(reference_dir, cache, async_save=False), reference_dir)
        reference = dict(losses(reference_dir))
        assert sorted(reference) == list(range(1, STEPS + 1)), reference
        window = max(durations) if durations else 0.5
        counts = {"inside": 0, "after": 0, "finished": 0}
        mismatches = []
        for mode in ("sync", "async"):
            run_dir = work / mode
            cmd = train_command(run_dir, cache, async_save=mode == "async")
            for _ in range(args.kills // 2 if mode == "sync" else args.kills - args.kills // 2):
                counts[kill_inside_a_save(cmd, run_dir, rng.uniform(0.0, window))] += 1
                check_newest_complete_loads(run_dir)
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the {mode} chain did not finish: {done.stderr[-2000:]}")
            assert check_newest_complete_loads(run_dir) == STEPS
            got = losses(run_dir)
            mismatches += [(mode, step, loss, reference[step]) for step, loss in got if loss != reference[step]]
            assert {step for step, _ in got} == set(reference), (mode, got)
        verdict = "yes" if not mismatches else "NO " + str(mismatches[:3])
        print(f"seed {seed}: {args.kills} kills ({counts['inside']} inside a save's staging phase, {counts['after']} "
              f"just after it, {counts['finished']} runs ended first), save window {window * 1000:.0f} ms; "
              f"losses bitwise equal to the uninterrupted run: {verdict}",
              flush=True)
        return 1 if mismatches else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
