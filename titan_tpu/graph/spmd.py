"""One device's captured step as one SPMD program: the mesh axes it runs over and the axes of
each process group its collectives name.

A step captured on one rank (graph/capture.py) holds `_c10d_functional` collectives on process
groups, and, when captured as one program for every rank (tracing.py), ``titan_tpu::group_rank``
ops. The JAX lowering (graph/jax_lowering.py) turns each into a `jax.lax` collective or axis
index over mesh axes; `DeviceStep` carries what it needs besides the graph: the mesh axes (our
names and sizes, in mesh order) and, per process group, the axes it spans. Both the trainer's JAX
path (graph/jax_step.py: every rank captures its own) and `titan-tpu compile` (components/program.py:
rank 0's step under a fake process group) build it here, so what is compiled and what runs are
described by one record.

No jax import: the records are plain torch and Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.fx

from titan_tpu.graph.capture import CapturedStep
from titan_tpu.graph.reverse_scan import mark_reverse_scans
from titan_tpu.parallel.expert_parallel import EP_AXES
from titan_tpu.parallel.mesh import ParallelDims

__all__ = ["DeviceStep", "capture_context", "device_step", "mesh_axis_sizes"]


@contextlib.contextmanager
def capture_context(platform: str) -> Iterator[None]:
    """Capture a step for the JAX lowering on `platform` ("tpu" or "cpu"): one program for every
    rank, and on a TPU the TPU's JAX kernels (splash, megablox, tokamax) as ops the lowering
    calls (kernels/jax_traced.py); on a CPU the CPU's kernels, traced as the ATen ops they run."""
    if platform == "tpu":
        from titan_tpu.kernels.jax_traced import traced_for_jax

        with traced_for_jax():
            yield
    else:
        from titan_tpu.tracing import one_program_for_every_rank

        with one_program_for_every_rank():
            yield


@dataclasses.dataclass
class DeviceStep:
    """One device's step: the captured step, its mesh and the mesh axes of its process groups."""

    captured: CapturedStep
    axis_sizes: dict[str, int]  # mesh axis name -> size, in mesh order ({} on one device)
    group_axes: dict[str, tuple[str, ...]]  # process group name -> the mesh axes it spans

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes.values())


def mesh_axis_sizes(mesh, dims: ParallelDims) -> dict[str, int]:
    """The JAX mesh's axes for a torch DeviceMesh (None: one device, {}): the device mesh's, with
    dp_shard split into the expert mesh's (dp_shard / ep, ep) under expert parallelism (its ranks
    are dp_shard's, row-major)."""
    if mesh is None:
        return {}
    sizes = {}
    for name, size in zip(mesh.mesh_dim_names, mesh.shape):
        if name == "dp_shard" and dims.ep > 1:
            sizes.update({EP_AXES[0]: size // dims.ep, EP_AXES[1]: dims.ep})
        else:
            sizes[name] = size
    return sizes


def device_step(captured: CapturedStep, axis_sizes: dict[str, int]) -> DeviceStep:
    """The captured step made ready for the JAX lowering, in place (views as reshapes, the scanned
    backward marked to run in reverse: graph/reverse_scan.py, which graph/compile.py applies to a
    step handed to TorchTPU too), with the axes of its process groups."""
    _views_as_reshapes(captured.graph_module)
    mark_reverse_scans(captured.graph_module)
    groups = _group_axes(captured.graph_module, axis_sizes) if axis_sizes else {}
    return DeviceStep(captured=captured, axis_sizes=dict(axis_sizes), group_axes=groups)


def _group_axes(gm: torch.fx.GraphModule, axis_sizes: dict[str, int]) -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axes it spans, for every group an op of the graph or of its
    subgraphs (scan bodies) names (the collectives, group_rank): the axes along which the group's
    ranks are exactly the ranks of one line (or plane) of the mesh through its first rank, in order
    (global ranks are row-major over the mesh axes, as init_device_mesh lays them out)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    names, sizes = list(axis_sizes), list(axis_sizes.values())
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    by_offsets = {}
    for subset in itertools.product((False, True), repeat=len(names)):
        axes = [i for i, used in enumerate(subset) if used]
        offsets = [sum(c * strides[i] for c, i in zip(coords, axes))
                   for coords in itertools.product(*(range(sizes[i]) for i in axes))]
        by_offsets.setdefault(tuple(offsets), tuple(names[i] for i in axes))
    out = {}
    nodes = [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    for node in nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        where = [i for i, a in enumerate(schema.arguments) if a.name == "group_name"] if schema else []
        if where:
            group = node.args[where[0]] if len(node.args) > where[0] else node.kwargs["group_name"]
            ranks = dist.get_process_group_ranks(_resolve_process_group(group))
            offsets = tuple(r - ranks[0] for r in ranks)  # the same line of axes from any rank of the mesh
            if offsets not in by_offsets:
                raise ValueError(f"process group {group} (ranks {list(ranks)}) is no set of axes of the mesh "
                                 f"{axis_sizes}")
            out[group] = by_offsets[offsets]
    return out


def _views_as_reshapes(gm: torch.fx.GraphModule) -> int:
    """Every aten.view in the graph and its subgraphs (scan bodies) made an aten.reshape, in
    place; returns how many. The JAX lowering re-traces the graph (functionalised, decomposed),
    and there a scan body recomputed for activation checkpointing can receive a layer input with
    other strides than the first trace gave it, which a view refuses; JAX arrays have no strides,
    so a reshape is the same program."""
    count = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
                count += 1
        module.recompile()
    return count
