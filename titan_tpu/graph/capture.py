"""Capture one whole training step (forward, loss, backward, clipping, AdamW) as one FX graph.

The step is written once as a pure function of plain tensors::

    (params, exp_avg, exp_avg_sq, batch, count, step, lr, buffers)
        -> (new_params, new_exp_avg, new_exp_avg_sq, loss, grad_norm, totals, new expert biases)

and traced with ``make_fx(tracing_mode="fake")``, which records the aten ops that autograd, the
pure optimizer functions and DTensor dispatch run. Nothing is executed for real while tracing.
The loss is the run's objective (train/objective.py), the same code the eager step runs; the batch
enters as the flat list of its tensors (a typed batch is a pytree, data/batch.py).

With gradient accumulation (`capture_accumulating_step`) the same pieces are traced as two
programs: the forward and backward of one micro-batch, which adds its gradients to the sums it is
given and runs once per micro-batch, and the update (clipping, AdamW), once per step.

Why plain local tensors at the boundary: make_fx refuses real DTensors passed in or closed over.
So the graph takes each parameter's *local shard* and rebuilds the DTensor inside with
``DTensor.from_local(..., run_check=False)``. Reading a SimpleFSDP parameter then all-gathers it,
and its backward reduce-scatters the gradient: both become ``_c10d_functional`` nodes of the graph,
where a compiler can see (and later bucket or reorder) them.

Optimizer state and ``step``/``lr`` are graph inputs too, so one graph serves every step.

The graph is static: tracing runs in a fake-tensor mode *without* a ShapeEnv, so reading a tensor's
value in Python (``.item()``, ``if x.sum() > 0``) or an op whose output shape depends on the data
(``torch.nonzero``) fails at the op that does it, instead of becoming an unbacked symbol that
breaks far away or a graph with dynamic shapes that XLA cannot compile. Such failures (and ops
with no fake-tensor kernel) are raised as a one-line `CaptureError` naming the op and the module
whose forward was running (graph/capture_errors.py). The flat inputs and outputs of each program
are laid out by graph/step_layout.py `StepLayout`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
import torch.fx.traceback as fx_traceback
from torch import Tensor
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import (
    FakeTensorMode,
)
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from titan_tpu.data.batch import Batch, as_batch, flatten, unflatten
from titan_tpu.graph.capture_errors import (
    capture_error,
    module_stack,
    module_stack_from_forward,
    tag_backward_with_forward,
)
from titan_tpu.graph.passes import recomputed_nodes, rematerialize
from titan_tpu.graph.step_layout import StepLayout
from titan_tpu.model_contract import TrainableModel, gradient_reducer
from titan_tpu.tensors import local_tensor
from titan_tpu.train.objective import ModelCalls, NextTokenObjective, Objective
from titan_tpu.train.optim import adamw_update, clip_grad_norm
from titan_tpu.train.ranks import model_copies

__all__ = ["CapturedStep", "DTensorSpec", "capture_accumulating_step", "capture_eval_step", "capture_scoring_step",
           "capture_train_step"]

# Ops traced as their decompositions because their fake (meta) kernel gives an output a layout that
# the real kernel does not, and a view the graph then records on that output fails when the graph
# runs. softplus_backward: the CPU kernel follows the layout of `grad`, the meta kernel that of
# `self`; with a transposed grad (Qwen3-Next's gated delta rule) the recorded view fails. Its
# decomposition is elementwise arithmetic, whose layout fake and real tensors agree on.
TRACE_DECOMPOSITIONS = get_decompositions([torch.ops.aten.softplus_backward])


@dataclass(frozen=True)
class DTensorSpec:
    """What is needed to rebuild a DTensor parameter from its local shard inside the graph."""

    mesh: object  # DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: Tensor) -> DTensor:
        # run_check=False: no collective to verify metadata (we know it is right; it came from
        # the live parameter), and shape/stride given so uneven shards need no communication.
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


@dataclass
class CapturedStep:
    """One traced program of the step and how to feed it.

    Flat inputs and outputs: the groups of `layout` (StepLayout), all plain (local) tensors.
    params, grads, exp_avg, exp_avg_sq: one tensor per parameter (param_names order); batch: the
    micro-batch's tensors (`batch_spec` rebuilds the typed batch from them; a TokenBatch: inputs_BS,
    labels_BS and, with document masking, positions_BS); num_tokens: 0-dim int32, the objective's
    count of the step on all data-parallel ranks (next-token: the labels it trains on), the loss
    denominator, an input so that chat data (a varying count) needs no new graph; step, lr: 0-dim
    scalar_dtype; buffers: buffer_names order (make_fx refuses real tensors closed over, so the
    RoPE table is an input too, never modified; frozen parameters and the objective's frozen
    modules' tensors too); totals: 1-D, the objective's reported terms and statistics
    (train/objective.py): a micro-batch program returns its own, an update takes their sum over
    the step's micro-batches.
    Outputs of a whole step or of an update: new params, new exp_avg, new exp_avg_sq, loss (0-dim,
    the objective's loss over all ranks), grad_norm (0-dim, global, before clipping), totals (the
    step's, summed over ranks: `objective.report` names them), then the new values of the buffers
    in `updated_buffer_names` (MoE expert biases under auxiliary-loss-free balancing). A
    micro-batch program returns the gradients summed so far and its own totals.
    """

    graph_module: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]  # model buffers (e.g. the RoPE table), passed as the last inputs
    dtensor_specs: dict[str, DTensorSpec]  # empty for a single-process (plain tensor) model
    example_inputs: list[Tensor]  # fake tensors with the shapes the graph was traced for
    dp_size: int  # data-parallel ranks: num_tokens counts the labels of all of them
    capture_seconds: float
    num_params: int  # global parameter count (full, unsharded sizes)
    layout: StepLayout  # the order and size of the flat inputs and outputs
    scalar_dtype: torch.dtype = torch.float64  # dtype of the step and lr inputs
    updated_buffer_names: list[str] = dataclasses.field(default_factory=list)  # buffers the step moves
    program: str = "train step"  # what the graph is, for summary(): "train step", "micro-batch", "update", "eval"
    objective: Objective = dataclasses.field(default_factory=NextTokenObjective)  # names the totals
    batch_spec: object = None  # the pytree spec of the batch group (data/batch.py unflatten); None for `update`

    @property
    def num_inputs(self) -> int:
        return self.layout.num_inputs

    def input_slices(self) -> dict[str, slice]:
        """Where each group of the flat inputs lies."""
        return self.layout.input_slices()

    def output_slices(self) -> dict[str, slice]:
        """Where each group of the flat outputs lies."""
        return self.layout.output_slices()

    def op_counts(self) -> Counter:
        """Number of call_function nodes per op (OpOverload name, e.g. 'aten.mm.default')."""
        return Counter(str(node.target) for node in self.graph_module.graph.nodes if node.op == "call_function")

    def recomputed_node_count(self) -> int:
        """Nodes traced while activation checkpointing recomputed a block in the backward."""
        return len(recomputed_nodes(self.graph_module))

    def collective_counts(self) -> Counter:
        return Counter({op: n for op, n in self.op_counts().items() if "_c10d_functional" in op})

    def summary(self) -> str:
        nodes = list(self.graph_module.graph.nodes)
        kinds = Counter(node.op for node in nodes)
        ops = self.op_counts()
        top = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in ops.most_common(8))
        collectives = self.collective_counts()
        scans = sum(n for op, n in ops.items() if op.endswith("scan"))
        lines = [
            f"captured {self.program}: {len(nodes)} nodes ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})",
            f"  parameters: {len(self.param_names)} tensors, {self.num_params:,} values"
            + (f", sharded as DTensors on mesh {next(iter(self.dtensor_specs.values())).mesh}"
               if self.dtensor_specs else ", plain tensors"),
            f"  inputs: {self.layout.num_inputs} ({', '.join(name for name, _ in self.layout.input_groups())}); "
            f"outputs: {self.layout.num_outputs} ({', '.join(name for name, _ in self.layout.output_groups())})",
            f"  distinct ops: {len(ops)}; most frequent: {top}",
            "  collectives: " + (", ".join(f"{op.removeprefix('_c10d_functional.')} {n}"
                                           for op, n in sorted(collectives.items())) or "none"),
            f"  recomputed in the backward (activation checkpointing): {self.recomputed_node_count()} nodes"
            + (f"; {scans} scan loops over stacked layers (recomputation inside their bodies is not counted)"
               if scans else ""),
            f"  capture: {self.capture_seconds:.2f} s",
        ]
        return "\n".join(lines)


def _world_group_all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over all ranks as a traceable functional collective (a graph node, not a side effect)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def frozen_inputs(model: torch.nn.Module, objective: Objective) -> dict[str, Tensor]:
    """The live tensors a captured step reads but does not train, by input name, in input order:
    the model's buffers and frozen parameters (LoRA's base weights) by their own names, then the
    parameters and buffers of the objective's frozen modules (DPO's reference copy) as
    "<module>:<name>"."""
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    out = {**dict(model.named_buffers()), **frozen}
    for key, module in objective.frozen_modules().items():
        out.update({f"{key}:{n}": t for n, t in (*module.named_parameters(), *module.named_buffers())})
    return out


class _StepParts:
    """The pieces every captured program of a step is written with: the forward and backward of
    one micro-batch (the objective's), and the update (clipping, AdamW, the sums over ranks, the
    expert biases). `capture_train_step` traces both in one program; `capture_accumulating_step`
    traces them as two, the first run once per micro-batch."""

    def __init__(self, model: torch.nn.Module, *, max_norm: float, adamw_hparams: dict, decay: dict[str, bool],
                 dp_size: int | None, micro_batches: int, objective: Objective | None):
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not named:
            raise ValueError("capture_train_step: the model has no parameters")
        self.model = model
        self.objective = objective or NextTokenObjective()
        self.param_names = list(named)
        # Frozen tensors (LoRA's base weights, a reference model) are read like buffers: graph
        # inputs, no gradient, no update.
        self.buffers = frozen_inputs(model, self.objective)
        self.buffer_names = list(self.buffers)
        self.specs = {n: DTensorSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
                      for n, p in named.items() if isinstance(p, DTensor)}
        self.frozen_specs = {n: DTensorSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
                             for n, p in self.buffers.items() if isinstance(p, DTensor)}
        if self.specs and len(self.specs) != len(named):
            plain = sorted(set(named) - set(self.specs))[:3]
            raise ValueError(f"capture_train_step: mixed plain and DTensor parameters (plain: {plain}); "
                             "make the whole model data parallel or none of it")
        if dp_size is None:
            from titan_tpu.parallel.mesh import dp_rank_and_size

            dp_size = dp_rank_and_size(next(iter(self.specs.values())).mesh)[1] if self.specs else 1
        self.dp_size = dp_size
        self.copies = model_copies(dp_size)  # tensor-parallel ranks each hold the whole loss of their batch
        # A mean term (the balancing loss) is averaged over micro-batches and ranks (the gradient
        # reduction sums them), with EagerStep's arithmetic.
        self.share = 1.0 / (micro_batches * dp_size)
        self.max_norm, self.hparams, self.decay = max_norm, dict(adamw_hparams), decay
        self.updated_buffers = model.expert_bias_names() if isinstance(model, TrainableModel) else []
        self.num_params = sum(p.numel() for p in named.values())
        self.batch_spec = None  # the batch's pytree spec, set by the capture functions

    def _as_model_tensor(self, name: str, t: Tensor) -> Tensor:
        return self.specs[name].wrap(t) if name in self.specs else t

    def _calls(self, params: dict[str, Tensor], buffer_values: dict[str, Tensor]) -> ModelCalls:
        """The objective's model calls on the graph's input tensors (functional_call)."""
        own = {n: t for n, t in buffer_values.items() if ":" not in n}

        def policy(*args, **kwargs):
            return torch.func.functional_call(self.model, {**params, **own}, args, kwargs)

        def frozen_call(key: str, module: torch.nn.Module):
            tensors = {n.split(":", 1)[1]: t for n, t in buffer_values.items() if n.startswith(f"{key}:")}
            return lambda *args, **kwargs: torch.func.functional_call(module, tensors, args, kwargs)

        frozen = {key: frozen_call(key, module) for key, module in self.objective.frozen_modules().items()}
        return ModelCalls(policy=policy, frozen=frozen)

    def forward_backward(self, local_params: list[Tensor], batch: list[Tensor], num_tokens: Tensor,
                         buffer_values: dict[str, Tensor]) -> tuple[list[Tensor], Tensor]:
        """(local gradient shards, this rank's totals of the objective: its shares of the reported
        terms, its statistics) of one micro-batch."""
        typed = unflatten(batch, self.batch_spec)
        # Differentiate with respect to fresh leaves, not the inputs themselves, so the optimizer
        # reads the parameter inputs unchanged and untracked.
        leaves = [t.detach().requires_grad_(True) for t in local_params]
        with torch.enable_grad():
            params = {name: self._as_model_tensor(name, t) for name, t in zip(self.param_names, leaves)}
            loss = self.objective.micro_batch(self._calls(params, buffer_values), typed, count=num_tokens,
                                              share=self.share)
            # Gradients of the local leaves are the local shards of the (reduce-scattered)
            # parameter gradients: DTensor.from_local's backward hands back the local part.
            # The backward region, for the rematerialize pass (activation checkpointing).
            with fx_traceback.annotate({"phase": "backward"}):
                tag_backward_with_forward([loss.objective.grad_fn])
                # Zeros for parameters the loss does not reach, as the eager step does.
                local_grads = torch.autograd.grad(loss.objective, leaves, allow_unused=True, materialize_grads=True)
        return list(local_grads), loss.totals

    def update(self, local_params: list[Tensor], local_grads: list[Tensor], exp_avg: list[Tensor],
               exp_avg_sq: list[Tensor], totals: Tensor, step: Tensor, lr: Tensor,
               buffer_values: dict[str, Tensor]) -> dict[str, list[Tensor]]:
        """The output groups of an update (StepLayout): clipping, AdamW, the global loss and
        totals, the new expert biases."""
        names = self.param_names
        with torch.no_grad():
            # Norm and clipping on DTensors: the norm of sharded grads needs a cross-rank sum,
            # which grad_norm adds (full_tensor) exactly as in the eager path.
            grads = {name: self._as_model_tensor(name, g) for name, g in zip(names, local_grads)}
            reducer = gradient_reducer(self.model)
            if reducer is not None:  # e.g. the weights every pipeline stage holds: each stage's part summed
                grads = reducer.summed(grads)
            clipped, total_norm = clip_grad_norm(grads, self.max_norm)
            # The optimizer update is elementwise per shard, so it runs on plain local tensors:
            # the same arithmetic as the DTensor eager path, without DTensor dispatch.
            local = {name: g.to_local() if isinstance(g, DTensor) else g for name, g in clipped.items()}
            state = {"exp_avg": dict(zip(names, exp_avg)), "exp_avg_sq": dict(zip(names, exp_avg_sq))}
            new_params, new_state = adamw_update(dict(zip(names, local_params)), local, state,
                                                 step=step, lr=lr, decay=self.decay, **self.hparams)
            # Each rank holds its share of the global terms and its own loads: one sum over ranks.
            if self.dp_size > 1 or self.copies > 1:
                totals = _world_group_all_reduce_sum(totals)
                totals = totals / self.copies if self.copies > 1 else totals
            updated = self.updated_buffers
            new_buffers = (self.model.updated_expert_biases({n: buffer_values[n] for n in updated},
                                                            self.objective.expert_load(totals))
                           if updated else {})
            if isinstance(total_norm, DTensor):
                total_norm = total_norm.to_local()
        return dict(params=[new_params[k] for k in names], exp_avg=[new_state["exp_avg"][k] for k in names],
                    exp_avg_sq=[new_state["exp_avg_sq"][k] for k in names], loss=[totals[0]],
                    grad_norm=[total_norm], totals=[totals], buffers=[new_buffers[n] for n in updated])

    def local_params(self) -> list[Tensor]:
        # The live local tensors (turned into fake tensors when tracing; nothing is computed on them).
        named = dict(self.model.named_parameters())
        return [local_tensor(named[n]) for n in self.param_names]

    def local_buffers(self) -> list[Tensor]:
        return [local_tensor(b) for b in self.buffers.values()]

    def buffer_values(self, tensors: list[Tensor]) -> dict[str, Tensor]:
        """Buffer name -> the graph input, a frozen sharded parameter wrapped back into its DTensor."""
        return {n: self.frozen_specs[n].wrap(t) if n in self.frozen_specs else t
                for n, t in zip(self.buffer_names, tensors)}

    def captured(self, gm: torch.fx.GraphModule, seconds: float, layout: StepLayout, scalar_dtype: torch.dtype,
                 program: str) -> CapturedStep:
        fake_inputs = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
        return CapturedStep(graph_module=gm, param_names=self.param_names, buffer_names=self.buffer_names,
                            dtensor_specs=self.specs, example_inputs=fake_inputs, dp_size=self.dp_size,
                            capture_seconds=seconds, num_params=self.num_params, layout=layout,
                            scalar_dtype=scalar_dtype, updated_buffer_names=self.updated_buffers, program=program,
                            objective=self.objective, batch_spec=self.batch_spec if layout.batch else None)


def _example_batch(parts: _StepParts, example_batch: Batch | tuple[Tensor, ...]) -> list[Tensor]:
    """The example batch's tensors (its pytree spec kept on `parts`), cloned: make_fx maps one
    tensor object to one graph input, so a caller passing the same tensor as inputs and labels
    would otherwise get a graph where labels alias the inputs."""
    tensors, parts.batch_spec = flatten(as_batch(example_batch))
    return [t.clone() for t in tensors]


def _num_tokens_example() -> Tensor:
    return torch.ones((), dtype=torch.int32)


def _output_values(gm: torch.fx.GraphModule) -> list:
    """The fake values a traced graph returns, in output order."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    return [node.meta["val"] for node in output.args[0]]


def _trace(fn, example: list[Tensor], model: torch.nn.Module) -> tuple[torch.fx.GraphModule, float]:
    """(fn traced on fake copies of `example`, seconds), activation checkpointing applied."""
    start = time.perf_counter()
    # Our own fake mode, without a ShapeEnv (make_fx picks up the mode of fake inputs): left to
    # itself, make_fx("fake") adds one, and data-dependent values and shapes then become unbacked
    # symbols instead of failing at the op that makes them (see the module docstring).
    fake_mode = FakeTensorMode(allow_fallback_kernels=True)
    fake_example = [fake_mode.from_tensor(t) for t in example]
    with module_stack(model) as stack:
        try:
            # preserve_node_meta: annotations made while tracing (the backward phase) land in
            # node.meta["custom"], the running modules in node.meta["nn_module_stack"].
            with fx_traceback.preserve_node_meta():
                gm = make_fx(fn, tracing_mode="fake", decomposition_table=TRACE_DECOMPOSITIONS)(*fake_example)
            module_stack_from_forward(gm)
        except Exception as e:
            error = capture_error(e, stack)
            if error is None:
                raise
            raise error from e
    # Activation checkpointing: recompute tagged forward ops in the backward (no-op untagged).
    gm = rematerialize(gm)
    return gm, time.perf_counter() - start


def capture_train_step(
    model: torch.nn.Module,
    *,
    max_norm: float,
    adamw_hparams: dict,
    decay: dict[str, bool],
    example_batch: Batch | tuple[Tensor, ...],
    dp_size: int | None = None,
    scalar_dtype: torch.dtype = torch.float64,
    objective: Objective | None = None,
) -> CapturedStep:
    """Trace one training step of `model` (one micro-batch) into a CapturedStep (see the module
    docstring).

    The loss is the objective's (train/objective.py; default the next-token objective: the model's
    own ``model(inputs, labels, positions_BS=...)``, its summed cross-entropy through the loss kernel
    divided by the num_tokens input, the step's trained token count on all ranks), as EagerStep
    computes it. adamw_hparams: beta1, beta2, eps, weight_decay (AdamW.hparams). decay: which
    parameters get weight decay (AdamW.decay). example_batch: a batch (data/batch.py; or
    (inputs_BS, labels_BS[, positions_BS])) of the shape every step will use (the graph is
    static-shaped). dp_size: number of data-parallel ranks; default the size of the
    data-parallel axes of the parameters' mesh (1 for plain parameters). scalar_dtype: dtype of
    the step and lr inputs; float64 matches the eager path's Python-float arithmetic bit for bit,
    float32 is for TPUs (no fast float64, and XLA may reject it).

    Raises CaptureError when the step cannot be one static graph (see the module docstring).
    """
    parts = _StepParts(model, max_norm=max_norm, adamw_hparams=adamw_hparams, decay=decay, dp_size=dp_size,
                       micro_batches=1, objective=objective)
    batch = _example_batch(parts, example_batch)
    layout = StepLayout.whole_step(params=len(parts.param_names), batch=len(batch), buffers=len(parts.buffer_names),
                                   updated_buffers=len(parts.updated_buffers))

    def train_step(*flat: Tensor) -> list[Tensor]:
        g = layout.unflatten_inputs(flat)
        buffer_values = parts.buffer_values(g["buffers"])
        (num_tokens,), (step,), (lr,) = g["num_tokens"], g["step"], g["lr"]
        grads, totals = parts.forward_backward(g["params"], g["batch"], num_tokens, buffer_values)
        out = parts.update(g["params"], grads, g["exp_avg"], g["exp_avg_sq"], totals, step, lr, buffer_values)
        return layout.flatten_outputs(**out)

    params = parts.local_params()
    # Distinct tensors for every input: make_fx maps one tensor object to one placeholder, so
    # reusing an example tensor for two inputs would silently wire both reads to the same input.
    example = layout.flatten_inputs(
        params=params, exp_avg=[torch.zeros_like(t) for t in params], exp_avg_sq=[torch.zeros_like(t) for t in params],
        batch=batch, num_tokens=[_num_tokens_example()], step=[torch.ones((), dtype=scalar_dtype)],
        lr=[torch.ones((), dtype=scalar_dtype)], buffers=parts.local_buffers())
    gm, seconds = _trace(train_step, example, model)
    return parts.captured(gm, seconds, layout, scalar_dtype, "train step")


def capture_eval_step(model: torch.nn.Module, *, example_batch: Batch | tuple[Tensor, ...],
                      objective: Objective | None = None) -> CapturedStep:
    """Trace the forward of one validation batch (StepLayout.evaluation): the objective's totals
    with a count of 1 (next-token: the summed cross-entropy first), no gradient, the model in eval
    mode while traced, as the loops' validation runs it eagerly (train/step.py evaluate_eagerly)."""
    def totals(parts: _StepParts, calls: ModelCalls, batch) -> dict[str, list[Tensor]]:
        return {"totals": [parts.objective.micro_batch(calls, batch, count=1, share=0.0).totals]}

    return _capture_forward(model, example_batch, objective, StepLayout.evaluation, totals, "eval")


def capture_scoring_step(model: torch.nn.Module, *, example_batch: Batch | tuple[Tensor, ...],
                         objective: Objective | None = None) -> CapturedStep:
    """Trace the forward of one batch of lm-eval's rows (StepLayout.scoring; evaluation/harness.py):
    for every position, the fp32 log-probability of its label (the row's next token) and whether the
    label is the model's most likely token (1.0 or 0.0), [B, S] each: what the harness reads of the
    logits, so the program returns two numbers a position, not the vocabulary's. No gradient, the
    model in eval mode; a label < 0 (padding) reads token 0. objective: the run's, whose frozen
    modules' buffers the program takes as the training programs do (it calls the policy alone)."""
    def scores(parts: _StepParts, calls: ModelCalls, rows) -> dict[str, list[Tensor]]:
        logits_BSV = calls.policy(rows.inputs_BS).float()
        labels_BS1 = rows.labels_BS.clamp(min=0).unsqueeze(-1)
        logp_BS = torch.log_softmax(logits_BSV, dim=-1).gather(-1, labels_BS1).squeeze(-1)
        greedy_BS = (logits_BSV.argmax(dim=-1) == labels_BS1.squeeze(-1)).float()
        return {"scores": [logp_BS, greedy_BS]}

    return _capture_forward(model, example_batch, objective, StepLayout.scoring, scores, "score")


def _capture_forward(model: torch.nn.Module, example_batch: Batch | tuple[Tensor, ...], objective: Objective | None,
                     layout_of, forward, program: str) -> CapturedStep:
    """A forward-only program (no gradient, no update; the model in eval mode while traced):
    `forward(parts, calls, batch)` -> its output groups, over the parameters, the batch and the
    buffers as `layout_of` (a StepLayout constructor) lays them out."""
    # The update's settings are never read: the program ends at the forward.
    parts = _StepParts(model, max_norm=0.0, adamw_hparams={}, decay={}, dp_size=None, micro_batches=1,
                       objective=objective)
    batch = _example_batch(parts, example_batch)
    layout = layout_of(params=len(parts.param_names), batch=len(batch), buffers=len(parts.buffer_names))

    def traced(*flat: Tensor) -> list[Tensor]:
        g = layout.unflatten_inputs(flat)
        buffer_values = parts.buffer_values(g["buffers"])
        params = {name: parts._as_model_tensor(name, t) for name, t in zip(parts.param_names, g["params"])}
        typed = unflatten(g["batch"], parts.batch_spec)
        with torch.no_grad():
            outputs = forward(parts, parts._calls(params, buffer_values), typed)
        return layout.flatten_outputs(**outputs)

    example = layout.flatten_inputs(params=parts.local_params(), batch=batch, buffers=parts.local_buffers())
    was_training = model.training
    model.eval()
    try:
        gm, seconds = _trace(traced, example, model)
    finally:
        model.train(was_training)
    return parts.captured(gm, seconds, layout, torch.float32, program)


def capture_accumulating_step(
    model: torch.nn.Module,
    *,
    max_norm: float,
    adamw_hparams: dict,
    decay: dict[str, bool],
    example_batch: Batch | tuple[Tensor, ...],
    grad_accum_steps: int,
    dp_size: int | None = None,
    scalar_dtype: torch.dtype = torch.float64,
    objective: Objective | None = None,
) -> tuple[CapturedStep, CapturedStep]:
    """A step of `grad_accum_steps` micro-batches as two programs: (the forward and backward of one
    micro-batch, adding its gradients to the sums it is given; the update, once per step). The
    arguments are capture_train_step's.

    Two programs rather than a loop in one: the micro-batch program is the model once, whatever
    the count (no unrolled copies, so compile time does not grow with it), and a loop over
    micro-batches around autograd inside a traced scan is not something make_fx can capture.
    Under SimpleFSDP each micro-batch's backward reduce-scatters its gradients (the sums are
    sharded, as in EagerStep): holding them unreduced until the update would keep a full-size
    gradient per rank.
    """
    if grad_accum_steps < 2:
        raise ValueError(f"capture_accumulating_step: grad_accum_steps = {grad_accum_steps}; one micro-batch "
                         "is capture_train_step")
    parts = _StepParts(model, max_norm=max_norm, adamw_hparams=adamw_hparams, decay=decay, dp_size=dp_size,
                       micro_batches=grad_accum_steps, objective=objective)
    batch = _example_batch(parts, example_batch)
    n, buffers = len(parts.param_names), parts.local_buffers()
    micro_layout = StepLayout.micro_batch(params=n, batch=len(batch), buffers=len(buffers))
    update_layout = StepLayout.update(params=n, buffers=len(buffers), updated_buffers=len(parts.updated_buffers))

    def micro_batch(*flat: Tensor) -> list[Tensor]:
        g = micro_layout.unflatten_inputs(flat)
        buffer_values = parts.buffer_values(g["buffers"])
        grads, totals = parts.forward_backward(g["params"], g["batch"], g["num_tokens"][0], buffer_values)
        return micro_layout.flatten_outputs(grads=[a + b for a, b in zip(g["grads"], grads)], totals=[totals])

    def update(*flat: Tensor) -> list[Tensor]:
        g = update_layout.unflatten_inputs(flat)
        buffer_values = parts.buffer_values(g["buffers"])
        out = parts.update(g["params"], g["grads"], g["exp_avg"], g["exp_avg_sq"], g["totals"][0], g["step"][0],
                           g["lr"][0], buffer_values)
        return update_layout.flatten_outputs(**out)

    params = parts.local_params()
    zeros = lambda: [torch.zeros_like(t) for t in params]  # noqa: E731 - distinct tensors per group
    example = micro_layout.flatten_inputs(params=params, grads=zeros(), batch=batch,
                                          num_tokens=[_num_tokens_example()], buffers=buffers)
    micro_gm, micro_seconds = _trace(micro_batch, example, model)
    # The totals' length (the objective's terms and statistics) is known from that trace.
    totals = _output_values(micro_gm)[micro_layout.output_slices()["totals"].start]
    example = update_layout.flatten_inputs(
        params=params, grads=zeros(), exp_avg=zeros(), exp_avg_sq=zeros(),
        totals=[torch.zeros(totals.shape, dtype=totals.dtype, device=totals.device)],
        step=[torch.ones((), dtype=scalar_dtype)], lr=[torch.ones((), dtype=scalar_dtype)], buffers=buffers)
    update_gm, update_seconds = _trace(update, example, model)
    return (parts.captured(micro_gm, micro_seconds, micro_layout, scalar_dtype, "micro-batch"),
            parts.captured(update_gm, update_seconds, update_layout, scalar_dtype, "update"))
