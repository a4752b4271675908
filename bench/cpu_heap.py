"""Where a CPU training process's resident memory goes at its peak: the trainer's own run, with
glibc's allocator statistics (mallinfo2) and the resident size read after every op of every step.

At the moment of highest resident memory it splits RSS into: memory outside malloc (libraries,
Python's own arenas, thread stacks), malloc's heap (bytes in use and bytes free but kept inside the
heap: freed blocks glibc cannot hand back because live blocks sit above them) and malloc's mmapped
blocks. "free in heap" is what an accelerator's allocator would call fragmentation; the planner
predicts the bytes in use (docs/planner.md, "Where resident memory goes").

    python bench/cpu_heap.py --config configs/llama3_debug.toml --activation_checkpoint.mode full
    MALLOC_MMAP_THRESHOLD_=4194304 python bench/cpu_heap.py --config configs/qwen3_debug.toml \\
        --activation_checkpoint.mode full --training.seq_len 1024
    torchrun --standalone --nproc_per_node 2 bench/cpu_heap.py --config ... --parallelism.dp_shard 2

Every argument is the trainer's (`titan-tpu train`); four steps, no checkpoints or validation,
unless overridden. Memory only: the per-op sampling makes the steps several times slower. Linux
with glibc 2.33 or newer (mallinfo2).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from torch.utils._python_dispatch import TorchDispatchMode

from titan_tpu.plan.malloc_stats import malloc_state

_PAGE = os.sysconf("SC_PAGE_SIZE")
_statm = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115 - read after every op, kept open


def resident_bytes() -> int:
    _statm.seek(0)
    return int(_statm.read().split()[1]) * _PAGE


class _PeakSampler(TorchDispatchMode):
    """After every op: the resident size and glibc's statistics; the largest bytes in use, and at
    each new resident maximum, the statistics and the op."""

    def __init__(self) -> None:
        super().__init__()
        self.peak: dict = {"rss": 0}
        self.max_in_use = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rss, state = resident_bytes(), malloc_state()
        self.max_in_use = max(self.max_in_use, state["in_use"])
        if rss > self.peak["rss"]:
            self.peak = {"rss": rss, "op": str(func), **state}
        return out


def _breakdown(p: dict) -> dict[str, float]:
    outside = p["rss"] - p["heap"] - p["mmapped"]
    return {"rss": p["rss"], "outside_malloc": outside, "heap_in_use": p["in_use"] - p["mmapped"],
            "heap_free": p["free_in_heap"], "mmapped": p["mmapped"]}


def main(argv: list[str]) -> int:
    from titan_tpu.cli import main as cli_main
    from titan_tpu.loops.base import Loop

    reports = []
    original = Loop.train_step

    def sampled_step(self):
        before = {"rss": resident_bytes(), **malloc_state()}
        sampler = _PeakSampler()
        with sampler:
            result = original(self)
        reports.append({"step": self.step, "before": before, "peak": sampler.peak, "max_in_use": sampler.max_in_use})
        return result

    Loop.train_step = sampled_step
    defaults = ["--training.steps", "4", "--validation.enabled", "false", "--checkpoint.enabled", "false",
                "--metrics.tensorboard", "false", "--checkpoint.resume", "false", "--training.device", "cpu",
                "--lr_scheduler.warmup_steps", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        rc = cli_main(["train", *defaults, "--output_dir", tmp, *argv])
    if rc or not reports:
        return rc or 1
    rank = os.environ.get("RANK", "0")
    worst = max(reports, key=lambda r: r["peak"]["rss"])
    b = _breakdown(worst["peak"])
    start = reports[0]["before"]
    max_in_use = max(r["max_in_use"] for r in reports)
    gb = {k: round(v / 1e9, 3) for k, v in b.items()}
    print(json.dumps({"rank": rank, "peak_step": worst["step"], "peak_after_op": worst["peak"]["op"], **gb,
                      "in_use_before_first_step": round(start["in_use"] / 1e9, 3),
                      "max_in_use": round(max_in_use / 1e9, 3)}))
    print(f"rank {rank}: peak RSS {gb['rss']:.3f} GB (step {worst['step']}, after {worst['peak']['op']}) = "
          f"outside malloc {gb['outside_malloc']:.3f} + heap in use {gb['heap_in_use']:.3f} + heap free (kept by "
          f"glibc) {gb['heap_free']:.3f} + mmapped {gb['mmapped']:.3f} GB; malloc in use before step 1 "
          f"{start['in_use'] / 1e9:.3f} GB, at most {max_in_use / 1e9:.3f} GB during the steps (+"
          f"{(max_in_use - start['in_use']) / 1e9:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
