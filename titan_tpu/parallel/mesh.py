"""Parallelism sizes and the device mesh built from them.

Data parallelism (replicate, fully shard, or both = hybrid shard), pipeline stages (pp:
parallel/pipeline.py), context parallelism (cp:
sequences split over ranks, parallel/context_parallel.py), tensor parallelism (the innermost
axis, parallel/tensor_parallel.py) and expert parallelism, which is carved out of the fully
sharded axis (ep divides dp_shard; parallel/expert_parallel.py). The mesh is
[dp_replicate, dp_shard, pp, cp, tp], outermost first, keeping only the axes of size > 1. The sizes
are resolved (dp_shard -1) and validated here, once (`ParallelDims.from_config`), so every later
piece can trust them; `BatchSplit` is the one answer to which ranks share a batch.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_tpu.parallel.axes import AXES, DP_AXES, DP_SHARD, MESH_AXES
from titan_tpu.parallel.expert_parallel import build_expert_mesh

if TYPE_CHECKING:
    from titan_tpu.config import ParallelismConfig

__all__ = ["BatchSplit", "ParallelDims", "dp_rank_and_size", "DP_AXES", "MESH_AXES"]

# The [parallelism] keys that size an axis, each once (the expert mesh's outer axis is dp_shard's).
_SIZE_KEYS = tuple(dict.fromkeys(axis.size_key for axis in AXES.values()))


def _product(sizes: dict[str, int]) -> str:
    """"--parallelism.dp_replicate (2) * --parallelism.cp (1) ...": mesh axes' sizes, each named by its key."""
    return " * ".join(f"--parallelism.{AXES[axis].size_key} ({size})" for axis, size in sizes.items())


@dataclass(frozen=True)
class BatchSplit:
    """Which ranks share a batch: the global batch splits into `dp_size` different row sets, this
    rank reads set `dp_rank`, and `ranks_per_dp` ranks read each set (those that differ only along
    cp and tp, which split a row set's sequences and model, not its rows). The data loaders, the
    accumulation derived from training.global_batch_tokens and the loss scaling all read it."""

    dp_size: int = 1
    dp_rank: int = 0
    ranks_per_dp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ranks_per_dp

    def across_groups(self, *, group: int, groups: int) -> BatchSplit:
        """The split over `groups` separate jobs of this split each (replica groups,
        fault_tolerance): the groups read different rows, group-major."""
        if not 0 <= group < groups:
            raise ValueError(f"fault_tolerance.replica_id = {group} must be in [0, {groups}) "
                             "(fault_tolerance.replicas); set one of them")
        return BatchSplit(dp_size=groups * self.dp_size, dp_rank=group * self.dp_size + self.dp_rank,
                          ranks_per_dp=self.ranks_per_dp)


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves after the other axes (TorchTitan)
    world_size: int = 1
    ep: int = 1  # expert parallelism: MoE experts spread over groups of ep of the dp_shard ranks
    tp: int = 1  # tensor (and sequence) parallelism, the innermost axis
    cp: int = 1  # context parallelism: each rank holds 1 / cp of every sequence (parallel/context_parallel.py)
    pp: int = 1  # pipeline stages: the scanned layer stack split over pp ranks (parallel/pipeline.py)
    # False: resolve the sizes and check that they fill the world, not how ep lays experts out on
    # them nor the combinations the trainer cannot run yet (ep with tp, cp or dp_replicate): the
    # planner plans those and says why a layout does not run (parallel/plan_terms.py Layout).
    runnable: InitVar[bool] = True

    @classmethod
    def from_config(cls, p: ParallelismConfig, *, world_size: int | None, runnable: bool = True) -> ParallelDims:
        """The [parallelism] section's sizes on `world_size` ranks, dp_shard -1 resolved and
        everything checked (one-line ValueErrors). world_size None: the ranks the section names
        itself (dp_shard -1 counting as 1), for a plan of a run on one CPU."""
        sizes = {key: getattr(p, key) for key in _SIZE_KEYS}
        if world_size is None:
            world_size = math.prod(max(sizes[AXES[a].size_key], 1) for a in MESH_AXES)
        return cls(**sizes, world_size=world_size, runnable=runnable)

    def __post_init__(self, runnable: bool):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}; check how the job was launched")
        for key in _SIZE_KEYS:
            if key != DP_SHARD and getattr(self, key) < 1:
                raise ValueError(f"--parallelism.{key} must be >= 1, got {getattr(self, key)}")
        others = {axis: size for axis, size in self.mesh_sizes().items() if axis != DP_SHARD}
        if self.dp_shard == -1:
            if self.world_size % math.prod(others.values()) != 0:
                raise ValueError(f"{_product(others)} must divide the world size ({self.world_size}) when "
                                 "--parallelism.dp_shard is -1")
            self.dp_shard = self.world_size // math.prod(others.values())
        if self.dp_shard < 1:
            raise ValueError(f"--parallelism.dp_shard must be >= 1 or -1 (use the rest), got {self.dp_shard}")
        if math.prod(self.mesh_sizes().values()) != self.world_size:
            raise ValueError(f"{_product(self.mesh_sizes())} must equal the world size ({self.world_size}); change "
                             "one of them (dp_shard -1 takes the ranks the others leave)")
        if runnable:
            self._check_runnable()

    def _check_runnable(self) -> None:
        """How the code lays experts out, and the combinations it does not run yet, each a one-line ValueError."""
        if self.ep > 1 and self.dp_shard % self.ep != 0:
            raise ValueError(f"--parallelism.ep ({self.ep}) must divide --parallelism.dp_shard ({self.dp_shard}): "
                             "expert parallelism is carved out of the fully sharded ranks")
        if self.ep > 1 and self.dp_replicate > 1:
            raise ValueError("--parallelism.ep > 1 with --parallelism.dp_replicate > 1 is not supported yet; "
                             "use dp_replicate 1")
        if self.pp > 1 and self.cp > 1:
            raise ValueError(f"--parallelism.pp > 1 composes with the data-parallel axes, tp and ep only so far, "
                             f"not --parallelism.cp {self.cp} (not built yet: the stages' hand-over and the "
                             "loss's share-out take whole sequences); set cp to 1")

    def config_sizes(self) -> dict[str, int]:
        """Each [parallelism] key that sizes an axis -> its value here (dp_shard resolved)."""
        return {key: getattr(self, key) for key in _SIZE_KEYS}

    def mesh_sizes(self) -> dict[str, int]:
        """Each axis of the dense mesh -> its size, outermost first (parallel/axes.py MESH_AXES)."""
        return {a: getattr(self, AXES[a].size_key) for a in MESH_AXES}

    @property
    def dp_size(self) -> int:
        return math.prod(getattr(self, AXES[a].size_key) for a in DP_AXES)

    def batch_split(self, rank: int = 0) -> BatchSplit:
        """Which ranks share a batch (BatchSplit), for global rank `rank`: the data-parallel axes are
        the mesh's outermost, so the ranks_per_dp consecutive ranks along the inner axes (cp, tp)
        read the same rows, and the row set is the rank's index along the data-parallel axes,
        replicate-major (as dp_rank_and_size reads it off the built mesh). Expert parallelism is
        carved out of dp_shard: its ranks read different rows like the rest of dp_shard."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks; check how the job was "
                             "launched")
        ranks_per_dp = self.world_size // self.dp_size
        return BatchSplit(dp_size=self.dp_size, dp_rank=rank // ranks_per_dp, ranks_per_dp=ranks_per_dp)

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
        """The [dp_replicate, dp_shard, pp, cp, tp] mesh over the (already initialised) default process
        group, or None on a single process, where the model stays plain tensors."""
        if self.world_size == 1:
            return None
        shape_by_axis = self.mesh_sizes()  # order and names: parallel/axes.py
        # Keep only the axes in use: a size-1 axis would only add an empty collective per layer.
        axes = tuple(a for a in MESH_AXES if shape_by_axis[a] > 1)
        return init_device_mesh(device_type, tuple(shape_by_axis[a] for a in axes), mesh_dim_names=axes)


    def build_expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (dp_shard / ep, ep, pp, cp, tp) mesh the MoE experts live on, or None without expert parallelism."""
        if self.ep == 1:
            return None
        return build_expert_mesh(device_type, dp_shard=self.dp_shard, ep=self.ep, pp=self.pp, cp=self.cp, tp=self.tp)


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
