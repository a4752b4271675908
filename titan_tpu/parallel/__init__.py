"""Parallelism: device mesh sizes (mesh.py), SimpleFSDP data parallelism (simple_fsdp.py) and MoE
expert parallelism (expert_parallel.py)."""

from titan_tpu.parallel.mesh import ParallelDims, dp_rank_and_size
from titan_tpu.parallel.simple_fsdp import (
    MixedPrecision,
    data_parallel,
    default_mixed_precision,
    materialize_and_init,
)

__all__ = [
    "MixedPrecision",
    "ParallelDims",
    "data_parallel",
    "default_mixed_precision",
    "dp_rank_and_size",
    "materialize_and_init",
]
