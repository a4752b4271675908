"""GRPO learns: the mean reward of the debug recipe (configs/llama3_debug_grpo.toml) over a run,
from random weights, printed as a curve: the mean over each window of steps, and the first and
last windows' ratio.

The task (docs/grpo.md): each prompt names a digit among two words ("gold 7 teal:"); a completion
scores, per character, 0.25 for any digit and 0.75 more for the prompt's digit
(configs/data/grpo_digits.py). It runs the real trainer (`titan-tpu train`) as a subprocess, on
one process or, with --ranks 2, on two SimpleFSDP ranks under torchrun (each samples its own
prompts of the global batch).

    python bench/grpo_learning.py                       # 300 steps, one process
    python bench/grpo_learning.py --steps 100 --window 10
    python bench/grpo_learning.py --ranks 2             # two fully_shard ranks
    python bench/grpo_learning.py --set grpo.beta=0.04  # any config key
    python bench/grpo_learning.py --steps 12 --kill-at 7  # kill -9 after step 7, restart: same numbers?

With --kill-at K the run is made twice: straight through, and killed with SIGKILL once step K's
checkpoint is written (checkpoint.interval 1), then restarted with the same command; it prints
whether every step's loss, reward, KL and gradient norm are identical between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(a: argparse.Namespace, run_dir: Path, *, checkpoints: bool = False) -> tuple[list[str], dict]:
    values = {"output_dir": str(run_dir), "training.device": "cpu", "training.steps": a.steps,
              "training.seed": a.seed, "checkpoint.enabled": str(checkpoints).lower(), "checkpoint.interval": 1,
              "checkpoint.keep_latest_k": 2, "metrics.log_freq": 1, "metrics.tensorboard": "false"}
    if a.ranks > 1:
        # The recipe's 8 prompts per step split over the ranks: the same global batch.
        values.update({"parallelism.dp_shard": a.ranks, "training.batch_size": 8 // a.ranks})
    for item in a.set:
        key, _, value = item.partition("=")
        values[key] = value
    args = ["--config", str(ROOT / "configs" / "llama3_debug_grpo.toml"),
            *[x for key, value in values.items() for x in (f"--{key}", str(value))]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if a.ranks > 1:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.ranks),
               "-m", "titan_tpu", "train", *args]
    else:
        cmd = [sys.executable, "-m", "titan_tpu", "train", *args]
    return cmd, env


def rows_of(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def run(a: argparse.Namespace, run_dir: Path) -> list[dict]:
    cmd, env = command(a, run_dir)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL if a.quiet else None)
    return rows_of(run_dir)


def kill_and_resume(a: argparse.Namespace, tmp: Path) -> None:
    """The run straight through, and killed with SIGKILL after step --kill-at's checkpoint then
    restarted: are the logged numbers identical?"""
    cmd, env = command(a, tmp / "straight", checkpoints=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    cmd, env = command(a, tmp / "killed", checkpoints=True)
    latest = tmp / "killed" / "checkpoints" / "latest"
    child = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
    target = f"step-{a.kill_at:08d}"
    while not (latest.is_file() and latest.read_text().strip() >= target):
        if child.poll() is not None:
            raise SystemExit(f"the run ended before step {a.kill_at}'s checkpoint")
        time.sleep(0.05)
    os.killpg(child.pid, 9)  # the trainer and anything it started, at once
    child.wait()
    killed_at = max(r["step"] for r in rows_of(tmp / "killed"))
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    keys = ("loss", "reward", "reward_std", "kl", "grad_norm", "completions/mean_length")
    straight, resumed = rows_of(tmp / "straight"), rows_of(tmp / "killed")
    same = [r["step"] for r in straight] == [r["step"] for r in resumed] and all(
        {k: x.get(k) for k in keys} == {k: y.get(k) for k in keys} for x, y in zip(straight, resumed))
    print(f"kill -9 after step {a.kill_at}'s checkpoint (last step logged before the kill: {killed_at}), restarted "
          f"to step {a.steps}: {len(resumed)} rows, identical to the uninterrupted run in {', '.join(keys)}: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=20, help="steps per printed point")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE: a config override (repeatable)")
    p.add_argument("--quiet", action="store_true", help="hide the trainer's own lines")
    p.add_argument("--kill-at", type=int, default=0, help="kill -9 after this step's checkpoint and resume")
    a = p.parse_args()
    if a.kill_at:
        with tempfile.TemporaryDirectory() as tmp:
            kill_and_resume(a, Path(tmp))
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(a, Path(tmp) / "run")
    wall = time.perf_counter() - start
    print(f"\nGRPO on the debug recipe: {a.steps} steps, {a.ranks} rank(s), seed {a.seed}, {wall / 60:.1f} min wall "
          f"({os.cpu_count()} CPUs)")
    print(f"{'steps':>11}  {'reward':>7}  {'std in group':>12}  {'right digit':>11}  {'length':>6}  "
          f"{'sampling s':>10}  {'training s':>10}")
    means = []
    for lo in range(0, len(rows), a.window):
        window = rows[lo:lo + a.window]

        def mean(key, window=window):
            values = [r[key] for r in window if key in r]
            return sum(values) / len(values) if values else float("nan")

        means.append(mean("reward"))
        right = mean("rewards/right_digit/mean")
        print(f"{window[0]['step']:>5}-{window[-1]['step']:<5}  {means[-1]:7.3f}  {mean('reward_std'):12.3f}  "
              f"{right:11.3f}  {mean('completions/mean_length'):6.2f}  {mean('sampling_s'):10.2f}  "
              f"{mean('training_s'):10.2f}")
    print(f"mean reward: first window {means[0]:.3f}, last window {means[-1]:.3f} "
          f"({means[-1] / max(means[0], 1e-9):.1f}x)")


if __name__ == "__main__":
    main()
