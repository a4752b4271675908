"""TPU slice names -> libtpu topology names: a slice as Google writes it (v5p-8: 4 chips), a chip
count of a generation, or the slice a recipe names (`recipe_topology`), as the topology name
libtpu's compile-only client takes (v5p:2x2x1; graph/jax_devices.py `tpu_topology`).
"""

from __future__ import annotations

import math

__all__ = ["recipe_topology", "topology_for", "topology_for_chips"]


def topology_for(hardware: str) -> str:
    """A slice name as Google writes it (v5p-8: 4 chips) -> a topology name (v5p:2x2x1)."""
    from titan_tpu.plan.hardware import resolve_hardware

    hw, chips = resolve_hardware(hardware, measure=False)
    if chips is None:
        raise ValueError(f"--hardware {hardware}: give a TPU slice with its size (e.g. v5p-8), or --topology "
                         "(e.g. v5p:2x2x1)")
    return topology_for_chips(hw.name, chips)


def topology_for_chips(generation: str, chips: int) -> str:
    """The topology of `chips` chips of a TPU generation: spread over 3 torus axes for
    v4/v5p/tpu7x, 2 for v5e/v6e, each axis doubled in turn."""
    generation = {"v7": "tpu7x"}.get(generation, generation)
    if chips & (chips - 1):
        raise ValueError(f"a {generation} slice of {chips} chips: give a chip count that is a power of two, "
                         "or --topology (e.g. v5p:2x2x1)")
    dims = [1, 1, 1] if generation in ("v4", "v5p", "tpu7x") else [1, 1]
    for i in range(int(math.log2(chips))):
        dims[i % len(dims)] *= 2
    # Ascending with the unused axes last, as libtpu names them (v5p:2x2x1, v5p:2x2x4).
    dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]
    return f"{generation}:{'x'.join(str(d) for d in dims)}"


def recipe_topology(cfg) -> str:
    """The slice a TPU recipe's job.description names ("TPU v5p-128: 64 chips"; with
    parallelism.slices, one of them: "TPU 2 x v5p-128: 128 chips" is v5p:4x4x4); v5p:2x2x1 for any
    other recipe (a debug recipe compiled for the smallest v5p slice)."""
    if cfg.training.device != "tpu":
        return "v5p:2x2x1"
    from titan_tpu.plan.setting import default_hardware

    hardware, chips = default_hardware(cfg, measure=False)
    return topology_for_chips(hardware.name, chips // cfg.parallelism.slices)
