"""Where the time of a multi-rank eager training step goes, on rank 0: the trainer's own step
(titan_tpu.loops: the assembled run and its loop, so SimpleFSDP, expert parallelism and their collectives are as
in a real run) under torch's profiler for three steps after two warm-up steps, self CPU time per
op grouped by the product's categories (titan_tpu/train/profiling.py), collectives and their waits
among them. How the planner's collective rate was found wanting for the two-rank expert-parallel
run (docs/planner.md, "Speed").

    torchrun --standalone --nproc_per_node 2 bench/step_profile_ranks.py configs/qwen3_moe_debug.toml \\
        --parallelism.dp_shard 2 --parallelism.ep 2 --training.device cpu --validation.enabled false \\
        --checkpoint.enabled false --output_dir /tmp/profile_run

Arguments after the config are the trainer's overrides. Run it alone on the machine (a timing).
"""

from __future__ import annotations

import sys
import time

from torch.profiler import ProfilerActivity, profile

from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train.profiling import format_table, time_by_category


def main(argv: list[str]) -> int:
    trainer = assemble(build_config(argv[0], argv[1:]))
    for _ in range(2):
        trainer.train_step()
    steps = 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    if trainer.components.rank != 0:
        return 0
    rows = [(e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()]
    total = sum(ms for _, ms, _ in rows)
    print(format_table(time_by_category(prof.events(), steps=steps, device=False),
                       title=f"rank 0: {wall_ms:.1f} ms a step (profiled), {total:.1f} ms of self CPU time"))
    print("largest ops:")
    for op, ms, count in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"  {op:60s} {ms:8.2f} ms  x{count}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
