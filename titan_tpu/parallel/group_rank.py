"""This process's rank in a process group, as a value of the step rather than a constant of it.

The trainer reads its rank on an axis as a Python int: cp's head-tail chunks and ep's first local
expert are numbers baked into each rank's program, which is right for one program per process.
A step captured for the JAX lowering (`titan-tpu compile`, kernels/jax_traced.py) is instead one
SPMD program that every device of the mesh runs. There the rank must be a value the program reads
on each device: the op ``titan_tpu::group_rank(group_name)``, a 0-dim int64 tensor that
graph/jax_lowering.py lowers to ``jax.lax.axis_index`` over the mesh axes of the group. Eagerly it
returns the rank (torch.distributed's), so the same code also runs outside a capture.

`rank_in(group, rank)` is what the parallel plans call: the int they hold, or the op inside
titan_tpu/tracing.py's `one_program_for_every_rank()` (which kernels/jax_traced.py's
`traced_for_jax` enters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from titan_tpu.tracing import is_one_program

__all__ = ["group_rank", "rank_in"]


@torch.library.custom_op("titan_tpu::group_rank", mutates_args=())
def group_rank(group_name: str) -> Tensor:
    """This process's rank in the process group named `group_name`, as a 0-dim int64 tensor."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.tensor(dist.get_rank(_resolve_process_group(group_name)), dtype=torch.int64)


@group_rank.register_fake
def _(group_name: str) -> Tensor:
    return torch.empty((), dtype=torch.int64)


def rank_in(group: dist.ProcessGroup, rank: int) -> int | Tensor:
    """`rank` (this process's rank in `group`), or inside `one_program_for_every_rank()` the
    group_rank op of `group` (the mesh axis index once lowered)."""
    return group_rank(group.group_name) if is_one_program() else rank
