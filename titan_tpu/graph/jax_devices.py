"""The devices a step is compiled for on the JAX path: a TPU slice's (or several slices') as
libtpu's compile-only client describes them (`tpu_topology`: no TPU needed), ordered slice by slice
(`slice_major`), with the slice each dp_replicate index lies in (`slices_of_replicas`); or N XLA
host devices of this CPU (`cpu_devices`: XLA_FLAGS makes them before JAX starts, titan-tpu
compile sets it).
"""

from __future__ import annotations

__all__ = ["KNOWN_TOPOLOGIES", "cpu_devices", "slice_major", "slices_of_replicas", "tpu_topology"]


KNOWN_TOPOLOGIES = ("v5p:2x2x1", "v5p:2x2x2", "v5p:4x4x4", "v5p:8x16x16", "v5e:2x2", "v6e:4x4", "v6e:16x16",
                    "tpu7x:2x2x1")


def tpu_topology(name: str, slices: int = 1):
    """libtpu's compile-only description of `slices` slices of topology `name` (one slice: no
    num_slices, as before multi-slice)."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            **({"num_slices": slices} if slices > 1 else {}))
    except Exception as e:  # noqa: BLE001 - libtpu raises its own error types
        if "lockfile" in str(e):
            raise ValueError("libtpu is in use by another process on this machine (/tmp/libtpu_lockfile); set "
                             "ALLOW_MULTIPLE_LIBTPU_LOAD=1 (a compile-only client takes no device) or wait") from e
        raise ValueError(f"unknown TPU topology {name!r} ({type(e).__name__}); known ones include "
                         f"{', '.join(KNOWN_TOPOLOGIES)}") from e


def cpu_devices(target: str) -> list:
    """The N XLA host devices of a target "cpu:N" (the program the JAX path runs on a CPU):
    XLA_FLAGS must have made them before JAX started (tools/compile_cmd.py `compile_main` does)."""
    import jax

    count = int(target.split(":", 1)[1])
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise ValueError(f"--topology {target}: JAX has {len(devices)} CPU devices in this process; start it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (titan-tpu compile sets it)")
    return devices[:count]


def slice_major(devices) -> list:
    """The devices of a multi-slice topology slice by slice (each slice's in libtpu's order), so that
    rank r on device r puts the outermost mesh axis, dp_replicate, across the slices and the rest
    inside each (parallel/fabric_terms.py): what MaxText's hybrid mesh does with dcn_data_parallelism.
    One slice's devices (no slice_index) stay as they are."""
    order = {id(d): i for i, d in enumerate(devices)}
    return sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, order[id(d)]))


def slices_of_replicas(step, devices) -> list[int]:
    """The slice each dp_replicate index of the step's JAX mesh lies in (graph/jax_program.py
    jax_mesh over `devices`); a one-line error where one index spans two slices, which would send
    the inner axes' collectives over the data-center network."""
    import numpy as np

    from titan_tpu.graph.jax_program import jax_mesh

    mesh = jax_mesh(step, devices)
    names = list(mesh.axis_names)
    grid = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0)(mesh.devices)
    grid = np.moveaxis(grid, names.index("dp_replicate"), 0) if "dp_replicate" in names else grid[None]
    out = []
    for i, block in enumerate(grid):
        spanned = sorted(map(int, set(block.flat)))
        if len(spanned) != 1:
            raise ValueError(f"dp_replicate index {i} spans slices {spanned}: the mesh must put only dp_replicate "
                             "across slices; set parallelism.dp_replicate to a multiple of parallelism.slices")
        out.append(int(block.flat[0]))
    return out
