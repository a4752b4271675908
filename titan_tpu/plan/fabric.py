"""The fabric each collective of a plan crosses, and the rate the planner times it at.

The domains come from the hardware: a GPU node is `devices_per_node` GPUs on one NVLink switch; a
TPU run's `parallelism.slices` slices split its chips evenly (MaxText's num_slices), ICI inside
each, DCN between them; this CPU is one machine. Which axis leaves its domain, and the ring's rate
when it does, is the mesh's answer (parallel/fabric_terms.py); the rates are the hardware table's
(plan/hardware.py: `interconnect_bandwidth` inside, `network_bandwidth` across, each with its
source).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_tpu.parallel.axes import EP_AXIS, EP_OUTER_AXIS
from titan_tpu.parallel.fabric_terms import axis_strides, ring_bandwidth
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.plan.hardware import Hardware

__all__ = ["AxisRate", "axis_rates", "domain_devices", "fabric_names"]


@dataclass(frozen=True)
class AxisRate:
    bandwidth: float  # bytes/s each rank sends into a ring over the axis
    fabric: str  # what it crosses: "NVLink", "InfiniBand", "ICI", "DCN" or "gloo"
    source: str  # where the hardware table's figure for that fabric is stated

    def as_dict(self) -> dict:
        return asdict(self)


def fabric_names(hardware: Hardware) -> tuple[str, str]:
    """(inside a domain, between domains) as the vendors name them."""
    if hardware.name == "cpu":
        return "gloo", "gloo"
    return ("NVLink", "InfiniBand") if hardware.devices_per_node else ("ICI", "DCN")


def domain_devices(hardware: Hardware, *, devices: int, slices: int) -> int | None:
    """Devices of one node (GPUs) or one slice (TPUs: the run's devices over `slices`); None on
    this CPU (one machine). A one-line error for slices where there are none (GPU nodes are counted
    from the GPUs, this CPU is one machine) or that do not split the devices evenly."""
    if slices > 1 and (hardware.devices_per_node or hardware.name == "cpu"):
        raise ValueError(f"parallelism.slices = {slices} names TPU slices; on {hardware.name} set it to 1 (GPU nodes "
                         f"are {hardware.devices_per_node or 'all'} devices each, counted from the devices)")
    if devices % slices:
        raise ValueError(f"parallelism.slices = {slices} does not divide the {devices} devices; use a divisor")
    if hardware.name == "cpu":
        return None
    return hardware.devices_per_node or devices // slices


def axis_rates(hardware: Hardware, layout: Layout, *, slices: int = 1) -> dict[str, AxisRate]:
    """Each mesh axis of `layout` (the expert mesh's too) -> the rate a ring over it runs at and the
    fabric it crosses (module docstring)."""
    domain = domain_devices(hardware, devices=layout.world, slices=slices)
    inside, across = fabric_names(hardware)
    mesh_sizes = layout.mesh_sizes()  # the dense axes, then the expert mesh's carved out of dp_shard
    sizes = {**mesh_sizes, EP_AXIS: layout.ep, EP_OUTER_AXIS: layout.dp_shard // layout.ep}
    strides = axis_strides(mesh_sizes, ep=layout.ep)
    out = {}
    for axis, size in sizes.items():
        try:
            bandwidth, crosses = ring_bandwidth(stride=strides[axis], size=size, domain=domain, world=layout.world,
                                                inside=hardware.interconnect_bandwidth,
                                                across=hardware.network_bandwidth)
        except ValueError:
            raise ValueError(f"{axis} ({size}) crosses {'slices' if slices > 1 else 'nodes'} of {hardware.name}, "
                             f"whose {across} bandwidth no vendor page states; plan it within one "
                             f"{'slice' if slices > 1 else 'node'}") from None
        out[axis] = AxisRate(bandwidth, across if crosses else inside,
                             hardware.network_source if crosses else hardware.source)
    return out
