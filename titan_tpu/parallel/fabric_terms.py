"""Which fabric each mesh axis's collectives cross, for the planner (titan_tpu/plan): beside the
mesh whose layout it reads (parallel/mesh.py, parallel/axes.py), so a new axis or another order
brings its own answer.

The layout. The mesh is laid out row-major over the ranks, outermost axis first (`MESH_AXES`:
dp_replicate, dp_shard, pp, cp, tp), as torch's `init_device_mesh` lays it out and as our JAX mesh
places rank r on device r (graph/jax_program.py `jax_mesh`); the expert mesh carves dp_shard into
dp_shard_mod_ep x ep, ep inner (parallel/expert_parallel.py). torchrun numbers the ranks node by
node, and a multi-slice TPU job slice by slice (`titan-tpu compile` orders the devices so), so the
fastest-varying axes sit inside a node or a slice: an axis's group is its `size` ranks `stride`
apart, and it leaves its domain (a node's GPUs, a slice's chips) where those ranks do.

The rate. A ring collective is as fast as its slowest link. Inside a domain every rank sends at the
fast interconnect's rate (NVLink, ICI). Where a ring leaves a domain, the bytes each rank sends
cross the boundary once per direction, and they are spread over the network ports of the group's
members in that domain, one port each (a DGX node's eight GPUs have one 400 Gb/s NIC each, and
NCCL runs a channel per NIC; a TPU chip has its share of its host's DCN), so the boundary carries
members-in-domain x the per-device network rate, and the ring the smaller of that and the fast
rate, in its worst domain. A dp_shard ring over 16 nodes with one GPU in each (tp 8 inside) runs at
one NIC's 50 GB/s; one over all 16 GPUs of 2 nodes at eight NICs' 400 GB/s (NVLink's 450 above
it); dp_replicate across 2 TPU slices, one chip of each group per slice, at one chip's DCN share.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from titan_tpu.parallel.axes import DP_SHARD, EP_AXIS, EP_OUTER_AXIS, MESH_AXES

__all__ = ["axis_strides", "fewest_members_in_a_domain", "ring_bandwidth"]


def axis_strides(mesh_sizes: Mapping[str, int], *, ep: int = 1) -> dict[str, int]:
    """How many ranks apart the members of each axis's group are (module docstring): a dense axis's
    stride is the product of the sizes inside it (`mesh_sizes` over `MESH_AXES`: tp 1, cp tp,
    dp_shard cp x tp, dp_replicate dp_shard x cp x tp); ep, the inner part of dp_shard, dp_shard's
    stride, and dp_shard_mod_ep ep times it."""
    strides, inner = {}, 1
    for axis in reversed(MESH_AXES):
        strides[axis] = inner
        inner *= mesh_sizes[axis]
    return {**strides, EP_AXIS: strides[DP_SHARD], EP_OUTER_AXIS: ep * strides[DP_SHARD]}


@functools.lru_cache(maxsize=4096)
def fewest_members_in_a_domain(*, stride: int, size: int, domain: int, world: int) -> int:
    """Over every group of an axis (`size` ranks `stride` apart, among `world` ranks) and every
    domain of `domain` consecutive ranks it touches, the fewest of its members in one domain:
    `size` when every group lies inside one domain. Counted rank by rank (cached), so layouts
    whose groups straddle a boundary unevenly get their worst group."""
    counts: dict[tuple[int, int], int] = {}
    for rank in range(world):
        group = rank - (rank // stride % size) * stride  # the group's first rank
        key = (group, rank // domain)
        counts[key] = counts.get(key, 0) + 1
    return min(counts.values())


def ring_bandwidth(*, stride: int, size: int, domain: int | None, world: int, inside: float,
                   across: float | None) -> tuple[float, bool]:
    """(bytes/s each rank sends into a ring over the axis, whether the ring leaves its domain): the
    fast rate `inside` where every group lies in one domain (or there is one domain: `domain`
    None), else min(inside, fewest members in a domain x `across`) (module docstring). `across`
    None where the ring leaves its domain is a one-line error (no published figure)."""
    if size == 1 or domain is None or domain >= world:
        return inside, False
    members = fewest_members_in_a_domain(stride=stride, size=size, domain=domain, world=world)
    if members == size:
        return inside, False
    if across is None:
        raise ValueError("this layout sends collectives between nodes or slices, and the hardware table has no "
                         "published network bandwidth for this hardware; plan it as one slice (parallelism.slices 1)")
    return min(inside, members * across), True
