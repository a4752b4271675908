"""The pipeline's bubble measured: step time of pp 2 on 2 CPU ranks at 2, 4 and 8 micro-batches
against the time the schedule's bubble term predicts from one process doing the same work.

    python bench/pipeline_bubble.py [--micro-batches 2 4 8] [--steps 8] [--seq-len 128]

For each micro-batch count M (micro-batches of one row each):

- one process (one thread) trains the scanned llama3 debug model on M accumulated micro-batches:
  its step time T1 is the whole step's work;
- two ranks (one thread each) train it with parallelism.pp 2 and M micro-batches: step time Tpp;
- the schedule's prediction: the work split evenly over the 2 stages, stretched by the bubble,
  T1 / pp x (M + pp - 1) / M (parallel/pipeline.py PipelineSchedule.bubble).

Printed per M: the bubble fraction, T1, Tpp, the prediction and Tpp / prediction (1.0: the bubble
term accounts for the time; above 1: what it leaves out, e.g. the permutes, the loss's share-out
over the stages and the first stage's embedding). Step times are the median of the
steps after the first two (a process's first steps are slow). The same machine, one run: only
the ratios mean anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

CONFIG = str(REPO / "configs" / "llama3_debug.toml")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def step_seconds(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step_s"] for r in rows if "step_s" in r and r["step"] > 2]
    return statistics.median(seconds)


def overrides(run_dir: Path, cache: Path, *, steps: int, seq_len: int, **extra) -> list[str]:
    values = {"output_dir": run_dir, "data.cache_dir": cache, "data.max_bytes": 1_500_000, "training.device": "cpu",
              "training.seq_len": seq_len, "training.steps": steps, "lr_scheduler.warmup_steps": 0,
              "metrics.log_freq": 1, "metrics.tensorboard": "false", "validation.enabled": "false",
              "checkpoint.enabled": "false", "model.scan_layers": "true", **extra}
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def main() -> None:
    import torch
    from dist_utils import _train_rank

    from titan_tpu.config import build_config
    from titan_tpu.loops import assemble
    from titan_tpu.parallel.pipeline import PipelineSchedule
    from titan_tpu.parallel.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    pp = 2
    root = Path(tempfile.mkdtemp(prefix="pipeline_bubble_"))
    cache = root / "cache"
    torch.set_num_threads(1)
    print(f"CPU: {cpu_name()}, one thread per process; llama3 debug (6 layers, scanned), seq_len {args.seq_len}, "
          f"micro-batches of one row, pp {pp}")
    print(f"{'M':>3} {'bubble':>7} {'T1 s':>8} {'Tpp s':>8} {'predicted s':>12} {'Tpp / predicted':>16}")
    try:
        for M in args.micro_batches:
            one = root / f"one_{M}"
            with contextlib.redirect_stdout(io.StringIO()):  # its metrics rows; the table is what we print
                assemble(build_config(CONFIG, overrides(one, cache, steps=args.steps, seq_len=args.seq_len,
                                                        **{"training.batch_size": 1,
                                                           "training.grad_accum_steps": M}))).train()
            staged = root / f"pp_{M}"
            run_ranks(_train_rank, world_size=pp, timeout_s=1800, args=(CONFIG, overrides(
                staged, cache, steps=args.steps, seq_len=args.seq_len,
                **{"training.batch_size": M, "parallelism.pp": pp, "parallelism.dp_shard": 1,
                   "parallelism.pp_microbatches": M})))
            bubble = PipelineSchedule(stages=pp, micro_batches=M).bubble
            t1, tpp = step_seconds(one), step_seconds(staged)
            predicted = t1 / pp / (1 - bubble)
            print(f"{M:>3} {bubble:>7.3f} {t1:>8.3f} {tpp:>8.3f} {predicted:>12.3f} {tpp / predicted:>16.2f}",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
