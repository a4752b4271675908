"""The step contract run by JAX's runtime: the captured step lowered to one SPMD program
(graph/jax_lowering.py), the program `titan-tpu compile` certifies, executed by XLA on the TPU
chips (or this CPU's XLA) with its collectives inside and the state donated.

One process per device, as torchrun starts them (device.py `_JAX`): torch rank r is JAX process r
and holds device r of the mesh. Each process builds, shards and initialises its part of the model
in torch as every other path does, captures the same step (as one program for every rank, its
ranks read as values: parallel/group_rank.py), lowers it, and hands XLA the same module, whose
fingerprint it logs (graph/fingerprint.py). JAX's distributed runtime then runs the one program
across the processes: each feeds its own shards and rows, and XLA runs the collectives.

Where the state lives: on the device, between steps. The parameters, both Adam moments and the
updated buffers (MoE expert biases) are JAX arrays the program takes donated and returns new; the
model's and the optimizer's torch tensors on the host are written from them only when something
reads them (`state_to_host`: a checkpoint) and read back when something wrote them
(`state_from_host`: a resume). Validation runs a forward program of its own (`evaluate`).

Arrays cross the boundary in the layout of graph/jax_program.py: a global array whose first
dimension holds every device's block end to end, of which this process holds its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding, PartitionSpec
from torch import Tensor

from titan_tpu.data.batch import Batch, TokenBatch, as_batch, flatten
from titan_tpu.graph.capture import CapturedStep, capture_eval_step, capture_scoring_step, frozen_inputs
from titan_tpu.graph.jax_lowering import global_shape, jax_dtype
from titan_tpu.graph.jax_program import input_shardings, jax_mesh, lower_step
from titan_tpu.graph.spmd import DeviceStep, capture_context, device_step
from titan_tpu.tensors import local_tensor
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import StepFunction, StepResult

__all__ = ["JaxStep"]

# The state groups the programs carry from step to step on the device (StepLayout's names).
STATE = ("params", "exp_avg", "exp_avg_sq")


class _Program:
    """One captured program lowered and compiled for the mesh: call it with the flat inputs (global
    arrays), get the flat outputs."""

    def __init__(self, step: DeviceStep, mesh, name: str, platform: str, log: Callable[[str], None]):
        self.step, self.name = step, name
        self.shardings = input_shardings(step, mesh)
        lowered = lower_step(step, mesh, name, on_cpu=platform == "cpu")
        self.fingerprint, self.output_ndims = lowered.fingerprint, lowered.output_ndims
        start = time.perf_counter()
        self.compiled = lowered.lowered.compile()
        self.lower_seconds, self.compile_seconds = lowered.lower_seconds, time.perf_counter() - start
        log(f"jax: program {name} fingerprint {self.fingerprint} handed to XLA ({platform}, {mesh.devices.size} "
            f"devices, mesh {dict(mesh.shape)}): lowered in {self.lower_seconds:.1f} s, compiled in "
            f"{self.compile_seconds:.1f} s")

    def __call__(self, flat: list) -> list:
        return list(self.compiled(*flat))


class JaxStep(StepFunction):
    """The step contract (train/step.py) run by JAX (module docstring) over this rank's captured
    programs (graph/spmd.py `DeviceStep`: "step", or "micro-batch" and "update"; captured by the
    run's assembly, components/program.py `capture_programs`, as `titan-tpu compile` captures them).
    Takes the parameters from `model`, the moments and the step count from `optimizer` (the eager
    `AdamW` holder), as `GraphStep` does; keeps their newest values on the device.

    example_batch: what the programs were captured with (each step's micro-batches must match it).
    grad_accum_steps: micro-batches per step. platform: JAX's ("tpu", "cpu"). log: rank 0's log line."""

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, steps: dict[str, DeviceStep], *,
                 example_batch: Batch, grad_accum_steps: int, platform: str, log: Callable[[str], None]):
        self.model, self.optimizer, self.platform, self._log = model, optimizer, platform, log
        first: CapturedStep = next(iter(steps.values())).captured
        if set(first.param_names) != set(optimizer.params):
            raise ValueError("JaxStep: the optimizer does not hold exactly the model's parameters")
        self.grad_accum_steps = grad_accum_steps
        self.axis_sizes = next(iter(steps.values())).axis_sizes
        self.objective, self.captured = first.objective, first
        self.capture_seconds = sum(step.captured.capture_seconds for step in steps.values())
        # Device r of the mesh is JAX process r's, which is torch rank r's (jax_start.py start_jax).
        self.devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.local_device = jax.local_devices()[0]
        self.mesh = jax_mesh(next(iter(steps.values())), self.devices)
        self.programs = {name: _Program(step, self.mesh, name, platform, log) for name, step in steps.items()}
        self._eval: dict[tuple, _Program] = {}  # validation's forward, by the batch's shapes
        self._score: dict[tuple, _Program] = {}  # lm-eval's scoring forward, by the rows' shape
        names = first.param_names
        params = dict(model.named_parameters())
        frozen = frozen_inputs(model, self.objective)
        self._host = {"params": [local_tensor(params[n]) for n in names],
                      "buffers": [local_tensor(frozen[n]) for n in first.buffer_names]}
        self._updated = [first.buffer_names.index(n) for n in first.updated_buffer_names]
        example_batch = as_batch(example_batch)
        self._batch_type, self._batch_shape = type(example_batch), example_batch.shape
        self._device: dict[str, list] | None = None  # the state on the device; None: read it from the host
        self._host_stale = False  # the device holds newer state than the host's tensors

    @property
    def compile_seconds(self) -> float:
        return sum(p.lower_seconds + p.compile_seconds for p in self.programs.values())

    @property
    def fingerprints(self) -> dict[str, str]:
        """Each program's fingerprint, as `titan-tpu compile` prints it for the same config and devices."""
        return {name: p.fingerprint for name, p in self.programs.items()}

    def summary(self) -> str:
        return "\n".join(f"{name}: fingerprint {p.fingerprint}" for name, p in self.programs.items())

    # -- the state ------------------------------------------------------------------------------

    def _host_tensors(self) -> dict[str, list[Tensor]]:
        # The moments are read each time: the optimizer's load_state_dict replaces its tensors.
        names, state = self.captured.param_names, self.optimizer.state
        return {**self._host, "exp_avg": [local_tensor(state["exp_avg"][n]) for n in names],
                "exp_avg_sq": [local_tensor(state["exp_avg_sq"][n]) for n in names]}

    def state_from_host(self) -> None:
        """The host tensors (the model's, the optimizer's) as the device's state."""
        host = self._host_tensors()
        self._device = {group: [self._global(t) for t in host[group]] for group in (*STATE, "buffers")}
        self._host_stale = False

    def state_to_host(self) -> None:
        """The device's newest state written into the host tensors, in place."""
        if not self._host_stale:
            return
        host = self._host_tensors()
        with torch.no_grad():
            for group in STATE:
                for dst, array in zip(host[group], self._device[group]):
                    dst.copy_(_as_torch(self._local_block(array), dst.dtype).view(dst.shape))
            for i in self._updated:
                dst = host["buffers"][i]
                dst.copy_(_as_torch(self._local_block(self._device["buffers"][i]), dst.dtype).view(dst.shape))
        self._host_stale = False

    def _global(self, local: Tensor | np.ndarray):
        """The global array (graph/jax_program.py layout) of which `local` is this process's block,
        in the dtype JAX holds it in (int64 narrows to int32 unless JAX's x64 is on)."""
        if isinstance(local, Tensor):
            value = _as_numpy(local).astype(jax_dtype(local.dtype), copy=False)
        else:
            value = local
        shape = tuple(value.shape)
        axes = tuple(self.mesh.axis_names)
        sharding = NamedSharding(self.mesh, PartitionSpec(axes) if shape else PartitionSpec(*axes))
        block = value if shape else value.reshape((1,) * len(axes))  # a scalar: one element per device
        return jax.make_array_from_single_device_arrays(global_shape(self.mesh, shape), sharding,
                                                        [jax.device_put(block, self.local_device)])

    @staticmethod
    def _local_block(array) -> np.ndarray:
        return np.asarray(array.addressable_shards[0].data)

    def _scalar(self, array) -> float:
        return float(self._local_block(array).reshape(()))

    # -- a step ---------------------------------------------------------------------------------

    def _check_batch(self, batch: Batch | tuple[Tensor, ...]) -> list[Tensor]:
        batch = as_batch(batch)
        if type(batch) is not self._batch_type or batch.shape != self._batch_shape:
            raise ValueError(f"the captured step was traced for a {self._batch_type.__name__} of shape "
                             f"{self._batch_shape}, got a {type(batch).__name__} of shape {batch.shape}")
        return flatten(batch)[0]

    def __call__(self, micro_batches: list[Batch | tuple[Tensor, ...]], lr: float) -> StepResult:
        if len(micro_batches) != self.grad_accum_steps:
            raise ValueError(f"the JAX step was captured for {self.grad_accum_steps} micro-batches per step "
                             f"(training.grad_accum_steps), got {len(micro_batches)}")
        if self._device is None:
            self.state_from_host()
        batches = [[self._global(t) for t in self._check_batch(b)] for b in micro_batches]
        typed = [as_batch(b) for b in micro_batches]
        num_tokens = self.objective.step_count(typed, self.captured.dp_size)
        count = self._global(np.asarray(num_tokens, dtype=np.int32))
        step_number = self.optimizer.step_count + 1
        step_t, lr_t = (self._global(np.asarray(v, dtype=np.float32)) for v in (step_number, lr))
        state = self._device
        if "step" in self.programs:
            program = self.programs["step"]
            layout = program.step.captured.layout
            flat = layout.flatten_inputs(params=state["params"], exp_avg=state["exp_avg"],
                                         exp_avg_sq=state["exp_avg_sq"], batch=batches[0], num_tokens=[count],
                                         step=[step_t], lr=[lr_t], buffers=state["buffers"])
            out = layout.unflatten_outputs(program(flat))
        else:
            out = self._accumulate_and_update(batches, count, step_t, lr_t)
        buffers = list(state["buffers"])
        for i, value in zip(self._updated, out["buffers"]):
            buffers[i] = value
        self._device = {"params": out["params"], "exp_avg": out["exp_avg"], "exp_avg_sq": out["exp_avg_sq"],
                        "buffers": buffers}
        self._host_stale = True
        self.optimizer.step_count = step_number
        totals = torch.from_numpy(self._local_block(out["totals"][0]).astype(np.float32))
        report = self.objective.report(totals)  # the expert biases moved on the device (read back at a save)
        values = dict(report.values)
        return StepResult(loss=values.pop("loss"), grad_norm=self._scalar(out["grad_norm"][0]),
                          num_tokens=self.objective.step_tokens(typed, num_tokens, self.captured.dp_size),
                          terms=values, expert_load=report.expert_load)

    def _accumulate_and_update(self, batches: list[list], count, step_t, lr_t) -> dict[str, list]:
        """The update program's output groups after the micro-batch program ran on every batch."""
        micro, update = self.programs["micro-batch"], self.programs["update"]
        state = self._device
        # The first micro-batch adds to zeros (exact); each later one to the sums the previous returned.
        grads = [self._global(np.zeros(tuple(t.shape), dtype=jax_dtype(t.dtype)))
                 for t in self._host["params"]]
        totals = None
        for batch in batches:
            layout = micro.step.captured.layout
            flat = layout.flatten_inputs(params=state["params"], grads=grads, batch=batch, num_tokens=[count],
                                         buffers=state["buffers"])
            out = layout.unflatten_outputs(micro(flat))
            grads = out["grads"]
            # One short vector per micro-batch, summed in EagerStep's order (on the device).
            totals = out["totals"][0] if totals is None else totals + out["totals"][0]
        layout = update.step.captured.layout
        flat = layout.flatten_inputs(params=state["params"], grads=grads, exp_avg=state["exp_avg"],
                                     exp_avg_sq=state["exp_avg_sq"], totals=[totals], step=[step_t], lr=[lr_t],
                                     buffers=state["buffers"])
        return layout.unflatten_outputs(update(flat))

    # -- validation -----------------------------------------------------------------------------

    def evaluate(self, batch: Batch | tuple[Tensor, ...]) -> Tensor:
        """One validation batch's totals (the summed loss first), by a forward program of its own,
        captured and compiled at the first batch of each shape."""
        batch = as_batch(batch)
        (totals,) = self._forward(self._eval, "eval", capture_eval_step, batch)["totals"]
        return torch.from_numpy(self._local_block(totals).astype(np.float32))

    # -- lm-eval's scoring -------------------------------------------------------------------------

    def score(self, tokens_BS: Tensor, labels_BS: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's rows scored by a forward program of its own on the device's state (captured
        and compiled at the first rows of each shape; every rank calls it with rows of one shape):
        each position's log-probability of its label and whether the label is the most likely
        token (graph/capture.py capture_scoring_step), [B, S] each, on the host."""
        rows = TokenBatch(tokens_BS.cpu(), labels_BS.cpu())
        logp, greedy = self._forward(self._score, "score", capture_scoring_step, rows)["scores"]
        return (torch.from_numpy(self._local_block(logp).astype(np.float32)),
                torch.from_numpy(self._local_block(greedy).astype(np.float32)))

    def _forward(self, programs: dict[tuple, _Program], name: str, capture, batch: Batch) -> dict[str, list]:
        """A forward-only program's outputs on `batch` and the device's state: `capture` (a
        graph/capture.py forward capture) traced, lowered and compiled at the first batch of each
        shape, kept in `programs`."""
        if self._device is None:
            self.state_from_host()
        tensors, _ = flatten(batch)
        key = (type(batch).__name__, *(tuple(t.shape) for t in tensors))
        if key not in programs:
            with capture_context(self.platform):
                captured = capture(self.model, example_batch=batch, objective=self.objective)
            programs[key] = _Program(device_step(captured, self.axis_sizes), self.mesh, name, self.platform,
                                     self._log)
        layout = programs[key].step.captured.layout
        flat = layout.flatten_inputs(params=self._device["params"], batch=[self._global(t) for t in tensors],
                                     buffers=self._device["buffers"])
        return layout.unflatten_outputs(programs[key](flat))


def _as_numpy(t: Tensor) -> np.ndarray:
    """A host tensor's values as numpy, bfloat16 included (numpy has no bfloat16 of its own: JAX's)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jax.numpy.bfloat16)
    return t.numpy()


def _as_torch(value: np.ndarray, dtype: torch.dtype) -> Tensor:
    """A numpy block as a torch tensor of `dtype` (JAX's bfloat16 included; int32 widened as torch holds it)."""
    if value.dtype == jax.numpy.bfloat16:
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(np.array(value)).to(dtype)
