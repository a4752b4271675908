"""The mesh axes table (parallel/axes.py): every axis a mesh is built with has a row, and the rows
agree with how SimpleFSDP places and reads parameters."""

from __future__ import annotations

import dataclasses

from titan_tpu.parallel.axes import AXES, DP_AXES, EP_AXES, MESH_AXES, gathered_for_compute
from titan_tpu.parallel.mesh import ParallelDims


def test_every_mesh_axis_has_a_row_sized_by_a_parallel_dims_field():
    fields = {f.name for f in dataclasses.fields(ParallelDims)}
    for name in (*MESH_AXES, *EP_AXES):
        assert name in AXES, f"mesh axis {name} has no row in parallel/axes.py AXES"
        assert AXES[name].size_key in fields, (name, AXES[name].size_key)
    assert set(DP_AXES) <= set(MESH_AXES)


def test_compute_reads_sharded_exactly_the_axes_whose_placement_is_not_simple_fsdps():
    """SimpleFSDP gathers the axes it places itself (replicate, shard) and leaves the model's
    tensor-parallel shards, the experts and a stage's layers as they are; the buckets hold only fully
    gathered weights."""
    for axis in AXES.values():
        assert axis.params in ("replicate", "shard", "model", "experts", "stages"), axis
        assert axis.gathered == (axis.params in ("replicate", "shard")), axis
    assert gathered_for_compute(("dp_replicate", "dp_shard", "pp", "cp", "tp")) == [True, True, False, True, False]
    assert gathered_for_compute(EP_AXES) == [True, False]
