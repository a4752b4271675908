"""The JAX path's persistent compile cache (graph/compile_cache.py): a restart, a fresh process on
the same compile.cache_dir, loads XLA's executable instead of compiling it, and says so in its log.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess(ranks=False)  # starts training processes, one at a time

ROOT = Path(__file__).resolve().parents[2]


def train(run_dir: Path, data: Path, cache: Path) -> str:
    args = {"output_dir": run_dir, "data.cache_dir": data, "data.max_bytes": 200_000, "training.device": "cpu",
            "training.mode": "graph", "compile.backend": "jax", "compile.cache_dir": cache, "training.steps": 1,
            "training.batch_size": 2, "training.seq_len": 64, "lr_scheduler.warmup_steps": 1,
            "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.enabled": "false"}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "titan_tpu", "train", "--config", "configs/llama3_debug.toml",
                           *[item for key, value in args.items() for item in (f"--{key}", str(value))]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_a_restart_loads_the_step_from_the_jax_cache(tmp_path):
    cache = tmp_path / "compile"
    first = train(tmp_path / "first", tmp_path / "data", cache)
    assert f"compile cache: {cache / 'jax'} (compile.cache_dir; 0 files there)" in first
    assert f"compile.backend jax: cache: 0 hits, 1 miss in {cache / 'jax'}" in first
    assert any((cache / "jax").iterdir())
    second = train(tmp_path / "second", tmp_path / "data", cache)
    assert f"compile.backend jax: cache: 1 hit, 0 misses in {cache / 'jax'}" in second
    # The same program, and XLA's part of its compile time is the load's.
    fingerprint = re.compile(r"^jax: program step fingerprint (\w+).*compiled in ([\d.]+) s", re.M)
    (print_1, xla_1), (print_2, xla_2) = fingerprint.search(first).groups(), fingerprint.search(second).groups()
    assert print_1 == print_2 and float(xla_2) < float(xla_1)
