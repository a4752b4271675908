"""This CPU's collective rate: the bytes per second one rank sends into a gloo all-gather or
reduce-scatter between two processes of this machine (the planner's interconnect bandwidth for
`cpu`, plan/hardware.py CPU_COLLECTIVE_BANDWIDTH; the calibration measures it in each sitting).

    torchrun --standalone --nproc_per_node 2 -m titan_tpu.plan.collective_rate

prints one JSON line (rank 0). Gloo on one machine moves tensors through loopback TCP, far below
the memory's copy rate, and unevenly: the rate is the bytes sent per rank (ring: (n - 1) / n of
the gathered size) over the median time of each collective, summed over message sizes of 1 and 4
MB a rank (the debug runs' per-layer token dispatch and bucketed weights) and both kinds. Median,
not best: a step's many collectives take their typical time, not their luckiest.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

from titan_tpu.parallel.gloo import use_single_thread_gloo

__all__ = ["measure_collective_rate"]

SHARD_ELEMENTS = (1 << 18, 1 << 20)  # fp32 elements a rank contributes: 1 MB and 4 MB


def measure_collective_rate(*, reps: int = 12) -> dict:
    """(In an initialised process group.) {"bytes_per_s": rate, "by_size": [...]} as described above."""
    world = dist.get_world_size()
    sent_total = time_total = 0.0
    by_size = []
    for numel in SHARD_ELEMENTS:
        shard, whole = torch.randn(numel), torch.randn(world * numel)
        gathered, reduced = torch.empty(world * numel), torch.empty(numel)
        for kind in ("all_gather", "reduce_scatter"):
            median = _median_seconds(kind, reps=reps, shard=shard, whole=whole, gathered=gathered, reduced=reduced)
            sent = numel * 4 * (world - 1)
            sent_total += sent
            time_total += median
            by_size.append({"kind": kind, "mb_per_rank": numel * 4 / 1e6, "median_ms": median * 1e3,
                            "gb_per_s": sent / median / 1e9})
    return {"bytes_per_s": sent_total / time_total, "by_size": by_size, "latency_s": measure_latency(reps=reps)}


def measure_latency(*, reps: int = 12, numel: int = 1024) -> float:
    """Median seconds of a 4 KB all-gather and reduce-scatter, averaged over the two kinds: what a
    collective call costs beside its bytes (the planner's collective_latency for the CPU)."""
    world = dist.get_world_size()
    shard, whole = torch.randn(numel), torch.randn(world * numel)
    gathered, reduced = torch.empty(world * numel), torch.empty(numel)
    medians = [_median_seconds(kind, reps=reps, shard=shard, whole=whole, gathered=gathered, reduced=reduced)
               for kind in ("all_gather", "reduce_scatter")]
    return sum(medians) / len(medians)


def _median_seconds(kind: str, *, reps: int, shard, whole, gathered, reduced) -> float:
    """Median seconds of `reps` calls of one collective ("all_gather" of shard into gathered, or
    "reduce_scatter" of whole into reduced), each started together after a barrier; two more
    calls first warm the connections up."""
    times = []
    for _ in range(reps + 2):
        dist.barrier()
        start = time.perf_counter()
        if kind == "all_gather":
            dist.all_gather_into_tensor(gathered, shard)
        else:
            dist.reduce_scatter_tensor(reduced, whole)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> int:
    use_single_thread_gloo()  # the groups training runs on (parallel/gloo.py)
    dist.init_process_group("gloo")
    try:
        result = measure_collective_rate()
        if dist.get_rank() == 0:
            print(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
