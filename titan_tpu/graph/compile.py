"""Run a captured training step: compile its graph and implement the trainer's step contract.

`compile_step(captured, backend)` hands the traced aten graph to a compiler backend:

* "eager": run the FX graph as it is (no compiler; for debugging);
* "aot_eager": AOTAutograd (functionalisation, decompositions) without code generation;
* "inductor": AOTAutograd + Inductor code generation (C++/OpenMP on CPU, Triton on CUDA);
* "tpu": TorchTPU (XLA) through its own compilers, not its Dynamo backend (graph/torchtpu.py): the
  step as one program with its collectives inside, the parameters and moments donated, and its
  StableHLO fingerprinted (`run.fingerprints`). Written against the torch_tpu 0.2.0 API and never
  run here (no TPU): it is guarded so that anywhere else it fails at once with a one-line error,
  and the step/lr scalars of a step captured for it are float32 (TPUs have no fast float64).

The backend is called directly on the GraphModule (as Dynamo would after tracing), not through
`torch.compile`: the graph is already a flat aten graph, so Dynamo has nothing left to find.

`GraphStep` is a drop-in replacement for `EagerStep`: it holds the model's parameters and the
`AdamW` holder's state tensors, feeds their local shards to the compiled graph and copies the
results back into the same tensors, so checkpoints and the rest of the trainer see no difference.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import Tensor

from titan_tpu.data.batch import Batch, as_batch, flatten
from titan_tpu.device import tpu_compile_error as _tpu_error
from titan_tpu.graph.capture import CapturedStep, capture_accumulating_step, capture_train_step, frozen_inputs
from titan_tpu.graph.passes import compile_submodules, schedule_collectives, split_graph
from titan_tpu.graph.torchtpu import owner, rebind
from titan_tpu.tensors import local_tensor
from titan_tpu.train.objective import Objective
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import StepFunction, StepResult

__all__ = ["BACKENDS", "GraphStep", "compile_step"]

BACKENDS = ("eager", "aot_eager", "inductor", "tpu")



def _torchtpu_compiler(captured: CapturedStep | None) -> Callable:
    """TorchTPU's compile of a captured program (graph/torchtpu.py `compile_for_torchtpu`), after
    checking that it can run: torch_tpu imports, sees a TPU, and the captured step's tensors live
    on it. Raises the one-line ValueError otherwise."""
    from titan_tpu import device
    from titan_tpu.graph.torchtpu import compile_for_torchtpu

    device.import_torch_tpu_with_a_device()  # the one-line error where TorchTPU or a TPU is missing
    if captured is not None:
        devices = {t.device.type for t in captured.example_inputs if t.dim() > 0}  # 0-dim scalars may stay on CPU
        if devices != {"tpu"}:
            raise _tpu_error(f"the captured step's tensors are on {', '.join(sorted(devices))}, not tpu "
                             "(set training.device = tpu)")
    return compile_for_torchtpu


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"graph compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def compile_step(captured: CapturedStep, backend: str, *, split: str = "none",
                 prefetch: int | None = None) -> Callable[..., list[Tensor]]:
    """A callable taking the flat inputs of `captured` (as plain tensors) and returning its flat
    outputs. Compilation happens here, not at the first call; its time is in `.compile_seconds`.
    split: "none" | "fwd_bwd" | "collectives" (see graph/passes.py): compile several smaller
    programs instead of one. prefetch: None leaves the collectives in trace order; an int k
    reorders them (graph/passes.py, schedule_collectives): all-gathers k buckets ahead, gradient
    reduce-scatters waited for only where their values are read. Raises a one-line ValueError for
    "tpu" where TorchTPU or a TPU is missing."""
    _check_backend(backend)
    if backend == "tpu":
        compiler = _torchtpu_compiler(captured)  # before splitting: fail fast, with the clear error
    elif backend != "eager":
        from torch._dynamo import lookup_backend

        compiler = lookup_backend(backend)
    start = time.perf_counter()
    gm = captured.graph_module
    if backend == "tpu":
        from titan_tpu.graph.reverse_scan import mark_reverse_scans

        # TorchTPU runs a scan marked so as a reverse loop: the scanned backward without the
        # flipped copies of its stacks (graph/reverse_scan.py; Inductor has its own pass for it).
        mark_reverse_scans(gm)
    if prefetch is not None:
        gm = schedule_collectives(gm, prefetch=prefetch)
    loss_index = captured.layout.loss_output_index
    if loss_index is None and split == "fwd_bwd":
        split = "none"  # the update program has no forward to cut off
    gm = split_graph(gm, split, loss_output_index=loss_index)
    fingerprints, donated = [], False
    if backend == "eager":
        compiled = gm
    elif backend == "tpu":
        compiled, fingerprints, donated = _compile_for_torchtpu(gm, captured, compiler, split=split)
    else:
        # The fake example inputs made while tracing carry the shapes, dtypes and strides the
        # compiler specialises on (the graph is static-shaped): the call Dynamo itself would make,
        # backend(graph_module, example_inputs).
        example_inputs = _fake_inputs_with_shape_env(captured.example_inputs)
        with torch.no_grad(), _backend_passes(backend):
            if split == "none":
                compiled = compiler(gm, example_inputs)
            else:
                compiled = compile_submodules(gm, example_inputs, compiler)
    seconds = time.perf_counter() - start

    def run(*flat: Tensor) -> list[Tensor]:
        # no_grad: the graph already contains the backward; the inputs must not build a tape.
        with torch.no_grad():
            return list(compiled(*flat))

    run.compile_seconds = seconds
    run.backend = backend
    run.module = gm  # the (possibly split) graph that was compiled
    run.fingerprints = fingerprints  # of each program handed to XLA where the backend shows it (graph/fingerprint.py)
    run.donated = donated  # the inputs of DONATED_GROUPS are gone after a call (graph/torchtpu.py)
    return run


def _compile_for_torchtpu(gm, captured: CapturedStep, compiler, *, split: str) -> tuple:
    """(TorchTPU's executable of `gm`, the fingerprints of the programs it handed XLA, whether it
    donates): one program, its DONATED_GROUPS donated; split into programs (split != "none"),
    nothing donated, as an input donated to one program would be gone for the next."""
    from titan_tpu.graph.fingerprint import program_fingerprint
    from titan_tpu.graph.torchtpu import donated_inputs, program_texts

    example_inputs = _fake_inputs_with_shape_env(captured.example_inputs)
    with torch.no_grad():
        if split != "none":
            compiled = compile_submodules(gm, example_inputs, compiler)
            return compiled, [], False
        donated = donated_inputs(captured.layout)
        compiled = compiler(gm, example_inputs, donated=donated)
    return compiled, [program_fingerprint(text) for text in program_texts(compiled)], bool(donated)


def _backend_passes(backend: str):
    """Our passes inside the backend's own pipeline: for Inductor, `_ScanPasses` (scan bodies'
    matmuls read transposed weights as views; a scanned backward reads its stacks with a
    reversed index instead of flipped copies)."""
    if backend != "inductor":
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(post_grad_custom_post_pass=_scan_passes())


def _scan_passes():
    """Inductor's post-grad custom pass: graph/scan_body_transposes.py, then graph/reverse_scan.py."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    from titan_tpu.graph import reverse_scan, scan_body_transposes

    class _ScanPasses(CustomGraphPass):
        def __call__(self, graph) -> None:
            if scan_body_transposes.drop_transpose_copies(graph.owning_module):
                graph.owning_module.recompile()
            reverse_scan.ReverseScanPass()(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files((reverse_scan.__file__, scan_body_transposes.__file__))

    return _ScanPasses()


def _fake_inputs_with_shape_env(inputs: list[Tensor]) -> list[Tensor]:
    """The example inputs again, as fake tensors of a mode that has a ShapeEnv (static shapes).

    make_fx's fake mode has none, but Inductor's lowering of scan (to a while loop indexed by a
    loop counter read with .item()) needs one to represent that unbacked integer.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    with mode:
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in inputs]


class GraphStep(StepFunction):
    """The step contract, `step(micro_batches, lr) -> StepResult`, run by compiled graphs.

    Takes the parameters from `model` and the moments and step count from `optimizer` (the eager
    `AdamW` holder), so it can replace `EagerStep` in a trainer: after each call those same tensors
    hold the new values (written with copy_, so nothing keeps a second copy of the model or the
    optimizer state between steps) and `optimizer.step_count` advanced by one.

    Each step takes `grad_accum_steps` micro-batches of the kind and shape of `example_batch` (a
    typed batch, data/batch.py, or (inputs, labels[, positions])); the loss is `objective`'s
    (train/objective.py; default next-token). One micro-batch: one program
    for the whole step. Several: a micro-batch program run once per micro-batch, summing the
    gradients, then an update program (graph/capture.py, capture_accumulating_step).

    scalar_dtype: dtype of the step and lr graph inputs; None picks float32 for the tpu backend
    (TPUs have no fast float64 and XLA may reject it) and float64 otherwise, which keeps the graph
    bitwise equal to the eager path's Python-float bias corrections.
    """

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, *, max_norm: float,
                 example_batch: Batch | tuple[Tensor, ...], backend: str = "inductor", dp_size: int | None = None,
                 split: str = "none", scalar_dtype: torch.dtype | None = None, prefetch: int | None = None,
                 grad_accum_steps: int = 1, objective: Objective | None = None):
        _check_backend(backend)
        if backend == "tpu":
            _torchtpu_compiler(None)  # fail before a capture that can take minutes on a large model
        if grad_accum_steps < 1:
            raise ValueError(f"training.grad_accum_steps = {grad_accum_steps} must be >= 1")
        if scalar_dtype is None:
            scalar_dtype = torch.float32 if backend == "tpu" else torch.float64
        self.model = model
        self.optimizer = optimizer
        self.grad_accum_steps = grad_accum_steps
        example_batch = as_batch(example_batch)
        kwargs = dict(max_norm=max_norm, adamw_hparams=optimizer.hparams, decay=optimizer.decay,
                      example_batch=example_batch, dp_size=dp_size, scalar_dtype=scalar_dtype, objective=objective)
        if grad_accum_steps == 1:
            self.captured = capture_train_step(model, **kwargs)
            self.captured_update = None
        else:
            # captured: the micro-batch program (the forward and backward, its collectives)
            self.captured, self.captured_update = capture_accumulating_step(
                model, grad_accum_steps=grad_accum_steps, **kwargs)
        self.compiled = compile_step(self.captured, backend, split=split, prefetch=prefetch)
        self.compiled_update = (None if self.captured_update is None else
                                compile_step(self.captured_update, backend, split=split))
        # A program that donates the parameters and moments (TorchTPU's, graph/torchtpu.py) leaves
        # their old buffers gone: it takes, and after each call re-points, the very tensors the
        # model and the optimizer hold, not detached aliases of them.
        self._donates = (self.compiled_update or self.compiled).donated
        self._held = owner if self._donates else local_tensor
        self.objective = self.captured.objective
        names = self.captured.param_names
        params = dict(model.named_parameters())
        # Frozen tensors (LoRA's base weights, a reference model) are graph inputs beside the buffers (capture.py).
        buffers = frozen_inputs(model, self.objective)
        if set(names) != set(optimizer.params):
            raise ValueError("GraphStep: the optimizer does not hold exactly the model's parameters")
        self._params = [self._held(params[n]) for n in names]
        self._buffers = [local_tensor(buffers[n]) for n in self.captured.buffer_names]
        self._updated_buffers = [local_tensor(buffers[n]) for n in self.captured.updated_buffer_names]
        self._batch_type, self._batch_shape = type(example_batch), example_batch.shape

    @property
    def capture_seconds(self) -> float:
        update = self.captured_update.capture_seconds if self.captured_update is not None else 0.0
        return self.captured.capture_seconds + update

    @property
    def compile_seconds(self) -> float:
        update = self.compiled_update.compile_seconds if self.compiled_update is not None else 0.0
        return self.compiled.compile_seconds + update

    def collectives_per_step(self) -> Counter:
        """Collective ops one step runs: the micro-batch program's once per micro-batch, plus the
        update program's."""
        counts = Counter()
        for op, n in self.captured.collective_counts().items():
            counts[op] += n * self.grad_accum_steps
        if self.captured_update is not None:
            counts.update(self.captured_update.collective_counts())
        return counts

    def fingerprints(self) -> dict[str, str]:
        """The fingerprint of each program handed to XLA (graph/fingerprint.py), where the backend
        shows its programs (TorchTPU): {"step": ...} or {"micro-batch": ..., "update": ...}, a
        program split in several numbered (".1", ...); empty for the other backends."""
        compiled = {"step": self.compiled} if self.compiled_update is None else \
            {"micro-batch": self.compiled, "update": self.compiled_update}
        return {name if len(run.fingerprints) == 1 else f"{name}.{k}": fingerprint
                for name, run in compiled.items() for k, fingerprint in enumerate(run.fingerprints)}

    def summary(self) -> str:
        text = self.captured.summary()
        if self.captured_update is not None:
            text += f"\n(run {self.grad_accum_steps} times per step, then)\n" + self.captured_update.summary()
        return text

    def _state_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        # Read the optimizer state each call: load_state_dict replaces the dicts' tensors.
        names, state = self.captured.param_names, self.optimizer.state
        return [self._held(state["exp_avg"][n]) for n in names], [self._held(state["exp_avg_sq"][n]) for n in names]

    def _check_batch(self, batch: Batch | tuple[Tensor, ...]) -> list[Tensor]:
        """The batch's tensors as the graph takes them, or a one-line error for a batch of another kind or shape."""
        batch = as_batch(batch)
        tensors, _ = flatten(batch)
        expected = self.captured.layout.batch
        if type(batch) is not self._batch_type or len(tensors) != expected:
            raise ValueError(f"the captured step was traced for a {self._batch_type.__name__} of {expected} tensors "
                             f"(positions {'with' if expected == 3 else 'without'}), got a {type(batch).__name__} of "
                             f"{len(tensors)}")
        if batch.shape != self._batch_shape:
            raise ValueError(f"the captured step was traced for batches of shape {self._batch_shape}, "
                             f"got {batch.shape}")
        # The graph was traced for contiguous batches; a strided view (e.g. tokens[:, :-1]) is not.
        return [t.contiguous() for t in tensors]

    def __call__(self, micro_batches: list[Batch | tuple[Tensor, ...]], lr: float) -> StepResult:
        if len(micro_batches) != self.grad_accum_steps:
            raise ValueError(f"the graph step was captured for {self.grad_accum_steps} micro-batches per step "
                             f"(training.grad_accum_steps), got {len(micro_batches)}")
        batches = [self._check_batch(b) for b in micro_batches]
        # The objective's denominator, as EagerStep counts it (next-token: labels not IGNORE_INDEX
        # on all ranks): a graph input, so chat data's varying count needs no new graph.
        typed = [as_batch(b) for b in micro_batches]
        num_tokens = self.objective.step_count(typed, self.captured.dp_size)
        count = torch.tensor(num_tokens, dtype=torch.int32)
        exp_avg, exp_avg_sq = self._state_tensors()
        step_number = self.optimizer.step_count + 1
        # 0-dim tensors of the captured scalar dtype: float64 by default, as the eager path computes
        # bias corrections and lr in Python floats; float32 on TPU.
        scalar = self.captured.scalar_dtype
        step_t, lr_t = torch.tensor(step_number, dtype=scalar), torch.tensor(lr, dtype=scalar)
        if self.captured_update is None:
            layout = self.captured.layout
            flat = layout.flatten_inputs(params=self._params, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                         batch=batches[0], num_tokens=[count], step=[step_t], lr=[lr_t],
                                         buffers=self._buffers)
            out = layout.unflatten_outputs(self.compiled(*flat))
        else:
            out = self._accumulate_and_update(batches, count, exp_avg, exp_avg_sq, step_t, lr_t)
        with torch.no_grad():
            for dst_group, group in ((self._params, "params"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq"),
                                     (self._updated_buffers, "buffers")):
                if dst_group and self._donates and group != "buffers":
                    rebind(dst_group, out[group])  # donated: no old buffer to copy into
                elif dst_group:
                    torch._foreach_copy_(dst_group, out[group])
        self.optimizer.step_count = step_number
        (norm,), (totals,) = out["grad_norm"], out["totals"]
        report = self.objective.report(totals)
        values = dict(report.values)
        return StepResult(loss=values.pop("loss"), grad_norm=norm.item(),
                          num_tokens=self.objective.step_tokens(typed, num_tokens, self.captured.dp_size),
                          terms=values,
                          expert_load=report.expert_load)

    def _accumulate_and_update(self, batches: list[list[Tensor]], count: Tensor, exp_avg: list[Tensor],
                               exp_avg_sq: list[Tensor], step_t: Tensor, lr_t: Tensor) -> dict[str, list[Tensor]]:
        """The output groups of the update program after the micro-batch program ran on every batch."""
        micro, update = self.captured.layout, self.captured_update.layout
        # The first micro-batch adds to zeros (exact); each later one to the sums the previous returned.
        grads = [torch.zeros_like(p) for p in self._params]
        totals = None
        for batch in batches:
            flat = micro.flatten_inputs(params=self._params, grads=grads, batch=batch, num_tokens=[count],
                                        buffers=self._buffers)
            out = micro.unflatten_outputs(self.compiled(*flat))
            grads = out["grads"]
            # The loss, balancing loss and loads: one short vector per micro-batch, summed here in
            # EagerStep's order.
            totals = out["totals"][0] if totals is None else totals + out["totals"][0]
        flat = update.flatten_inputs(params=self._params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                                     totals=[totals], step=[step_t], lr=[lr_t], buffers=self._buffers)
        return update.unflatten_outputs(self.compiled_update(*flat))
