"""A run of the debug model on 2 ranks, hit by seeded random faults, against the same run untouched.

    python bench/chaos.py [--seed 0] [--steps 300] [--faults 10] [--work DIR]

The faults, at random steps (each kind at least once, the rest drawn at random):

    kill9_one   SIGKILL of one rank (torchrun then stops the other)
    kill9_all   SIGKILL of every process of the job
    sigterm     SIGTERM to every rank with a short grace budget (checkpoint.grace_seconds), then
                SIGKILL of whatever still runs once the budget is over, as a preempted VM
    resize      SIGKILL of every process, and the next start on 1 rank (the one after on 2 again)

After every fault the supervisor checks that a complete tier exists (the persistent checkpoint or the
local tier) and starts the same command again, which resumes from the newest one. The global batch
is training.global_batch_tokens, so the 1-rank start accumulates 2 micro-batches where 2 ranks take
one each. At the end it compares every logged loss with the uninterrupted 2-rank run: bitwise up to
the first restart on another number of ranks, and the final loss within 1e-5 (after a resize the
gradient sums run in another order; the largest difference of any step is printed too). It counts
the steps each fault cost (recomputed) and prints the run's goodput. Exit
status 1 when a resume did not start from the newest complete tier or a loss is off.

It starts about faults + 2 jobs of torch processes; on a 2-core machine 300 steps and 10 faults
take several minutes.
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

from titan_tpu.train.checkpoint import Checkpointer  # noqa: E402
from titan_tpu.train.goodput import describe, read_processes, totals  # noqa: E402
from titan_tpu.train.local_tier import LocalTier  # noqa: E402

KINDS = ("kill9_one", "kill9_all", "sigterm", "resize")
GRACE_SECONDS = 3.0


def train_args(run_dir: Path, cache: Path, steps: int) -> list[str]:
    values = {
        "config": REPO / "configs" / "llama3_debug.toml", "output_dir": run_dir, "data.cache_dir": cache,
        "data.max_bytes": 400_000, "training.device": "cpu", "training.deterministic": "true",
        "training.batch_size": 2, "training.seq_len": 32, "training.global_batch_tokens": 128,
        "training.steps": steps, "lr_scheduler.warmup_steps": 10, "metrics.log_freq": 1,
        "metrics.console": "false", "metrics.tensorboard": "false", "validation.enabled": "false",
        "checkpoint.interval": 20, "checkpoint.keep_latest_k": 2, "checkpoint.local_interval": 5,
        "checkpoint.grace_seconds": GRACE_SECONDS, "checkpoint.local_dir": run_dir / "local",
    }
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def start(ranks: int, args: list[str], log) -> subprocess.Popen:
    head = [sys.executable, "-m", "titan_tpu", "train"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
         "titan_tpu", "train"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.Popen(head + args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def ranks_of(proc: subprocess.Popen, ranks: int) -> list[int]:
    """The training processes: the job itself on 1 rank, torchrun's workers on 2."""
    if ranks == 1:
        return [proc.pid]
    return children(proc.pid)


def progress(run_dir: Path, process: int) -> int:
    """The step the run's `process`-th start has reached (its goodput record; metrics.jsonl does not
    show the steps a resumed process takes again)."""
    records = read_processes(run_dir)
    return records[process]["step_last"] if len(records) > process else -1


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            rows.append((row["step"], row["loss"]))
    return rows


def newest_tier(run_dir: Path) -> int:
    """The newest complete tier's step (persistent or local); -1 if there is none."""
    latest = Checkpointer(run_dir / "checkpoints", log=lambda message: None).latest()
    persistent = int(latest.name.split("-")[1]) if latest else -1
    run_id = (run_dir / "run_id").read_text().strip() if (run_dir / "run_id").is_file() else ""
    tier_dir = run_dir / "local" / run_id
    local = LocalTier(tier_dir, log=print).newest() if run_id and tier_dir.is_dir() else None
    return max(persistent, local[0] if local else -1)


def inject(kind: str, proc: subprocess.Popen, ranks: int, rng: random.Random) -> list[int]:
    """Apply the fault; returns the job's training processes (torchrun starts each in its own session)."""
    pids = ranks_of(proc, ranks)
    if kind == "kill9_one":
        os.kill(rng.choice(pids), signal.SIGKILL)
        try:
            proc.wait(timeout=60)  # torchrun stops the other rank
        except subprocess.TimeoutExpired:
            pass
    elif kind == "sigterm":
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # the budget is over: the VM goes away
    return pids


def fail(message: str, log: str) -> None:
    tail = Path(log).read_text()[-3000:]
    raise SystemExit(f"{tail}\n{message}")


def gone(proc: subprocess.Popen, pids: list[int]) -> None:
    """Every process of the job ends (what still runs is killed), as when a VM goes away."""
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in pids):  # reaped by init once dead
        if time.time() > deadline:
            raise SystemExit(f"processes {pids} outlived SIGKILL for a minute")
        time.sleep(0.05)


def cost_per_kind(kinds: list[str], report: list[str], records: list[dict]) -> str:
    """Steps lost (reached - resumed) and the seconds from the fault to the next start's first step
    (the job down, then its start-up and load: goodput's restart and checkpoint_load), per fault kind."""
    lost: dict[str, list[int]] = {}
    down: dict[str, list[float]] = {}
    for i, (kind, line) in enumerate(zip(kinds, report)):
        reached, tier = int(line.split("@")[1].split()[0]), int(line.rsplit("-> ", 1)[1])
        after = records[i + 1]
        lost.setdefault(kind, []).append(reached - max(tier, 0))
        down.setdefault(kind, []).append(after["seconds"]["restart"] + after["seconds"]["checkpoint_load"]
                                         + max(0.0, after["start"] - records[i]["last"]))
    return "; ".join(f"{kind} x{len(lost[kind])}: {sum(lost[kind]) / len(lost[kind]):.1f} steps lost, "
                     f"{sum(down[kind]) / len(down[kind]):.1f} s to the next step" for kind in sorted(lost))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--work", help="working directory (default: a temporary one, removed)")
    parser.add_argument("--reference", help="run directory of an uninterrupted run of the same --steps to reuse")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    try:
        reference_dir = Path(args.reference) if args.reference else work / "reference"
        if not (reference_dir / "metrics.jsonl").is_file():
            with open(work / "reference.log", "w") as log:
                began = time.time()
                assert start(2, train_args(reference_dir, cache, args.steps), log).wait() == 0, "reference failed"
                print(f"reference: {args.steps} steps on 2 ranks in {time.time() - began:.0f} s", flush=True)
        reference = dict(losses(reference_dir))

        kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(args.faults - len(KINDS))]
        rng.shuffle(kinds)
        at = sorted(rng.sample(range(5, args.steps - 5), args.faults))
        run_dir = work / f"chaos-{args.seed}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd, ranks, report, resized_at, tiers = train_args(run_dir, cache, args.steps), 2, [], None, []
        began = time.time()
        with open(work / f"chaos-{args.seed}.log", "w") as log:
            for process, (kind, step) in enumerate(zip(kinds, at)):
                proc = start(ranks, cmd, log)
                while progress(run_dir, process) < step and proc.poll() is None:
                    time.sleep(0.02)
                if proc.poll() is not None:
                    fail(f"the run ended before the fault at step {step} (exit {proc.returncode})", log.name)
                gone(proc, inject(kind, proc, ranks, rng))
                reached, tier = progress(run_dir, process), newest_tier(run_dir)
                tiers.append(max(tier, 0))
                report.append(f"{kind}@{reached} on {ranks} -> {tier}")
                if kind == "resize":
                    ranks, resized_at = 1, resized_at or tier
                elif ranks == 1:
                    ranks = 2
            proc = start(ranks, cmd, log)
            if proc.wait() != 0:
                fail(f"the last start failed (exit {proc.returncode})", log.name)
        seconds = time.time() - began
        got = losses(run_dir)
        assert sorted({s for s, _ in got}) == list(range(1, args.steps + 1)), "steps missing"
        same = [(s, loss) for s, loss in got if resized_at is None or s <= resized_at]
        bitwise = all(loss == reference[s] for s, loss in same)
        worst = max(abs(loss - reference[s]) for s, loss in got)
        final = dict(got)[args.steps] - reference[args.steps]
        records = read_processes(run_dir)
        t = totals(records)
        starts = [r["step_start"] for r in records[1:]]
        if starts != tiers:  # each start resumed from the newest complete tier the fault left
            raise SystemExit(f"resumed at steps {starts}, the newest complete tiers were {tiers}")
        print(f"seed {args.seed}: {len(report)} faults ({', '.join(report)})", flush=True)
        print(f"seed {args.seed}: per fault kind: {cost_per_kind(kinds, report, records)}", flush=True)
        print(f"seed {args.seed}: {args.steps} steps in {seconds:.0f} s; every resume from a complete tier: yes; "
              f"losses bitwise up to the first resize (step {resized_at}): {'yes' if bitwise else 'NO'}; "
              f"largest loss difference {worst:.2e}, final {final:+.2e}; {describe(t)}", flush=True)
        return 0 if bitwise and abs(final) <= 1e-5 else 1
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
