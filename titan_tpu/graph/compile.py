"""Run a captured training step: compile its graph and implement the trainer's step contract.

`compile_step(captured, backend)` hands the traced aten graph to a compiler backend:

* "eager": run the FX graph as it is (no compiler; for debugging);
* "aot_eager": AOTAutograd (functionalisation, decompositions) without code generation;
* "inductor": AOTAutograd + Inductor code generation (C++/OpenMP on CPU, Triton on CUDA).

The backend is called directly on the GraphModule (as Dynamo would after tracing), not through
`torch.compile`: the graph is already a flat aten graph, so Dynamo has nothing left to find.

`GraphStep` is a drop-in replacement for `EagerStep`: it holds the model's parameters and the
`AdamW` holder's state tensors, feeds their local shards to the compiled graph and copies the
results back into the same tensors, so checkpoints and the rest of the trainer see no difference.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_tpu.graph.capture import CapturedStep, capture_train_step
from titan_tpu.graph.passes import compile_submodules, split_graph
from titan_tpu.train.optim import AdamW
from titan_tpu.train.trainer import StepResult, cross_entropy_sum

__all__ = ["BACKENDS", "GraphStep", "compile_step"]

BACKENDS = ("eager", "aot_eager", "inductor")


def compile_step(captured: CapturedStep, backend: str, *, split: str = "none") -> Callable[..., list[Tensor]]:
    """A callable taking the flat inputs of `captured` (as plain tensors) and returning its flat
    outputs. Compilation happens here, not at the first call; its time is in `.compile_seconds`.
    split: "none" | "fwd_bwd" | "collectives" (see graph/passes.py): compile several smaller
    programs instead of one."""
    if backend not in BACKENDS:
        raise ValueError(f"graph compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    start = time.perf_counter()
    gm = split_graph(captured.graph_module, split, loss_output_index=captured.output_slices()["loss"].start)
    if backend == "eager":
        compiled = gm
    else:
        from torch._dynamo import lookup_backend

        # The fake example inputs made while tracing carry the shapes, dtypes and strides the
        # compiler specialises on (the graph is static-shaped).
        with torch.no_grad():
            if split == "none":
                compiled = lookup_backend(backend)(gm, list(captured.example_inputs))
            else:
                compiled = compile_submodules(gm, list(captured.example_inputs), lookup_backend(backend))
    seconds = time.perf_counter() - start

    def run(*flat: Tensor) -> list[Tensor]:
        # no_grad: the graph already contains the backward; the inputs must not build a tape.
        with torch.no_grad():
            return list(compiled(*flat))

    run.compile_seconds = seconds
    run.backend = backend
    run.module = gm  # the (possibly split) graph that was compiled
    return run


def _local(t: Tensor) -> Tensor:
    """The tensor holding this rank's values (what the graph reads and what we write back into)."""
    t = t.detach()
    return t.to_local() if isinstance(t, DTensor) else t


class GraphStep:
    """The step contract, `step(micro_batches, lr) -> StepResult`, run by one compiled graph.

    Takes the parameters from `model` and the moments and step count from `optimizer` (the eager
    `AdamW` holder), so it can replace `EagerStep` in a trainer: after each call those same tensors
    hold the new values (written with copy_, so nothing keeps a second copy of the model or the
    optimizer state between steps) and `optimizer.step_count` advanced by one.

    Only grad_accum_steps == 1 for now: one micro-batch per step, of the shape of `example_batch`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, *, max_norm: float,
                 example_batch: tuple[Tensor, Tensor], backend: str = "inductor", dp_size: int | None = None,
                 loss_fn: Callable[[Tensor, Tensor], Tensor] = cross_entropy_sum, split: str = "none"):
        self.model = model
        self.optimizer = optimizer
        self.captured = capture_train_step(model, loss_fn=loss_fn, max_norm=max_norm,
                                           adamw_hparams=optimizer.hparams, decay=optimizer.decay,
                                           example_batch=example_batch, dp_size=dp_size)
        self.compiled = compile_step(self.captured, backend, split=split)
        names = self.captured.param_names
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        if set(names) != set(optimizer.params):
            raise ValueError("GraphStep: the optimizer does not hold exactly the model's parameters")
        self._params = [_local(params[n]) for n in names]
        self._buffers = [_local(buffers[n]) for n in self.captured.buffer_names]
        self._batch_shape = tuple(example_batch[1].shape)

    @property
    def capture_seconds(self) -> float:
        return self.captured.capture_seconds

    @property
    def compile_seconds(self) -> float:
        return self.compiled.compile_seconds

    def _state_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        # Read the optimizer state each call: load_state_dict replaces the dicts' tensors.
        names, state = self.captured.param_names, self.optimizer.state
        return [_local(state["exp_avg"][n]) for n in names], [_local(state["exp_avg_sq"][n]) for n in names]

    def __call__(self, micro_batches: list[tuple[Tensor, Tensor]], lr: float) -> StepResult:
        if len(micro_batches) != 1:
            raise ValueError(f"the graph trainer runs one micro-batch per step for now, got {len(micro_batches)}; "
                             "set training.grad_accum_steps = 1")
        inputs, labels = micro_batches[0]
        if tuple(labels.shape) != self._batch_shape or tuple(inputs.shape) != self._batch_shape:
            raise ValueError(f"the captured step was traced for batches of shape {self._batch_shape}, "
                             f"got {tuple(inputs.shape)}")
        # The graph was traced for contiguous batches; a strided view (e.g. tokens[:, :-1]) is not.
        inputs, labels = inputs.contiguous(), labels.contiguous()
        exp_avg, exp_avg_sq = self._state_tensors()
        step_number = self.optimizer.step_count + 1
        # float64 0-dim tensors: the eager path computes bias corrections and lr in Python floats.
        flat = [*self._params, *exp_avg, *exp_avg_sq, inputs, labels,
                torch.tensor(step_number, dtype=torch.float64), torch.tensor(lr, dtype=torch.float64),
                *self._buffers]
        out = self.compiled(*flat)
        s = self.captured.output_slices()
        with torch.no_grad():
            for dst_group, src in ((self._params, s["params"]), (exp_avg, s["exp_avg"]),
                                   (exp_avg_sq, s["exp_avg_sq"])):
                torch._foreach_copy_(dst_group, out[src])
        self.optimizer.step_count = step_number
        loss, norm = out[s["loss"]][0], out[s["grad_norm"]][0]
        return StepResult(loss=loss.item(), grad_norm=norm.item(), num_tokens=self.captured.num_tokens)
