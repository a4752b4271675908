"""fp8 against bf16 tokens/s on a GPU, in one run: the same model, batch and steps, trained twice
as real trainer processes (graph mode), alternating rounds so a slow neighbour hits both alike.

    python bench/fp8.py                                   # CUDA: Llama 3 1B shape, 2 rounds
    python bench/fp8.py --flavor 8B --batch-size 1 --seq-len 8192
    python bench/fp8.py --device cpu --flavor debug --steps 4   # a smoke run of the script here

Prints tokens/s of each (the median step after the first two), the ratio, and each one's MFU
against the GPU's stated dense peak in its own precision (bf16 and fp8 from plan/hardware.py).
Without CUDA and without --device cpu it says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(a: argparse.Namespace, run_dir: Path, fp8: bool) -> float:
    cmd = [sys.executable, "-m", "titan_tpu", "train", "--config", str(ROOT / "configs" / "llama3_debug.toml"),
           "--output_dir", str(run_dir), "--model.flavor", a.flavor, "--model.dtype", "bfloat16",
           "--training.device", a.device, "--training.steps", str(a.steps), "--training.batch_size",
           str(a.batch_size), "--training.seq_len", str(a.seq_len), "--training.mode", a.mode,
           "--fp8.enabled", str(fp8).lower(), "--fp8.scaling", a.scaling, "--checkpoint.enabled", "false",
           "--validation.enabled", "false", "--metrics.log_freq", "1"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in sorted(rows, key=lambda r: r["step"]) if "tokens_per_s" in r][2:]
    return statistics.median(speeds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", default="graph", choices=["graph", "eager"])
    parser.add_argument("--scaling", default="rowwise", choices=["tensorwise", "rowwise"])
    a = parser.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench/fp8.py: no CUDA device here; run it on a GPU machine (or --device cpu for a smoke run)")
        return 0
    best = {False: 0.0, True: 0.0}
    with tempfile.TemporaryDirectory(prefix="fp8_bench_") as work:
        for round_ in range(a.rounds):
            for fp8 in (False, True):
                best[fp8] = max(best[fp8], train(a, Path(work) / f"{round_}-{fp8}", fp8))
    from titan_tpu.config import build_config
    from titan_tpu.models.spec import model_spec
    from titan_tpu.plan.setting import default_hardware

    cfg = build_config(ROOT / "configs" / "llama3_debug.toml", ["--model.flavor", a.flavor, "--model.dtype",
                                                                "bfloat16", "--training.device", a.device])
    flops_per_token, _ = model_spec(cfg.model).flops_per_token(None, a.seq_len)
    line = (f"{a.flavor}, batch {a.batch_size} x {a.seq_len}, {a.mode}, {a.device}: bf16 {best[False]:,.0f} tok/s, "
            f"fp8 ({a.scaling}) {best[True]:,.0f} tok/s, fp8 / bf16 {best[True] / best[False]:.3f}")
    if a.device == "cuda":
        hardware, _ = default_hardware(cfg, measure=False)  # this GPU, from its name (plan/hardware.py)
        fp8_peak = getattr(hardware, "fp8_peak_flops", None)
        line += f"; MFU bf16 {100 * best[False] * flops_per_token / hardware.peak_flops:.1f}% of {hardware.name}'s"
        if fp8_peak:
            line += f", fp8 {100 * best[True] * flops_per_token / fp8_peak:.1f}% of its fp8 peak"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
