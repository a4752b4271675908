"""What starting local gloo ranks costs: fresh interpreters (spawn) against forks of the preloaded
fork server that `titan_tpu.parallel.spawn.run_ranks` uses.

Each round starts `--world` ranks both ways, in alternating order, each rank joining the group and
running one all-reduce; prints the median start-to-join time of each and their ratio (machine
noise hits both alike). The first fork-server start (the server importing torch once) is reported
on its own: a pytest session pays it once.

    python bench/rank_start.py              # 2 ranks, 5 rounds
    python bench/rank_start.py --world 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_tpu.device_cpu import _cpu_model
from titan_tpu.parallel.spawn import run_ranks


def _all_reduce_once() -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _all_reduce_once()
    dist.destroy_process_group()


def start_spawned(world_size: int) -> float:
    """Seconds until `world_size` fresh interpreters have joined, all-reduced and exited."""
    started = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    mp.start_processes(_spawned_rank, args=(world_size, store.port), nprocs=world_size, start_method="spawn")
    return time.perf_counter() - started


def start_forked(world_size: int) -> float:
    started = time.perf_counter()
    assert run_ranks(_all_reduce_once, world_size=world_size) == [float(world_size)] * world_size
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks per start (2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    a = parser.parse_args()
    first = start_forked(a.world)
    spawned, forked = [], []
    for round_ in range(a.rounds):
        order = [(start_spawned, spawned), (start_forked, forked)]
        for start, times in order if round_ % 2 == 0 else reversed(order):
            times.append(start(a.world))
    spawn_s, fork_s = statistics.median(spawned), statistics.median(forked)
    print(f"{a.world} ranks, {a.rounds} rounds, {_cpu_model()}, load average {open('/proc/loadavg').read().split()[0]}")
    print(f"first fork-server start (imports torch once): {first:.2f} s")
    print(f"spawn: {spawn_s:.2f} s   fork server: {fork_s:.2f} s   ratio spawn / fork server: {spawn_s / fork_s:.1f}x")


if __name__ == "__main__":
    main()
