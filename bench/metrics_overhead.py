"""What metrics, trackers and the data timer cost per step, as a share of the step, in one run.

A real run of the trainer (llama3 debug on the embedded corpus, eager, profiler off) logging every
step (metrics.log_freq 1, the worst case) to metrics.jsonl, the console, TensorBoard and W&B
(offline). Timed inside that run:

- the per-row work: ``MetricsLogger.log`` (JSONL write + flush, console line, every tracker) and
  the memory statistics the row reads (``Backend.memory_stats``);
- the data timer: two ``perf_counter`` calls and the ``record_function`` region around the
  batches, timed over many empty iterations in the same process;

against the mean step time of the run's rows. One-off costs (opening W&B, its final sync) are
not per step and are left out; they are printed.

    python bench/metrics_overhead.py [--steps 40] [-- trainer overrides...]

Run it alone on the machine (a timing): /work/notes/cpu measure python bench/metrics_overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torch.profiler import record_function

import titan_tpu.loops.base as loop_mod
from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train import metrics as metrics_mod
from titan_tpu.train.profiling import DATA_REGION

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


def data_timer_seconds(iterations: int = 20000) -> float:
    """Seconds per step that the trainer's data timer adds (without the batches themselves)."""
    start = time.perf_counter()
    for _ in range(iterations):
        t0 = time.perf_counter()
        with record_function(DATA_REGION):
            pass
        _ = time.perf_counter() - t0
    return (time.perf_counter() - start) / iterations


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args, overrides = parser.parse_known_args(argv)
    os.environ.pop("WANDB_API_KEY", None)  # offline
    spent = {"log": [], "memory": []}

    class TimedLogger(metrics_mod.MetricsLogger):
        def log(self, step, metrics):
            t0 = time.perf_counter()
            super().log(step, metrics)
            spent["log"].append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as out:
        cfg = build_config(CONFIG, ["--output_dir", out, "--training.steps", str(args.steps), "--metrics.log_freq", "1",
                                    "--metrics.trackers", "tensorboard,wandb", "--validation.enabled", "false",
                                    "--checkpoint.enabled", "false", "--lr_scheduler.warmup_steps", "1", *overrides])
        loop_mod.MetricsLogger = TimedLogger
        trainer = assemble(cfg)
        memory_stats = trainer.components.backend.memory_stats

        def timed_memory_stats():
            t0 = time.perf_counter()
            stats = memory_stats()
            spent["memory"].append(time.perf_counter() - t0)
            return stats

        trainer.components.backend.memory_stats = timed_memory_stats
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        rows = [r for r in _rows(Path(out) / "metrics.jsonl") if "step_s" in r]
    step_s = statistics.mean(r["step_s"] for r in rows[1:])  # the first row holds warm-up
    per_row = statistics.mean(spent["log"][1:]) + statistics.mean(spent["memory"][1:])
    timer = data_timer_seconds()
    ratio = (per_row + timer) / step_s
    in_steps = step_s * len(rows)
    print(f"{len(rows)} steps of {cfg.model.name}/{cfg.model.flavor}, batch {cfg.training.batch_size} x seq "
          f"{cfg.training.seq_len}, trackers tensorboard + wandb (offline), a row every step")
    print(f"  mean step time (rows 2..):               {step_s * 1e3:10.2f} ms")
    print(f"  per row: MetricsLogger.log + memory_stats {per_row * 1e3:10.3f} ms")
    print(f"  data timer per step:                     {timer * 1e6:10.2f} us")
    print(f"  overhead / step time: {ratio:.3%} at log_freq 1; {(per_row / 10 + timer) / step_s:.3%} at the default "
          f"log_freq 10")
    print(f"  one-off (W&B open and final sync, process start): {wall - in_steps:.1f} s of {wall:.1f} s wall")
    return 0


def _rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
