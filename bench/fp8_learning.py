"""Does fp8 learn like bf16? The debug model trained twice from the same seed and data, bf16
and bf16 + fp8 linears (emulated on a CPU, kernels/fp8.py), in one run.

    python bench/fp8_learning.py                        # 300 steps, rowwise scaling
    python bench/fp8_learning.py --scaling tensorwise --steps 100
    # MoE experts too (docs/fp8.md "MoE experts"): the Qwen3-MoE debug model (fp32) with fp8 linears
    # and experts against the same run without fp8; 4 x 128 tokens a step keeps it near 30 min on 2 cores
    python bench/fp8_learning.py --config configs/qwen3_moe_debug.toml --experts -- \
        --training.batch_size 4 --training.seq_len 128

Prints the mean loss of the last 30 steps of each and their ratio; the issue's bar is fp8 within
1.5% of bf16. Each run is a real trainer process (configs/llama3_fp8_debug.toml, whose dims are
multiples of 16 as fp8 matmuls need); on a CPU without bf16 instructions (avx512_bf16 / amx_bf16
in /proc/cpuinfo) bf16 matmuls are far slower, so check before timing anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "llama3_fp8_debug.toml"


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]


def train(run_dir: Path, steps: int, fp8: bool, scaling: str, *, config: Path = CONFIG, experts: bool = False,
          extra: tuple[str, ...] = ()) -> list[float]:
    cmd = [sys.executable, "-m", "titan_tpu", "train", "--config", str(config), "--output_dir", str(run_dir),
           "--training.steps", str(steps), "--fp8.enabled", str(fp8).lower(), "--fp8.scaling", scaling,
           "--fp8.experts", str(fp8 and experts).lower(),
           "--checkpoint.enabled", "false", "--validation.enabled", "false", "--metrics.log_freq", "1", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return losses(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--scaling", default="rowwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--tail", type=int, default=30, help="steps averaged at the end")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the model's config (default: the debug model)")
    parser.add_argument("--experts", action="store_true", help="fp8.experts too: an MoE model's grouped matmuls")
    parser.add_argument("extra", nargs="*", help="more overrides for both runs, after --")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8_learning_") as work:
        bf16 = train(Path(work) / "bf16", a.steps, False, a.scaling, config=a.config, extra=tuple(a.extra))
        fp8 = train(Path(work) / "fp8", a.steps, True, a.scaling, config=a.config, experts=a.experts,
                    extra=tuple(a.extra))
    mean_bf16, mean_fp8 = (sum(x[-a.tail:]) / a.tail for x in (bf16, fp8))
    # "bf16": the config's own dtype (the MoE debug model's is float32)
    print(f"{a.steps} steps, last {a.tail}: without fp8 {mean_bf16:.4f}, fp8 ({a.scaling}"
          f"{', experts too' if a.experts else ''}) {mean_fp8:.4f}, ratio {mean_fp8 / mean_bf16:.4f} "
          f"({(mean_fp8 / mean_bf16 - 1) * 100:+.2f}%); first step {bf16[0]:.4f} / {fp8[0]:.4f}; last step "
          f"{bf16[-1]:.4f} / {fp8[-1]:.4f}")
    return 0 if abs(mean_fp8 / mean_bf16 - 1) <= 0.015 else 1


if __name__ == "__main__":
    sys.exit(main())
