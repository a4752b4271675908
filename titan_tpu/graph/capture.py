"""Capture one whole training step (forward, loss, backward, clipping, AdamW) as one FX graph.

The step is written once as a pure function of plain tensors::

    (params, exp_avg, exp_avg_sq, inputs_BS, labels_BS[, positions_BS], step, lr, buffers)
        -> (new_params, new_exp_avg, new_exp_avg_sq, loss, grad_norm, aux_loss, expert_load,
            new expert biases)

and traced with ``make_fx(tracing_mode="fake")``, which records the aten ops that autograd, the
pure optimizer functions and DTensor dispatch run. Nothing is executed for real while tracing.

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
whose forward was running, tracked with forward hooks that exist only while tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
import torch.fx.traceback as fx_traceback
from torch import Tensor
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

from titan_tpu.graph.passes import recomputed_nodes, rematerialize
from titan_tpu.model_contract import TrainableModel
from titan_tpu.train.optim import adamw_update, clip_grad_norm
from titan_tpu.train.step import model_copies, split_batch

__all__ = ["CaptureError", "CapturedStep", "DTensorSpec", "StepLayout", "capture_train_step"]

# Ops traced as their decompositions because their fake (meta) kernel gives an output a layout that
# the real kernel does not, and a view the graph then records on that output fails when the graph
# runs. softplus_backward: the CPU kernel follows the layout of `grad`, the meta kernel that of
# `self`; with a transposed grad (Qwen3-Next's gated delta rule) the recorded view fails. Its
# decomposition is elementwise arithmetic, whose layout fake and real tensors agree on.
TRACE_DECOMPOSITIONS = get_decompositions([torch.ops.aten.softplus_backward])


def _slices(groups: list[tuple[str, int]]) -> dict[str, slice]:
    out, start = {}, 0
    for name, count in groups:
        out[name] = slice(start, start + count)
        start += count
    return out


@dataclass(frozen=True)
class StepLayout:
    """The order and size of the captured step's flat inputs and outputs, written once.

    The graph takes and returns flat lists of tensors; each list is a sequence of named groups
    (the params, the moments, the batch, ...). Everything that builds or reads such a list (the
    traced step, its example inputs, GraphStep feeding and unpacking it, the split of the graph at
    the loss, `CapturedStep.summary`) goes through `flatten_*` / `unflatten_*` and the slices here,
    so adding a group is one edit, and no count is written by hand anywhere else.

    Inputs: params, exp_avg, exp_avg_sq (each in param_names order), batch (inputs_BS, labels_BS
    and, with document masking, positions_BS), step, lr (0-dim), buffers (buffer_names order).
    Outputs: params, exp_avg, exp_avg_sq (new values), loss, grad_norm, aux_loss, expert_load,
    buffers (new values of updated_buffer_names). `CapturedStep` says what each one means.
    """

    params: int  # number of parameter tensors
    batch: int  # tensors of one micro-batch: 2, or 3 with positions
    buffers: int  # model buffers passed in
    updated_buffers: int  # buffers the step returns new values of (MoE expert biases)

    def input_groups(self) -> list[tuple[str, int]]:
        n = self.params
        return [("params", n), ("exp_avg", n), ("exp_avg_sq", n), ("batch", self.batch), ("step", 1), ("lr", 1),
                ("buffers", self.buffers)]

    def output_groups(self) -> list[tuple[str, int]]:
        n = self.params
        return [("params", n), ("exp_avg", n), ("exp_avg_sq", n), ("loss", 1), ("grad_norm", 1), ("aux_loss", 1),
                ("expert_load", 1), ("buffers", self.updated_buffers)]

    @property
    def num_inputs(self) -> int:
        return sum(count for _, count in self.input_groups())

    @property
    def num_outputs(self) -> int:
        return sum(count for _, count in self.output_groups())

    def input_slices(self) -> dict[str, slice]:
        return _slices(self.input_groups())

    def output_slices(self) -> dict[str, slice]:
        return _slices(self.output_groups())

    def flatten_inputs(self, **groups) -> list:
        """The flat input list from every input group by name (each a sequence of tensors)."""
        return _flatten(self.input_groups(), groups)

    def flatten_outputs(self, **groups) -> list:
        """The flat output list from every output group by name (each a sequence of tensors)."""
        return _flatten(self.output_groups(), groups)

    def unflatten_inputs(self, flat) -> dict[str, list]:
        """Group name -> its tensors of a flat input list."""
        return {name: list(flat[s]) for name, s in self.input_slices().items()}

    def unflatten_outputs(self, flat) -> dict[str, list]:
        """Group name -> its tensors of a flat output list."""
        return {name: list(flat[s]) for name, s in self.output_slices().items()}


def _flatten(layout: list[tuple[str, int]], groups: dict) -> list:
    assert set(groups) == {name for name, _ in layout}, (sorted(groups), layout)
    flat = []
    for name, count in layout:
        assert len(groups[name]) == count, f"group {name}: {len(groups[name])} tensors, the layout says {count}"
        flat.extend(groups[name])
    return flat


class CaptureError(ValueError):
    """The step cannot be captured as one static graph; the message (one line) names the op, the
    module whose forward ran it and what to do. A ValueError, so the CLI prints it as a user error;
    the tracing exception is chained as __cause__ for the full story."""


@contextlib.contextmanager
def _module_stack(model: torch.nn.Module) -> Iterator[list[tuple[str, str]]]:
    """Track which modules' forwards are running while tracing: yields a list of
    (qualified name, class name), innermost last. The hooks exist only inside the block.

    A forward that raises never reaches its post-hook, so after a tracing failure the list still
    holds the chain of modules that were running when the failing op was called.
    """
    stack: list[tuple[str, str]] = []
    handles = []
    try:
        for name, module in model.named_modules():
            def push(mod, args, name=name):
                stack.append((name, type(mod).__name__))

            def pop(mod, args, output):
                stack.pop()

            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop))
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _defining_op(partial_graph: object, symbols: set) -> str | None:
    """The first op of a partial trace whose output holds one of the unbacked `symbols`.

    torch 2.13 keeps the partial graph as printed code (lines like
    ``nonzero: "i64[u0, 1]" = torch.ops.aten.nonzero.default(x)``); a Graph is read directly.
    """
    if isinstance(partial_graph, torch.fx.GraphModule):
        partial_graph = partial_graph.graph
    if isinstance(partial_graph, torch.fx.Graph):
        for node in partial_graph.nodes:
            if node.op == "call_function" and set(free_unbacked_symbols(node.meta.get("val"))) & symbols:
                return str(node.target)
    elif isinstance(partial_graph, str):
        names = {str(s) for s in symbols}
        for line in partial_graph.splitlines():
            match = re.search(r':\s*"([^"]*)"\s*=\s*torch\.ops\.([\w.]+)\(', line)
            if match and names & set(re.findall(r"\w+", match.group(1))):
                return match.group(2)
    return None


def _capture_error(error: BaseException, stack: list[tuple[str, str]]) -> CaptureError | None:
    """A CaptureError explaining `error` (or an exception it was raised from), or None when the
    error is not one of the known "this cannot be a static graph" kinds (a bug in model code, say,
    which should keep its own traceback)."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, (DataDependentOutputException, DynamicOutputShapeException,
                                                       UnsupportedOperatorException,
                                                       GuardOnDataDependentSymNode)):
        cause = cause.__cause__
    if cause is None:
        return None
    if isinstance(cause, GuardOnDataDependentSymNode):
        # Only with a ShapeEnv (not how we trace, kept for safety): find the op that produced the
        # symbol being branched on from the partial graph the exception carries.
        op = _defining_op(getattr(cause, "partial_fx_graph", None), set(cause.cond.free_symbols)) or "an op"
        what = f"Python code branches on a value computed from tensor data by {op} ({cause.cond})"
    elif isinstance(cause, DataDependentOutputException):
        # aten._local_scalar_dense: what .item(), bool(t), float(t) and `if t:` call.
        what = f"{cause.func} reads a tensor's value into Python (.item(), bool(), or if/while on a tensor)"
    elif isinstance(cause, DynamicOutputShapeException):
        what = f"{cause.func} returns a tensor whose shape depends on the data (the graph is static-shaped)"
    else:
        what = (f"{cause.func} has no fake-tensor (meta) kernel, so it cannot be traced "
                "(a custom op needs torch.library.register_fake)")
    if stack:
        name, cls = stack[-1]
        where = f"module {name} ({cls})" if name else f"the model's own forward ({cls})"
    else:
        where = "no module's forward (the loss, backward or optimizer update)"
    return CaptureError(f"graph capture failed in {where}: {what}; rewrite it with tensor ops of static shape "
                        "(e.g. torch.where instead of if) or run with --training.mode eager")


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
    """The traced step and how to feed it.

    Flat inputs and outputs: the groups of `layout` (StepLayout), all plain (local) tensors.
    Inputs: params (param_names order), exp_avg (same order), exp_avg_sq, the batch (inputs_BS,
    labels_BS and, with document masking, positions_BS), step (0-dim scalar_dtype), lr (0-dim
    scalar_dtype), buffers (buffer_names order; make_fx refuses real tensors closed over, so the
    RoPE table is an input too, never modified).
    Outputs: new params, new exp_avg, new exp_avg_sq (each in param_names order), loss
    (0-dim, mean per token over all ranks), grad_norm (0-dim, global, before clipping), aux_loss
    (0-dim, MoE balancing loss, mean over ranks; 0 for dense models), expert_load ([L_moe, E]
    tokens per expert, all ranks; [0, 0] for dense), then the new values of the buffers in
    `updated_buffer_names` (MoE expert biases under auxiliary-loss-free balancing).
    """

    graph_module: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]  # model buffers (e.g. the RoPE table), passed as the last inputs
    dtensor_specs: dict[str, DTensorSpec]  # empty for a single-process (plain tensor) model
    example_inputs: list[Tensor]  # fake tensors with the shapes the graph was traced for
    num_tokens: int  # tokens of one step on all ranks (the loss denominator)
    capture_seconds: float
    num_params: int  # global parameter count (full, unsharded sizes)
    layout: StepLayout  # the order and size of the flat inputs and outputs
    scalar_dtype: torch.dtype = torch.float64  # dtype of the step and lr inputs
    updated_buffer_names: list[str] = dataclasses.field(default_factory=list)  # buffers the step moves

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
            f"captured train step: {len(nodes)} nodes ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})",
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


def capture_train_step(
    model: torch.nn.Module,
    *,
    max_norm: float,
    adamw_hparams: dict,
    decay: dict[str, bool],
    example_batch: tuple[Tensor, Tensor],
    dp_size: int | None = None,
    scalar_dtype: torch.dtype = torch.float64,
) -> CapturedStep:
    """Trace one training step of `model` into a CapturedStep (see the module docstring).

    The loss is the model's own ``model(inputs, labels, positions_BS=...)`` (the summed
    cross-entropy through the loss kernel; train/step.py), divided by the token count of the whole
    step on all ranks, as EagerStep does. adamw_hparams: beta1, beta2, eps, weight_decay
    (AdamW.hparams). decay: which parameters get weight decay (AdamW.decay). example_batch:
    (inputs_BS, labels_BS[, positions_BS]) of the shape every step will use (the graph is
    static-shaped). dp_size: number of data-parallel ranks; default the size of the data-parallel
    axes of the parameters' mesh (1 for plain parameters). scalar_dtype: dtype of the
    step and lr inputs; float64 matches the eager path's Python-float arithmetic bit for bit,
    float32 is for TPUs (no fast float64, and XLA may reject it).

    Raises CaptureError when the step cannot be one static graph (see the module docstring).
    """
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("capture_train_step: the model has no parameters")
    param_names = list(named)
    # Frozen parameters (LoRA's base weights) are read like buffers: graph inputs, no gradient, no update.
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {**dict(model.named_buffers()), **frozen}
    buffer_names = list(buffers)
    specs = {n: DTensorSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
             for n, p in named.items() if isinstance(p, DTensor)}
    frozen_specs = {n: DTensorSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
                    for n, p in frozen.items() if isinstance(p, DTensor)}
    if specs and len(specs) != len(named):
        plain = sorted(set(named) - set(specs))[:3]
        raise ValueError(f"capture_train_step: mixed plain and DTensor parameters (plain: {plain}); "
                         "make the whole model data parallel or none of it")
    if dp_size is None:
        from titan_tpu.parallel.mesh import dp_rank_and_size

        dp_size = dp_rank_and_size(next(iter(specs.values())).mesh)[1] if specs else 1
    distributed = dp_size > 1
    # Clones: make_fx maps one tensor object to one graph input, so a caller passing the same
    # tensor as inputs and labels would otherwise get a graph where labels alias the inputs.
    split_batch(example_batch)  # a 2- or 3-tuple, or a clear error
    example_batch = [t.clone() for t in example_batch]
    num_tokens = example_batch[1].numel() * dp_size  # static: shapes are fixed for the graph
    copies = model_copies(dp_size)  # tensor-parallel ranks each hold the whole loss of their batch
    hparams = dict(adamw_hparams)
    updated_buffers = model.expert_bias_names() if isinstance(model, TrainableModel) else []
    layout = StepLayout(params=len(param_names), batch=len(example_batch), buffers=len(buffer_names),
                        updated_buffers=len(updated_buffers))

    def train_step(*flat: Tensor) -> list[Tensor]:
        groups = layout.unflatten_inputs(flat)
        local_params, exp_avg, exp_avg_sq = groups["params"], groups["exp_avg"], groups["exp_avg_sq"]
        inputs, labels, positions = split_batch(groups["batch"])
        (step,), (lr,) = groups["step"], groups["lr"]
        buffer_values = {n: frozen_specs[n].wrap(t) if n in frozen_specs else t
                         for n, t in zip(buffer_names, groups["buffers"])}

        # Differentiate with respect to fresh leaves, not the inputs themselves, so the optimizer
        # below reads the parameter inputs unchanged and untracked.
        leaves = [t.detach().requires_grad_(True) for t in local_params]

        def as_model_tensor(name: str, t: Tensor) -> Tensor:
            return specs[name].wrap(t) if name in specs else t

        with torch.enable_grad():
            params = {name: as_model_tensor(name, t) for name, t in zip(param_names, leaves)}
            out = torch.func.functional_call(model, {**params, **buffer_values}, (inputs, labels),
                                             {"positions_BS": positions})
            # The balancing loss is averaged over ranks (the gradient reduction sums them).
            aux = out.aux_loss / dp_size
            loss = out.ce_sum / num_tokens + aux
            # Gradients of the local leaves are the local shards of the (reduce-scattered)
            # parameter gradients: DTensor.from_local's backward hands back the local part.
            # The backward region, for the rematerialize pass (activation checkpointing).
            with fx_traceback.annotate({"phase": "backward"}):
                # Zeros for parameters the loss does not reach, as the eager step does.
                local_grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)

        with torch.no_grad():
            # Norm and clipping on DTensors: the norm of sharded grads needs a cross-rank sum,
            # which grad_norm adds (full_tensor) exactly as in the eager path.
            grads = {name: as_model_tensor(name, g) for name, g in zip(param_names, local_grads)}
            clipped, total_norm = clip_grad_norm(grads, max_norm)
            # The optimizer update is elementwise per shard, so it runs on plain local tensors:
            # the same arithmetic as the DTensor eager path, without DTensor dispatch.
            local = {name: g.to_local() if isinstance(g, DTensor) else g for name, g in clipped.items()}
            state = {"exp_avg": dict(zip(param_names, exp_avg)), "exp_avg_sq": dict(zip(param_names, exp_avg_sq))}
            new_params, new_state = adamw_update(dict(zip(param_names, local_params)), local, state,
                                                 step=step, lr=lr, decay=decay, **hparams)
            # Cross-entropy mean, balancing loss and expert loads: each rank holds its share, one
            # sum over ranks gives the global values.
            load = out.expert_load
            totals = torch.cat([(out.ce_sum / num_tokens).detach().view(1), aux.detach().view(1), load.flatten()])
            if distributed or copies > 1:
                totals = _world_group_all_reduce_sum(totals)
                totals = totals / copies if copies > 1 else totals
            global_load = totals[2:].view(load.shape)
            new_buffers = (model.updated_expert_biases({n: buffer_values[n] for n in updated_buffers}, global_load)
                           if updated_buffers else {})
            if isinstance(total_norm, DTensor):
                total_norm = total_norm.to_local()
        return layout.flatten_outputs(
            params=[new_params[k] for k in param_names], exp_avg=[new_state["exp_avg"][k] for k in param_names],
            exp_avg_sq=[new_state["exp_avg_sq"][k] for k in param_names], loss=[totals[0]],
            grad_norm=[total_norm], aux_loss=[totals[1]], expert_load=[global_load],
            buffers=[new_buffers[n] for n in updated_buffers])

    # Example inputs: the live local tensors (turned into fake tensors below; nothing is computed
    # on them). step/lr default to float64 like the Python numbers the eager path uses.
    def local(p: Tensor) -> Tensor:
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    params = [local(p) for p in named.values()]
    # Distinct tensors for every input: make_fx maps one tensor object to one placeholder, so
    # reusing an example tensor for two inputs would silently wire both reads to the same input.
    example = layout.flatten_inputs(
        params=params, exp_avg=[torch.zeros_like(t) for t in params], exp_avg_sq=[torch.zeros_like(t) for t in params],
        batch=example_batch, step=[torch.ones((), dtype=scalar_dtype)], lr=[torch.ones((), dtype=scalar_dtype)],
        buffers=[local(b) for b in buffers.values()])

    start = time.perf_counter()
    # Our own fake mode, without a ShapeEnv (make_fx picks up the mode of fake inputs): left to
    # itself, make_fx("fake") adds one, and data-dependent values and shapes then become unbacked
    # symbols instead of failing at the op that makes them (see the module docstring).
    fake_mode = FakeTensorMode(allow_fallback_kernels=True)
    fake_example = [fake_mode.from_tensor(t) for t in example]
    with _module_stack(model) as stack:
        try:
            # preserve_node_meta: annotations made while tracing (the backward phase) land in
            # node.meta["custom"].
            with fx_traceback.preserve_node_meta():
                gm = make_fx(train_step, tracing_mode="fake",
                             decomposition_table=TRACE_DECOMPOSITIONS)(*fake_example)
        except Exception as e:
            error = _capture_error(e, stack)
            if error is None:
                raise
            raise error from e
    # Activation checkpointing: recompute tagged forward ops in the backward (no-op untagged).
    gm = rematerialize(gm)
    capture_seconds = time.perf_counter() - start

    fake_inputs = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
    return CapturedStep(graph_module=gm, param_names=param_names, buffer_names=buffer_names,
                        dtensor_specs=specs, example_inputs=fake_inputs,
                        num_tokens=num_tokens, capture_seconds=capture_seconds,
                        num_params=sum(p.numel() for p in named.values()), layout=layout,
                        scalar_dtype=scalar_dtype, updated_buffer_names=updated_buffers)

