"""LoRA against full fine-tuning on the same model, in one run: peak memory, tokens/s, and the
planner's predicted peak beside the measured one.

Each round trains both (alternating, so a neighbour slowing the machine hits both alike) as real
trainer processes; memory is the trainer's own `max_memory_gb` (the process's peak resident
memory since the loop began, the quantity `titan-tpu plan` predicts on a CPU), the best over
rounds; tokens/s is the best step after the first. Prints one row per mode and the ratios.

    python bench/lora.py                                   # llama3 debug, 3 rounds
    python bench/lora.py --flavor debug --name qwen3 --rounds 2 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_tpu.config import build_config
from titan_tpu.plan.planner import plan_config

ROOT = Path(__file__).resolve().parent.parent


def overrides(a: argparse.Namespace, run_dir: Path, lora: bool) -> list[str]:
    values = {"model.name": a.name, "model.flavor": a.flavor, "output_dir": str(run_dir), "training.device": "cpu",
              "training.steps": a.steps, "training.batch_size": a.batch_size, "training.seq_len": a.seq_len,
              "model.dtype": "float32", "data.max_bytes": 1_500_000, "validation.enabled": "false",
              "checkpoint.enabled": "false", "metrics.log_freq": 1, "metrics.tensorboard": "false",
              "lora.enabled": str(lora).lower(), "lora.rank": a.rank}
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def train(a: argparse.Namespace, run_dir: Path, lora: bool) -> dict:
    config = str(ROOT / "configs" / "llama3_debug.toml")
    cmd = [sys.executable, "-m", "titan_tpu", "train", "--config", config, *overrides(a, run_dir, lora)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return {"peak_gb": steps[-1]["max_memory_gb"], "tokens_per_s": max(r["tokens_per_s"] for r in steps[1:])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="llama3")
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    return parser


def main() -> None:
    a = build_parser().parse_args()

    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(a.rounds):
            for mode in ("full", "lora"):
                got = train(a, Path(tmp) / f"{mode}-{round_}", lora=mode == "lora")
                old = best.setdefault(mode, got)
                best[mode] = {"peak_gb": min(old["peak_gb"], got["peak_gb"]),
                              "tokens_per_s": max(old["tokens_per_s"], got["tokens_per_s"])}
    print(f"{a.name}/{a.flavor}, fp32, batch {a.batch_size} x seq {a.seq_len}, LoRA rank {a.rank}; best of "
          f"{a.rounds} rounds")
    print(f"{'mode':>5} {'peak GB':>8} {'planned GB':>11} {'plan error':>11} {'tokens/s':>9} {'planned tok/s':>14}")
    planned_speed = {}
    for mode, got in best.items():
        cfg = build_config(str(ROOT / "configs" / "llama3_debug.toml"), overrides(a, Path("unused"), mode == "lora"))
        plan = plan_config(cfg)
        planned, planned_speed[mode] = plan.peak_bytes / 1e9, plan.tokens_per_s
        error = (planned - got["peak_gb"]) / got["peak_gb"]
        print(f"{mode:>5} {got['peak_gb']:8.3f} {planned:11.3f} {error:+10.1%} {got['tokens_per_s']:9.0f} "
              f"{planned_speed[mode]:14.0f}")
    measured = best["lora"]["tokens_per_s"] / best["full"]["tokens_per_s"]
    print(f"lora / full: peak memory {best['lora']['peak_gb'] / best['full']['peak_gb']:.2f}x, tokens/s "
          f"{measured:.2f}x measured, {planned_speed['lora'] / planned_speed['full']:.2f}x planned")


if __name__ == "__main__":
    main()
