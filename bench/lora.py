"""LoRA against full fine-tuning on the same model, in one run: peak memory and tokens/s, measured
and planned, and their ratios.

Each round trains both as real trainer processes, in alternating order (full then LoRA, then LoRA
then full: a neighbour slowing the machine, or a warm page cache, hits both alike), twice per mode:

* memory: the trainer's own `max_memory_gb` (the process's peak resident memory since the loop
  began, the quantity `titan-tpu plan` predicts on a CPU) with glibc's mmap threshold fixed at 64 KiB
  (MALLOC_MMAP_THRESHOLD_): every tensor above it is mapped on allocation and returned on free, so
  the peak is the bytes in use and not, as with glibc's default, whatever freed heap glibc keeps.
  That kept heap differs from run to run and more between the modes (LoRA's step frees its
  activations into a heap with nothing long-lived to fill the holes: docs/log.md); it made LoRA's
  default peak read above full fine-tuning's (0.70 against 0.63 GB on llama3 debug) while its bytes
  in use are below (0.53 against 0.59). The default peak is printed too ("RSS default");
* speed: tokens/s, the best step after the first, with glibc's default (the mapped allocations
  above cost page faults, more for the mode that allocates more).

Peaks are the lowest over rounds, speeds the highest.

    python bench/lora.py                                   # llama3 debug, 3 rounds
    python bench/lora.py --flavor debug --name qwen3 --rounds 2 --steps 8
    python bench/lora.py -- --model.name hf --model.hf_config qwen2 --model.hf_overrides \
        hidden_size=1024,intermediate_size=4096,num_hidden_layers=4,num_attention_heads=16,num_key_value_heads=4,vocab_size=2048
                                                          # wider layers: more of the step in the weights' matmuls

Arguments after `--` are the trainer's, for both modes (a Transformers-backend model above).
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
    return [item for key, value in values.items() for item in (f"--{key}", str(value))] + a.trainer


# glibc's mmap threshold, fixed: each tensor above it is mapped and returned on free (module docstring)
EXACT_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def train(a: argparse.Namespace, run_dir: Path, lora: bool, env: dict[str, str] | None = None) -> dict:
    config = str(ROOT / "configs" / "llama3_debug.toml")
    cmd = [sys.executable, "-m", "titan_tpu", "train", "--config", config, *overrides(a, run_dir, lora)]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
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


def measure(a: argparse.Namespace, tmp: Path) -> dict[str, dict]:
    """Per mode: the lowest peak with the exact heap, the lowest with glibc's default, the best tokens/s."""
    best: dict[str, dict] = {}
    for round_ in range(a.rounds):
        for mode in ("full", "lora") if round_ % 2 == 0 else ("lora", "full"):
            lora = mode == "lora"
            speed = train(a, tmp / f"{mode}-{round_}-speed", lora)
            memory = train(a, tmp / f"{mode}-{round_}-memory", lora, env=EXACT_HEAP)
            got = {"peak_gb": memory["peak_gb"], "default_peak_gb": speed["peak_gb"],
                   "tokens_per_s": speed["tokens_per_s"]}
            old = best.setdefault(mode, got)
            best[mode] = {key: (max if key == "tokens_per_s" else min)(old[key], got[key]) for key in got}
    return best


def main() -> None:
    a, trainer = build_parser().parse_known_args()
    a.trainer = [arg for arg in trainer if arg != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        best = measure(a, Path(tmp))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    model = " ".join(a.trainer) if a.trainer else f"{a.name}/{a.flavor}"
    print(f"{model}, fp32, batch {a.batch_size} x seq {a.seq_len}, LoRA rank {a.rank}; best of "
          f"{a.rounds} rounds; {cpu}, {os.cpu_count()} CPUs")
    print(f"{'mode':>5} {'peak GB':>8} {'planned GB':>11} {'plan error':>11} {'RSS default':>12} {'tokens/s':>9} "
          f"{'planned tok/s':>14}")
    planned = {}
    for mode, got in best.items():
        cfg = build_config(str(ROOT / "configs" / "llama3_debug.toml"), overrides(a, Path("unused"), mode == "lora"))
        plan = plan_config(cfg)
        planned[mode] = {"peak_gb": plan.peak_bytes / 1e9, "tokens_per_s": plan.tokens_per_s}
        error = (planned[mode]["peak_gb"] - got["peak_gb"]) / got["peak_gb"]
        print(f"{mode:>5} {got['peak_gb']:8.3f} {planned[mode]['peak_gb']:11.3f} {error:+10.1%} "
              f"{got['default_peak_gb']:12.3f} {got['tokens_per_s']:9.0f} {planned[mode]['tokens_per_s']:14.0f}")

    def ratio(where: dict, key: str) -> float:
        return where["lora"][key] / where["full"][key]

    print(f"lora / full: peak memory {ratio(best, 'peak_gb'):.2f}x measured, {ratio(planned, 'peak_gb'):.2f}x "
          f"planned ({ratio(best, 'default_peak_gb'):.2f}x with glibc's default heap); tokens/s "
          f"{ratio(best, 'tokens_per_s'):.2f}x measured, {ratio(planned, 'tokens_per_s'):.2f}x planned")


if __name__ == "__main__":
    main()
