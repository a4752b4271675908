"""`sequence_point(*tensors)`: the same values, through a point XLA neither fuses across nor moves
work over: graph/jax_lowering.py lowers ``titan_tpu::sequence_point`` to `jax.lax.optimization_barrier`.

A kernel that loops over chunks (kernels/loss.py `chunked`) leaves XLA a chain of independent
steps. XLA's fusion may then merge the chain's sums into one loop that reads every chunk's product at
once, and its scheduler may run every chunk's matmul before the first sum. What the loop was for,
one chunk's temporaries at a time, is lost. Passing the running sum and the next chunk's input
through a sequence point between chunks restores it: the next chunk cannot start before the sum is
done, and no sum is fused with the next.

Only a step traced for the JAX lowering (`titan-tpu compile`, the JAX path's runs) needs it:
`needs_sequence_points` says when. Eagerly the op copies its inputs, since a custom op may not
return them; nothing eager calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_tpu.kernels.registry import kernel_device_type

__all__ = ["needs_sequence_points", "sequence_point"]


@torch.library.custom_op("titan_tpu::sequence_point", mutates_args=())
def _sequence_point(tensors: list[Tensor]) -> list[Tensor]:
    return [t.clone() for t in tensors]


@_sequence_point.register_fake
def _(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(t) for t in tensors]


def sequence_point(*tensors: Tensor) -> tuple[Tensor, ...]:
    """`tensors`, unchanged in value, as a point of order in an XLA program (the module docstring)."""
    return tuple(_sequence_point(list(tensors)))


def needs_sequence_points(device_type: str) -> bool:
    """Whether kernels on `device_type` run inside a step lowered to JAX for XLA (`device_type_as`
    "jax", kernels/__init__.py), where the sequence points take effect."""
    return kernel_device_type(device_type) == "jax"
