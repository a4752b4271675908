"""Reading and writing parameters that may be sharded (DTensors): this rank's part, a whole tensor.

It sits in the lowest layer (docs/architecture.md, "Layers") because models/ loads Hugging Face
weights into parameters that parallel/ may already have sharded, and models/ sits below parallel/.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["copy_full_", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values, detached: a DTensor's local shard, or a plain tensor
    itself (what a captured step reads, and what a step writes its new values into)."""
    t = t.detach()
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into `target`, a plain tensor or a DTensor (then only this rank's shard
    of `full` is written); `full` is cast to the target's device and dtype."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        target.to_local().copy_(distribute_tensor(full, target.device_mesh, target.placements).to_local())
    else:
        target.copy_(full)
