"""docs/known-issues.md 1d, with torch alone: gloo's TCP transport corrupts the heap when two
collectives of one process group run at once on the group's two worker threads.

    python docs/repro/gloo_two_threads.py ITERATIONS THREADS

4 ranks on gloo, the expert-parallel layout (the world, two 2-rank "pair" groups and two 2-rank
"strided" groups). Each iteration issues six functional collectives (all-gather, reduce-scatter,
all-reduce, chosen by iteration) across three groups, does a little compute, then reads every
result. THREADS=2 is torch's default pool per group; THREADS=1 makes every group single-threaded,
as titan_tpu/parallel/gloo.py does. With 2 a rank sometimes dies with SIGSEGV or
"malloc(): unaligned tcache chunk detected" in a gloo worker thread (about one run of 10,000
iterations in four on the 2-core test machine); with 1 it has not.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp


def make_gloo_groups_single_threaded() -> None:
    base = c10d.ProcessGroupGloo

    class SingleThreadGloo(base):
        def __init__(self, store, rank, size, timeout=c10d.default_pg_timeout):
            options = base._Options()
            options._timeout = timeout
            options._devices = [base.create_default_device()]
            options._threads = 1
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SingleThreadGloo


def worker(rank: int, world: int, iterations: int, port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if threads == 1:
        make_gloo_groups_single_threaded()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair, stride = pairs[rank // 2], strided[rank % 2]
    gen = torch.Generator().manual_seed(rank)
    start = time.time()
    for i in range(iterations):
        results = []
        for group, n in ((pair, 2048), (pair, 64), (stride, 4096), (pair, 2048), (dist.group.WORLD, 1000),
                         (stride, 32)):
            x = torch.randn(n, generator=gen)
            kind = (i + n) % 3
            if kind == 0:
                results.append(funcol.all_gather_tensor(x, 0, group))
            elif kind == 1:
                results.append(funcol.reduce_scatter_tensor(x, "sum", 0, group))
            else:
                results.append(funcol.all_reduce(x, "sum", group))
        a = torch.randn(64, 64, generator=gen)
        for _ in range(5):  # compute while the collectives are in flight
            a = (a @ a).tanh()
        sum(float(t.sum()) for t in results)  # waits for every collective
    if rank == 0:
        print(f"ok: {iterations} iterations in {time.time() - start:.1f} s, {threads} gloo thread(s) per group",
              flush=True)
    os._exit(0)  # skip interpreter finalization beside live gloo threads (known-issues 1b)


if __name__ == "__main__":
    iterations, threads = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(worker, args=(4, iterations, 20000 + os.getpid() % 20000, threads), nprocs=4)
