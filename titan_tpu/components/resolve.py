"""A run resolved for its world with the re-shard choice made (`resolve`): run/resolved.py's record,
its parallelism.reshard_after_forward auto answered by the planner's memory terms (plan/planner.py
`reshard_choice`: keep the gathered block weights where the plan that keeps them fits). A training
run (build.py) and `titan-tpu compile` both resolve through here, so they build the same program.

It sits above plan/ (whose terms it asks) and below the assembly that reads the record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from titan_tpu.plan.hardware import Hardware
from titan_tpu.plan.planner import reshard_choice
from titan_tpu.run.resolved import ResolvedRun, Target, resolve_run
from titan_tpu.run.setup import RunSetup

__all__ = ["resolve"]

T = TypeVar("T")


def resolve(setup: RunSetup, target: Target, *, hardware: Hardware | None = None) -> ResolvedRun:
    """`setup` resolved for `target`, the re-shard choice made on `hardware` (default: what the config
    names, plan/setting.py `default_hardware`). In a process group rank 0 asks the planner and every
    rank takes its answer, so all run the same collectives."""
    run = resolve_run(setup, target)
    if run.reshard is None:
        run = run.with_reshard(_rank_0_decides(lambda: reshard_choice(run, hardware)))
    return run


def _rank_0_decides(decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, shared with the other ranks; on one process (or a fake group, whose
    collectives do nothing: components/world.py) every caller decides itself."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return decide()
    shared = [decide() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]
