"""`titan-tpu compile` for several TPU slices (parallelism.slices): libtpu's compile-only client
describes N slices of a topology (`get_topology_desc(..., num_slices=N)`), the devices are ordered
slice by slice so dp_replicate, the outermost mesh axis, is laid across the slices over DCN, and
the report says which slice each dp_replicate index lies in. The planner against XLA on the
multi-slice recipe itself: bench/tpu_compile_table.py and docs/tpu_recipes.md."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import pytest

from titan_tpu.config import build_config
from titan_tpu.graph.jax_devices import slice_major, slices_of_replicas, tpu_topology
from titan_tpu.tools.compile_cmd import compile_step_for_tpu

SLICES = ["--training.batch_size=2", "--training.seq_len=64", "--parallelism.slices=2",
          "--parallelism.dp_replicate=2", "--parallelism.dp_shard=4"]


def test_two_slices_of_v5p_describe_eight_devices_slice_by_slice():
    devices = slice_major(tpu_topology("v5p:2x2x1", 2).devices)
    assert len(devices) == 8 and [d.slice_index for d in devices] == [0] * 4 + [1] * 4
    assert len(tpu_topology("v5p:2x2x1").devices) == 4  # one slice: as before slices


def test_compile_llama_debug_across_two_slices():
    cfg = build_config("configs/llama3_debug.toml", SLICES)
    report = compile_step_for_tpu(cfg, "v5p:2x2x1")
    assert report["devices"] == 8 and report["mesh"] == {"dp_replicate": 2, "dp_shard": 4}
    assert report["slices"] == 2 and report["slice_of_dp_replicate"] == [0, 1]
    assert report["fits"] and report["collectives"]
    conftest.SUMMARY.append(f"compile llama3_debug for 2 x v5p:2x2x1 (mesh {report['mesh']}): "
                            f"{report['compile_seconds']:.1f} s, peak {report['peak_per_chip_bytes'] / 2**20:.1f} "
                            "MiB/chip")


def test_a_replica_spanning_two_slices_is_one_line():
    """Devices interleaved across slices put each dp_replicate index in both: refused, naming the fix."""
    devices = slice_major(tpu_topology("v5p:2x2x1", 2).devices)
    interleaved = [d for pair in zip(devices[:4], devices[4:]) for d in pair]
    step = SimpleNamespace(axis_sizes={"dp_replicate": 2, "dp_shard": 4})
    assert slices_of_replicas(step, devices) == [0, 1]
    with pytest.raises(ValueError, match="dp_replicate index 0 spans slices \\[0, 1\\]"):
        slices_of_replicas(step, interleaved)


def test_slices_on_a_cpu_topology_are_one_line():
    cfg = build_config("configs/llama3_debug.toml", SLICES)
    with pytest.raises(ValueError, match="compiles for TPU slices; --topology cpu:N is one machine") as error:
        compile_step_for_tpu(cfg, "cpu:8")
    assert "\n" not in str(error.value)
