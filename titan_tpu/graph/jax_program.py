"""The captured step of one device as a JAX program over a mesh of devices, lowered and compiled
the one way both its users need it: the trainer's JAX path (graph/jax_step.py, XLA's TPU or CPU
client running it) and `titan-tpu compile` (libtpu's compile-only client for a TPU topology).

What both share, so that the program a compile certifies is the program a run hands XLA:
- the step captured for a JAX platform (graph/spmd.py `capture_context`): one program for every
  rank (its ranks as values, parallel/group_rank.py) and, for a TPU, the TPU's JAX kernels as
  traceable ops (kernels/jax_traced.py);
- `lower_step(step, mesh, program)`: the jitted, donated SPMD function lowered for the mesh's
  devices, and its fingerprint (graph/fingerprint.py).

Every input and output is laid out as `shard_step` (graph/jax_lowering.py) takes it: each
device's values end to end along the first dimension, a scalar stacked over the mesh.

Imports jax: used only by the JAX path and `titan-tpu compile` (an environment with jax).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from titan_tpu.graph.fingerprint import program_fingerprint
from titan_tpu.graph.jax_lowering import functional_graph, global_shape, jax_dtype, rank_constants, shard_step, to_jax
from titan_tpu.graph.spmd import DeviceStep

__all__ = ["DONATED", "LoweredStep", "check_equal_blocks", "donated_arguments", "global_inputs",
           "input_shardings", "jax_mesh", "lower_step", "run_on_devices", "sharded_step"]

# The input groups each program updates in place (the trainer's step writes them back): donated,
# so XLA aliases each with its updated output and the peak counts them once. graph/capture.py
# StepLayout names the groups and the programs; "eval" is the forward-only validation program.
DONATED = {"step": ("params", "exp_avg", "exp_avg_sq"), "micro-batch": ("grads",),
           "update": ("params", "grads", "exp_avg", "exp_avg_sq"), "eval": (), "score": ()}


def jax_mesh(step: DeviceStep, devices: Sequence) -> Mesh:
    """A JAX mesh of the first devices, with the step's axis names and sizes (one axis named
    "device" of size 1 for a one-device step). Device i of `devices` holds global rank i."""
    sizes = step.axis_sizes or {"device": 1}
    count = math.prod(sizes.values())
    if len(devices) < count:
        raise ValueError(f"the step needs {count} devices, {len(devices)} are available")
    return Mesh(np.asarray(devices[:count]).reshape(tuple(sizes.values())), tuple(sizes))


def sharded_step(step: DeviceStep, mesh: Mesh, ranks: Sequence[DeviceStep] = (), *, on_cpu: bool | None = None
                 ) -> Callable:
    """The step over every device of `mesh` (shard_step: inputs and outputs are the per-device
    values laid end to end, `global_inputs`), not yet jitted. ranks: every rank's DeviceStep (global
    rank order), whose differing constants each device then reads for its own rank (`rank_constants`);
    without them every device runs rank 0's numbers, the same program and cost with other values
    (what a compile for a slice of thousands of chips uses: one capture, not one per chip). on_cpu:
    the program runs on XLA:CPU (ragged-all-to-all emulated); default: whether the mesh's devices are CPUs."""
    check_equal_blocks(step)
    graph = functional_graph(step.captured.graph_module, step.captured.example_inputs)
    per_rank = None
    if len(ranks) > 1:
        per_rank = rank_constants([graph] + [functional_graph(s.captured.graph_module, s.captured.example_inputs)
                                             for s in ranks[1:]])
    if on_cpu is None:
        on_cpu = mesh.devices.flat[0].platform == "cpu"  # XLA:CPU lacks ragged-all-to-all (jax_lowering.py)
    output = next(node for node in graph.graph.nodes if node.op == "output")
    output_ndims = [len(getattr(v, "meta", {}).get("val", torch.empty(())).shape) for v in output.args[0]]
    fn = shard_step(to_jax(graph, step.group_axes, per_rank, step.axis_sizes, on_cpu=on_cpu), mesh,
                    [x.dim() for x in step.captured.example_inputs], output_ndims)
    fn.output_ndims = output_ndims  # for splitting its outputs back into devices (`run_on_devices`)
    return fn


def check_equal_blocks(step: DeviceStep) -> None:
    """One-line ValueError for a parameter some mesh axis splits unevenly: the program is one for
    every device, fed the devices' blocks end to end, so every device's block must have one shape.
    SimpleFSDP places each parameter on a dim its data-parallel axis divides (simple_fsdp.py
    `_even_blocks`) and tp, pp and ep check theirs: this names what slipped past them."""
    for name, spec in step.captured.dtensor_specs.items():
        for axis, placement in enumerate(spec.placements):
            size = spec.mesh.size(axis)
            if placement.is_shard() and spec.shape[placement.dim] % size:
                raise ValueError(f"parameter {name} {list(spec.shape)} is split unevenly over mesh axis "
                                 f"{spec.mesh.mesh_dim_names[axis]} ({size} ranks) on dim {placement.dim}, and the "
                                 "JAX path's one program takes an equal block from every device; choose a mesh "
                                 "size that divides it or run --compile.backend inductor")


def input_shardings(step: DeviceStep, mesh: Mesh) -> list[NamedSharding]:
    """Each flat input's sharding as `shard_step` takes it: a value of one or more dimensions split
    along its first over every mesh axis, a scalar one element per device."""
    axes = tuple(mesh.axis_names)
    return [NamedSharding(mesh, PartitionSpec(axes) if x.dim() else PartitionSpec(*axes))
            for x in step.captured.example_inputs]


def abstract_inputs(step: DeviceStep, mesh: Mesh) -> list[jax.ShapeDtypeStruct]:
    """The flat inputs as shapes, dtypes and shardings: what a compile lowers the program for."""
    return [jax.ShapeDtypeStruct(global_shape(mesh, tuple(x.shape)), jax_dtype(x.dtype), sharding=sharding)
            for x, sharding in zip(step.captured.example_inputs, input_shardings(step, mesh))]


def donated_arguments(step: DeviceStep, program: str) -> tuple[int, ...]:
    """The flat input positions `program` ("step", "micro-batch", "update", "eval") donates."""
    slices = step.captured.input_slices()
    return tuple(i for group in DONATED[program] for i in range(step.captured.num_inputs)[slices[group]])


@dataclasses.dataclass
class LoweredStep:
    """A step's program lowered for a mesh's devices: what XLA is handed, and its fingerprint."""

    lowered: object  # jax.stages.Lowered
    text: str  # the StableHLO module
    fingerprint: str  # graph/fingerprint.py
    output_ndims: list[int]
    lower_seconds: float


def lower_step(step: DeviceStep, mesh: Mesh, program: str, *, on_cpu: bool | None = None) -> LoweredStep:
    """The step jitted over `mesh` with `program`'s inputs donated (`DONATED`), lowered for the
    mesh's devices: the one call the trainer's JAX path and `titan-tpu compile` share."""
    import time

    start = time.perf_counter()
    fn = sharded_step(step, mesh, on_cpu=on_cpu)
    lowered = jax.jit(fn, donate_argnums=donated_arguments(step, program)).lower(*abstract_inputs(step, mesh))
    text = lowered.as_text()
    return LoweredStep(lowered=lowered, text=text, fingerprint=program_fingerprint(text),
                       output_ndims=fn.output_ndims, lower_seconds=time.perf_counter() - start)


def global_inputs(mesh: Mesh, per_device_inputs: list[list]) -> list[np.ndarray]:
    """Each input's per-device values (per_device_inputs[d]: device d's flat inputs, mesh order,
    row-major) laid end to end as `shard_step` takes them."""
    return [np.concatenate(values) if np.ndim(values[0]) else np.reshape(values, mesh.devices.shape)
            for values in ([np.asarray(inputs[i]) for inputs in per_device_inputs]
                           for i in range(len(per_device_inputs[0])))]


def run_on_devices(ranks: Sequence[DeviceStep], per_device_inputs: list[list], devices: Sequence
                   ) -> list[list[np.ndarray]]:
    """Run the step on `devices` (e.g. jax.devices("cpu")): ranks[r] is rank r's captured step
    (all ranks, or rank 0's alone when its graph has no rank-dependent numbers);
    per_device_inputs[d] is device d's flat input list (mesh order, row-major); returns each
    device's flat outputs."""
    step = ranks[0]
    mesh = jax_mesh(step, devices)
    fn = sharded_step(step, mesh, ranks)
    outputs = jax.jit(fn)(*global_inputs(mesh, per_device_inputs))
    count = len(per_device_inputs)
    # a value of one or more dimensions: the devices' blocks end to end; a scalar: stacked
    return [[np.split(np.asarray(y), count)[d] if ndim else np.asarray(y).reshape(count)[d]
             for y, ndim in zip(outputs, fn.output_ndims)] for d in range(count)]
