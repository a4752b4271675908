"""The mesh axes, named once: what each splits, how parameters are placed on it, and whether
SimpleFSDP gathers it for compute.

Every piece that asks "which axis is this" reads `AXES` instead of testing names: the mesh
(parallel/mesh.py, its order and sizes), SimpleFSDP (what a compute read gathers, what a gradient
reduces over) and the buckets (which parameters can share a flat buffer). A new axis is a row
here, its size in `ParallelDims`, and the module that splits the work along it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AXES", "CP_AXIS", "DP_AXES", "EP_AXES", "EP_AXIS", "MESH_AXES", "PP_AXIS", "TP_AXIS", "MeshAxis",
           "gathered_for_compute"]


@dataclass(frozen=True)
class MeshAxis:
    name: str  # the mesh dimension name
    size_key: str  # the ParallelDims field (and parallelism.<key>) that sizes it
    splits: str  # what the ranks along it divide
    # How parameters are placed on it: replicate; shard (dense weights on dim 0, expert weights on
    # their rows); model (the model's tensor-parallel plan); experts (the expert dim); stages (a
    # scanned stack on its layer dim, the rest replicated).
    params: str
    gathered: bool  # True: SimpleFSDP gathers it whole for compute; False: a rank computes with its own shard


DP_REPLICATE, DP_SHARD, PP_AXIS, CP_AXIS, TP_AXIS = "dp_replicate", "dp_shard", "pp", "cp", "tp"
EP_AXIS, EP_OUTER_AXIS = "ep", "dp_shard_mod_ep"

AXES: dict[str, MeshAxis] = {axis.name: axis for axis in (
    MeshAxis(DP_REPLICATE, "dp_replicate", "batch rows (whole copies of the parameters)", "replicate", True),
    MeshAxis(DP_SHARD, "dp_shard", "batch rows (parameters, gradients and moments sharded)", "shard", True),
    # Pipeline stages (parallel/pipeline.py): a scanned stack's layers split over the ranks; the
    # other weights whole on each, their gradients summed over pp after the backward.
    MeshAxis(PP_AXIS, "pp", "the layer stack (pipeline stages)", "stages", False),
    MeshAxis(CP_AXIS, "cp", "every sequence (parameters replicated; gradients all-reduced)", "replicate", True),
    MeshAxis(TP_AXIS, "tp", "heads, ffn_hidden_dim and the vocabulary", "model", False),
    # The expert mesh (parallel/expert_parallel.py), carved out of dp_shard: experts spread over
    # ep, sharded like dense weights over the dp_shard ranks that hold the same experts.
    MeshAxis(EP_OUTER_AXIS, "dp_shard", "batch rows among the ranks that hold the same experts", "shard", True),
    MeshAxis(EP_AXIS, "ep", "the experts of each MoE layer", "experts", False),
)}

# The dense mesh, outermost first. Replicas are the outer axis so that the shard groups (which
# all-gather every layer) are the inner, usually faster-connected, neighbours; tp, which
# communicates several times per block, is innermost (within a node / NVLink domain / slice).
# Pipeline stages sit inside the data-parallel axes (the ranks of one batch stay consecutive,
# `BatchSplit`); a stage passes one activation per micro-batch to its neighbour.
MESH_AXES = (DP_REPLICATE, DP_SHARD, PP_AXIS, CP_AXIS, TP_AXIS)
DP_AXES = (DP_REPLICATE, DP_SHARD)  # the data-parallel axes: each rank along them reads other rows
EP_AXES = (EP_OUTER_AXIS, EP_AXIS)  # the expert mesh, outermost first


def gathered_for_compute(axis_names) -> list[bool]:
    """Per mesh dimension: whether a compute read gathers it (`MeshAxis.gathered`)."""
    return [AXES[name].gathered for name in axis_names]
