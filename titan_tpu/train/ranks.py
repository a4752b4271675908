"""Sums over ranks that the step and its objectives share (a no-op on one process)."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

__all__ = ["all_reduce_sum", "model_copies", "sum_over_data_parallel"]


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over all ranks in place (a no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def model_copies(dp_size: int) -> int:
    """Ranks that hold the same data-parallel rank's batch (tensor- and context-parallel ranks):
    each computes the whole loss of that batch (context parallelism sums its ranks' shares inside
    the model, parallel/context_parallel.py), so a sum over all ranks counts it this many times."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return max(1, world // dp_size)


def sum_over_data_parallel(counts: Tensor, dp_size: int) -> Tensor:
    """`counts` summed over the data-parallel ranks: one scalar all-reduce over all ranks, whose sum
    counts each data-parallel rank's batch `model_copies` times."""
    if dp_size > 1:
        counts = all_reduce_sum(counts) // model_copies(dp_size)
    return counts
