"""What the persistent compile cache saves at a restart: the debug model's graph-mode training run
twice in fresh processes on one cache directory, first empty (cold: everything compiled), then as
the first run left it (warm: a restart).

Each round makes a new empty cache directory and runs `titan-tpu train` (1 step, no checkpoints)
twice on it; it prints the compile time each run logged ("compiled with ... in S s"), the cache's
hits and misses from the same line, the whole process's wall time, and the ratios cold / warm.

    python bench/compile_cache.py                                   # Inductor on this CPU, 1 round
    python bench/compile_cache.py --rounds 3
    .venv-tpu/bin/python bench/compile_cache.py --backend jax       # XLA:CPU through JAX (needs jax)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPILED = re.compile(r"compiled with (\w+) in ([\d.]+) s|through JAX \(\w+\) in ([\d.]+) s")
CACHE = re.compile(r"cache: (\d+) hits?, (\d+) miss(?:es)?")
XLA = re.compile(r"lowered in ([\d.]+) s, compiled in ([\d.]+) s")  # the JAX path's program line


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def train_once(args, cache_dir: Path, work: Path, name: str, mode: str = "graph") -> dict | None:
    cmd = [sys.executable, "-m", "titan_tpu.cli", "train", "--config", str(REPO / "configs" / "llama3_debug.toml"),
           "--output_dir", str(work / name), "--data.cache_dir", str(work / "data"), "--data.max_bytes", "200000",
           "--training.device", "cpu", "--training.mode", mode, "--compile.backend", args.backend,
           "--compile.cache_dir", str(cache_dir), "--training.steps", "1", "--training.batch_size", "2",
           "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1", "--metrics.tensorboard", "false",
           "--validation.enabled", "false", "--checkpoint.enabled", "false"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.backend == "jax":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    if mode != "graph":
        return None
    compiled = COMPILED.search(done.stdout)
    cache = CACHE.search(done.stdout)
    if compiled is None or cache is None:
        raise SystemExit(f"{name}: no compile or cache line in its log:\n{done.stdout[-3000:]}")
    seconds = float(compiled.group(2) or compiled.group(3))
    row = {"compile_s": seconds, "wall_s": wall, "hits": int(cache.group(1)), "misses": int(cache.group(2))}
    xla = XLA.search(done.stdout)
    if xla is not None:  # our lowering to StableHLO (not cached), then XLA's compile (cached)
        row["lower_s"], row["xla_s"] = float(xla.group(1)), float(xla.group(2))
    return row


def describe(row: dict) -> str:
    parts = f" = lowering {row['lower_s']:.1f} + XLA {row['xla_s']:.1f}" if "xla_s" in row else ""
    return (f"compile {row['compile_s']:.1f} s{parts} (wall {row['wall_s']:.1f} s, cache {row['hits']} hits / "
            f"{row['misses']} misses)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("inductor", "jax"), default="inductor")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile_cache_bench_") as tmp:
        work = Path(tmp)
        train_once(args, work / "unused", work, "warmup", mode="eager")  # tokenizes the corpus, warms the page cache
        for r in range(args.rounds):
            cache_dir = work / f"cache{r}"
            cold = train_once(args, cache_dir, work, f"cold{r}")
            warm = train_once(args, cache_dir, work, f"warm{r}")
            rows.append((cold, warm))
            print(f"round {r + 1}: cold {describe(cold)}; warm {describe(warm)}", flush=True)
    compile_ratio = statistics.median(c["compile_s"] / w["compile_s"] for c, w in rows)
    wall_ratio = statistics.median(c["wall_s"] / w["wall_s"] for c, w in rows)
    cold_s = statistics.median(c["compile_s"] for c, _ in rows)
    warm_s = statistics.median(w["compile_s"] for _, w in rows)
    print(f"{args.backend} on {cpu_name()} ({os.cpu_count()} cores), debug model, {args.rounds} round(s): compile "
          f"{cold_s:.1f} s cold -> {warm_s:.1f} s warm ({compile_ratio:.1f}x); whole restart (process wall) "
          f"{wall_ratio:.1f}x faster", flush=True)
    if all("xla_s" in c and "xla_s" in w for c, w in rows):
        xla_ratio = statistics.median(c["xla_s"] / w["xla_s"] for c, w in rows)
        print(f"XLA's compile alone: {statistics.median(c['xla_s'] for c, _ in rows):.1f} s cold -> "
              f"{statistics.median(w['xla_s'] for _, w in rows):.1f} s warm ({xla_ratio:.1f}x); the lowering to "
              "StableHLO before it is not cached", flush=True)
    warm_hits = all(w["hits"] > 0 and w["misses"] == 0 for _, w in rows)
    return 0 if warm_hits else 1


if __name__ == "__main__":
    sys.exit(main())
