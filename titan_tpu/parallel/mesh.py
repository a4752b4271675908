"""Parallelism sizes and the device mesh built from them.

Data parallelism (replicate, fully shard, or both = hybrid shard), context parallelism (cp:
sequences split over ranks, parallel/context_parallel.py), tensor parallelism (the innermost
axis, parallel/tensor_parallel.py) and expert parallelism, which is carved out of the fully
sharded axis (ep divides dp_shard; parallel/expert_parallel.py). The mesh is
[dp_replicate, dp_shard, cp, tp], outermost first, keeping only the axes of size > 1. The sizes
are validated here, once, so every later piece can trust them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_tpu.parallel.axes import AXES, DP_AXES, MESH_AXES
from titan_tpu.parallel.expert_parallel import build_expert_mesh

__all__ = ["ParallelDims", "dp_rank_and_size", "DP_AXES", "MESH_AXES"]


def check_cp_with_ep(cp: int, ep: int) -> None:
    """One-line ValueError for context parallelism together with expert parallelism (the planner
    refuses it in the same words)."""
    if cp > 1 and ep > 1:
        raise ValueError("--parallelism.cp > 1 with --parallelism.ep > 1 is not supported yet (the expert mesh "
                         "is carved out of dp_shard alone); set ep 1 (cp runs MoE models with ep 1) or cp 1")


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other axes (TorchTitan)
    world_size: int = 1
    ep: int = 1  # expert parallelism: MoE experts spread over groups of ep of the dp_shard ranks
    tp: int = 1  # tensor (and sequence) parallelism, the innermost axis
    cp: int = 1  # context parallelism: each rank holds 1 / cp of every sequence (parallel/context_parallel.py)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}; check how the job was launched")
        if self.dp_replicate < 1:
            raise ValueError(f"--parallelism.dp_replicate must be >= 1, got {self.dp_replicate}")
        if self.tp < 1:
            raise ValueError(f"--parallelism.tp must be >= 1, got {self.tp}")
        if self.cp < 1:
            raise ValueError(f"--parallelism.cp must be >= 1, got {self.cp}")
        others = self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(f"--parallelism.dp_replicate ({self.dp_replicate}) * cp ({self.cp}) * tp ({self.tp}) "
                                 f"must divide the world size ({self.world_size}) when --parallelism.dp_shard is -1")
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ValueError(f"--parallelism.dp_shard must be >= 1 or -1 (use the rest), got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ValueError(f"--parallelism.dp_replicate ({self.dp_replicate}) * --parallelism.dp_shard "
                             f"({self.dp_shard}) * cp ({self.cp}) * tp ({self.tp}) must equal the world size "
                             f"({self.world_size}); change one of them")
        if self.tp > 1 and self.ep > 1:
            raise ValueError("--parallelism.tp > 1 with --parallelism.ep > 1: MoE models use ep only; set tp 1")
        check_cp_with_ep(self.cp, self.ep)
        if self.ep < 1:
            raise ValueError(f"--parallelism.ep must be >= 1, got {self.ep}")
        if self.ep > 1 and self.dp_shard % self.ep != 0:
            raise ValueError(f"--parallelism.ep ({self.ep}) must divide --parallelism.dp_shard ({self.dp_shard}): "
                             "expert parallelism is carved out of the fully sharded ranks")
        if self.ep > 1 and self.dp_replicate > 1:
            raise ValueError("--parallelism.ep > 1 with --parallelism.dp_replicate > 1 is not supported yet; "
                             "use dp_replicate 1")

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """"none" | "replicate" | "fully_shard" | "hybrid_shard" (the data_parallel mode)."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return "hybrid_shard"
        if self.dp_shard > 1:
            return "fully_shard"
        if self.dp_replicate > 1:
            return "replicate"
        return "none"

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The [dp_replicate, dp_shard, cp, tp] mesh over the (already initialised) default process
        group, or None on a single process, where the model stays plain tensors."""
        if self.world_size == 1:
            return None
        shape_by_axis = {a: getattr(self, AXES[a].size_key) for a in MESH_AXES}  # order and names: parallel/axes.py
        # Keep only the axes in use: a size-1 axis would only add an empty collective per layer.
        axes = tuple(a for a in MESH_AXES if shape_by_axis[a] > 1)
        return init_device_mesh(device_type, tuple(shape_by_axis[a] for a in axes), mesh_dim_names=axes)


    def build_expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (dp_shard / ep, ep) mesh the MoE experts live on, or None without expert parallelism."""
        if self.ep == 1:
            return None
        return build_expert_mesh(device_type, dp_shard=self.dp_shard, ep=self.ep)


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This process's index among all data-parallel ranks, and their number (for the data
    loader: every dp rank reads different rows; ranks differing only along other axes read the
    same). Replicate-major, matching the mesh layout."""
    if mesh is None:
        return 0, 1
    rank, size = 0, 1
    for axis in DP_AXES:
        if axis in (mesh.mesh_dim_names or ()):
            axis_size = mesh.size(mesh.mesh_dim_names.index(axis))
            rank = rank * axis_size + mesh.get_local_rank(axis)
            size *= axis_size
    return rank, size
