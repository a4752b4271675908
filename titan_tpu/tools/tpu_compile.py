"""The captured step of one device as a JAX program over a mesh of devices: run on CPU devices
(the parity tests) or compiled by XLA's TPU compiler for a TPU topology (`titan-tpu compile`).

Imports jax: only .venv-tpu has it (`make tpu-check` builds it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
import torch
from jax.sharding import Mesh

from titan_tpu.graph.jax_lowering import functional_graph, rank_constants, shard_step, to_jax
from titan_tpu.tools.device_step import DeviceStep

__all__ = ["global_inputs", "jax_mesh", "run_on_devices", "sharded_step"]


def jax_mesh(step: DeviceStep, devices: Sequence) -> Mesh:
    """A JAX mesh of the first devices, with the step's axis names and sizes (one axis named
    "device" of size 1 for a one-device step)."""
    sizes = step.axis_sizes or {"device": 1}
    count = math.prod(sizes.values())
    if len(devices) < count:
        raise ValueError(f"the step needs {count} devices, {len(devices)} are available")
    return Mesh(np.asarray(devices[:count]).reshape(tuple(sizes.values())), tuple(sizes))


def sharded_step(step: DeviceStep, mesh: Mesh, ranks: Sequence[DeviceStep] = ()) -> Callable:
    """The step over every device of `mesh` (shard_step: inputs and outputs are the per-device
    values laid end to end, `global_inputs`), not yet jitted. ranks: every rank's DeviceStep (global rank order), whose
    differing constants each device then reads for its own rank (`rank_constants`); without them
    every device runs rank 0's numbers, the same program and cost with other values (what a
    compile for a slice of thousands of chips uses: one capture, not one per chip)."""
    graph = functional_graph(step.captured.graph_module, step.captured.example_inputs)
    per_rank = None
    if len(ranks) > 1:
        per_rank = rank_constants([graph] + [functional_graph(s.captured.graph_module, s.captured.example_inputs)
                                             for s in ranks[1:]])
    on_cpu = mesh.devices.flat[0].platform == "cpu"  # XLA:CPU lacks ragged-all-to-all (jax_lowering.py)
    output = next(node for node in graph.graph.nodes if node.op == "output")
    output_ndims = [len(getattr(v, "meta", {}).get("val", torch.empty(())).shape) for v in output.args[0]]
    fn = shard_step(to_jax(graph, step.group_axes, per_rank, step.axis_sizes, on_cpu=on_cpu), mesh,
                    [x.dim() for x in step.captured.example_inputs], output_ndims)
    fn.output_ndims = output_ndims  # for splitting its outputs back into devices (`run_on_devices`)
    return fn


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
