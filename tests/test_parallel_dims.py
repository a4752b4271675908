"""The mesh sizes resolved once (`ParallelDims.from_config`) and the one answer to which ranks share
a batch (`BatchSplit`): the data loaders, the accumulation from the global batch, the loss scaling
and the planner all read it, so it must agree with the mesh the trainer builds."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_tpu.config import ParallelismConfig
from titan_tpu.parallel.axes import DP_AXES, MESH_AXES
from titan_tpu.parallel.mesh import BatchSplit, ParallelDims, dp_rank_and_size


def section(**sizes) -> ParallelismConfig:
    p = ParallelismConfig()
    for key, value in sizes.items():
        setattr(p, key, value)
    return p


def test_dp_shard_minus_one_takes_the_ranks_the_other_axes_leave():
    assert ParallelDims.from_config(section(), world_size=8).dp_shard == 8
    assert ParallelDims.from_config(section(dp_replicate=2, tp=2), world_size=8).dp_shard == 2
    assert ParallelDims.from_config(section(cp=2, tp=2), world_size=8).dp_shard == 2
    dims = ParallelDims.from_config(section(dp_shard=4, ep=2), world_size=4)
    assert (dims.dp_shard, dims.ep, dims.dp_size) == (4, 2, 4)


def test_without_a_world_size_the_section_names_its_ranks():
    """A plan of a run on one CPU: the ranks are the product of the sizes, dp_shard -1 counting as 1."""
    assert ParallelDims.from_config(section(), world_size=None).world_size == 1
    assert ParallelDims.from_config(section(dp_replicate=2, tp=2), world_size=None).world_size == 4
    assert ParallelDims.from_config(section(dp_shard=3, cp=2), world_size=None).world_size == 6


@pytest.mark.parametrize("sizes, world_size, match", [
    (dict(dp_replicate=3), 4, r"--parallelism.dp_replicate \(3\) \* --parallelism.pp \(1\) \* --parallelism.cp \(1\) "
                              r"\* --parallelism.tp \(1\) must divide the world size \(4\) when --parallelism.dp_shard "
                              r"is -1"),
    (dict(dp_shard=3), 8, r"--parallelism.dp_shard \(3\) \* --parallelism.pp \(1\) \* --parallelism.cp \(1\) \* "
                          r"--parallelism.tp \(1\) must equal the world size \(8\)"),
    (dict(dp_shard=0), 2, r"--parallelism.dp_shard must be >= 1 or -1"),
    (dict(tp=0), 2, r"--parallelism.tp must be >= 1"),
    (dict(ep=3), 4, r"--parallelism.ep \(3\) must divide --parallelism.dp_shard \(4\)"),
    (dict(dp_replicate=2, ep=2), 4, r"--parallelism.ep > 1 with --parallelism.dp_replicate > 1"),
])
def test_from_config_errors_are_one_line(sizes, world_size, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelDims.from_config(section(**sizes), world_size=world_size)
    assert "\n" not in str(info.value)


def test_the_planner_plans_what_the_trainer_does_not_run_yet():
    """runnable False checks the sizes fill the world, not ep's layout or the unsupported combinations."""
    dims = ParallelDims.from_config(section(dp_replicate=2, ep=2), world_size=4, runnable=False)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)
    with pytest.raises(ValueError, match="must equal the world size"):
        ParallelDims.from_config(section(dp_shard=3), world_size=4, runnable=False)


# (sizes, world size) -> (dp_size, ranks_per_dp): ranks along cp and tp read the same rows; ep,
# carved out of dp_shard, reads different rows like the rest of dp_shard.
SPLITS = {
    "single process": (dict(), 1, 1, 1),
    "dp_shard 4": (dict(dp_shard=4), 4, 4, 1),
    "dp 2 x tp 2": (dict(tp=2), 4, 2, 2),
    "dp 2 x cp 2": (dict(cp=2), 4, 2, 2),
    "hybrid 2x2": (dict(dp_replicate=2, dp_shard=2), 4, 4, 1),
    "hybrid 2x2 x cp 2 x tp 2": (dict(dp_replicate=2, dp_shard=2, cp=2, tp=2), 16, 4, 4),
    "ep carved from dp_shard": (dict(dp_shard=4, ep=2), 4, 4, 1),
}


@pytest.mark.parametrize("name", SPLITS)
def test_batch_split(name):
    sizes, world_size, dp_size, ranks_per_dp = SPLITS[name]
    dims = ParallelDims.from_config(section(**sizes), world_size=world_size)
    splits = [dims.batch_split(rank) for rank in range(world_size)]
    assert {(s.dp_size, s.ranks_per_dp, s.world_size) for s in splits} == {(dp_size, ranks_per_dp, world_size)}
    # Every row set is read by exactly ranks_per_dp ranks, consecutive ones (the inner axes).
    assert [s.dp_rank for s in splits] == [rank // ranks_per_dp for rank in range(world_size)]


def test_batch_split_of_dp_2_x_tp_2():
    dims = ParallelDims.from_config(section(tp=2), world_size=4)
    assert dims.batch_split(3) == BatchSplit(dp_size=2, dp_rank=1, ranks_per_dp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        dims.batch_split(4)


def test_replica_groups_split_the_batch_group_major():
    """fault_tolerance: each group one process (the trainer's case), or a job of its own split."""
    one = ParallelDims.from_config(section(), world_size=1).batch_split()
    assert one.across_groups(group=2, groups=3) == BatchSplit(dp_size=3, dp_rank=2, ranks_per_dp=1)
    split = ParallelDims.from_config(section(tp=2), world_size=4).batch_split(3)
    assert split.across_groups(group=1, groups=2) == BatchSplit(dp_size=4, dp_rank=3, ranks_per_dp=2)
    with pytest.raises(ValueError, match=r"replica_id = 2 must be in \[0, 2\)"):
        one.across_groups(group=2, groups=2)


def test_the_data_parallel_axes_are_the_outermost():
    """batch_split reads the row set off the global rank: true only while the data-parallel axes lead the mesh."""
    assert MESH_AXES[:len(DP_AXES)] == DP_AXES


@pytest.mark.parametrize("name", ["dp 2 x tp 2", "dp 2 x cp 2", "hybrid 2x2", "hybrid 2x2 x cp 2 x tp 2"])
def test_batch_split_agrees_with_the_built_mesh(name):
    """What the trainer's mesh says of each rank (dp_rank_and_size) is what batch_split says."""
    sizes, world_size, _, _ = SPLITS[name]
    dims = ParallelDims.from_config(section(**sizes), world_size=world_size)
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            dp_rank, dp_size = dp_rank_and_size(dims.build_mesh("cpu"))
        finally:
            dist.destroy_process_group()
        split = dims.batch_split(rank)
        assert (dp_rank, dp_size) == (split.dp_rank, split.dp_size), rank
