"""Graph-mode gradient accumulation against graph mode with the same global batch in one micro-batch.

Two contenders, both `--training.mode graph` with the Inductor backend on the llama3 debug flavor
(fp32, one CPU process): "accum", `--accum` micro-batches of `--batch / --accum` rows per step,
and "single", one micro-batch of `--batch` rows. Same tokens per step.

* Speed: both steps built in one process and run interleaved (each round one step of each, the
  order alternating), tokens/s per contender from the median step time, and the median of the
  per-round ratios accum / single.
* Peak memory: each contender trains a few steps with the trainer in a fresh process; its
  metrics' `max_memory_gb` (the process's peak resident memory since the training loop began)
  against the planner's peak for the same config (`titan-tpu plan`, CPU constants, no measuring),
  target within 15%.

    python bench/graph_accum.py                       # batch 8 x seq 256, 4 micro-batches of 2 rows
    python bench/graph_accum.py --batch 8 --accum 2 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "llama3_debug.toml"


def cpu_name() -> str:
    """The CPU's model name, and whether it has bf16 instructions (the numbers depend on both)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                "unknown CPU")
    return name + (", avx512_bf16" if "avx512_bf16" in info else "")


def contender_overrides(name: str, args) -> list[str]:
    micro = args.accum if name == "accum" else 1
    return ["--training.mode", "graph", "--compile.backend", "inductor", "--training.device", "cpu",
            "--training.batch_size", str(args.batch // micro), "--training.grad_accum_steps", str(micro),
            "--training.seq_len", str(args.seq)]


def speed(args) -> dict:
    """tokens/s of each contender and the median per-round ratio accum / single, interleaved."""
    from titan_tpu.graph import GraphStep
    from titan_tpu.models.registry import build_model, get_model_args
    from titan_tpu.train.optim import AdamW

    torch.set_num_threads(args.threads)
    model_args = get_model_args("llama3", "debug")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    steps, batches = {}, {}
    for name in ("accum", "single"):
        micro = args.accum if name == "accum" else 1
        rows = args.batch // micro
        batches[name] = [(inputs[i * rows:(i + 1) * rows], labels[i * rows:(i + 1) * rows]) for i in range(micro)]
        model = build_model(model_args, seed=0)
        optimizer = AdamW(dict(model.named_parameters()))
        steps[name] = GraphStep(model, optimizer, max_norm=1.0, example_batch=batches[name][0], backend="inductor",
                                grad_accum_steps=micro)
        steps[name](batches[name], 1e-4)  # first step: lazily created state
    times = {"accum": [], "single": []}
    for r in range(args.rounds):
        order = ("accum", "single") if r % 2 == 0 else ("single", "accum")
        for name in order:
            start = time.perf_counter()
            steps[name](batches[name], 1e-4)
            times[name].append(time.perf_counter() - start)
    ratios = [s / a for a, s in zip(times["accum"], times["single"])]  # tokens/s accum / single
    tokens_per_step = args.batch * args.seq
    return {"tokens_per_s": {n: tokens_per_step / statistics.median(t) for n, t in times.items()},
            "ratio": statistics.median(ratios),
            "compile_s": {n: s.capture_seconds + s.compile_seconds for n, s in steps.items()}}


def memory(name: str, args) -> dict:
    """The trainer's measured peak and the planner's, for one contender."""
    from titan_tpu.config import build_config
    from titan_tpu.plan.hardware import cpu_hardware
    from titan_tpu.plan.planner import plan_config

    overrides = contender_overrides(name, args)
    with tempfile.TemporaryDirectory() as out:
        run = ["--training.steps", str(args.steps), "--metrics.log_freq", "1", "--validation.enabled", "false",
               "--checkpoint.enabled", "false", "--metrics.tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
               "--output_dir", out]
        proc = subprocess.run([sys.executable, "-m", "titan_tpu", "train", "--config", str(CONFIG), *overrides, *run],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if "max_memory_gb" in r][-1]["max_memory_gb"]
    plan = plan_config(build_config(CONFIG, overrides), cpu_hardware(measure=False))
    return {"measured_gb": measured, "planned_gb": plan.peak_bytes / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="rows per step (per process)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step of the accum contender")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4, help="trainer steps of each memory run")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.batch % args.accum:
        sys.exit(f"--batch {args.batch} must be a multiple of --accum {args.accum}")

    print(f"llama3/debug, fp32, Inductor, {args.batch} x {args.seq} tokens per step; accum: {args.accum} micro-batches "
          f"of {args.batch // args.accum} rows; single: 1 of {args.batch}; CPU: {cpu_name()}, {args.threads} threads")
    s = speed(args)
    for name in ("accum", "single"):
        print(f"  {name:6s} {s['tokens_per_s'][name]:8.0f} tokens/s (capture + compile {s['compile_s'][name]:.1f} s)")
    print(f"tokens/s accum / single: {s['ratio']:.3f}x (median of {args.rounds} interleaved rounds)")
    for name in ("accum", "single"):
        m = memory(name, args)
        error = (m["planned_gb"] - m["measured_gb"]) / m["measured_gb"]
        print(f"  {name:6s} peak memory measured {m['measured_gb']:.3f} GB, planned {m['planned_gb']:.3f} GB "
              f"({error:+.1%})")


if __name__ == "__main__":
    main()
