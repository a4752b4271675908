"""Why a step cannot be captured, in one line (graph/capture.py traces it): `CaptureError` naming the
op that failed and the module whose forward ran it, with what to do. The running modules are
tracked with forward hooks that exist only while tracing (`module_stack`), recorded on the graph's
nodes as torch.export writes them (``nn_module_stack``), and given to the backward's nodes from the
forward node each came from, so errors and the JAX lowering can name a module for any node."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

__all__ = ["CaptureError", "capture_error", "module_stack", "module_stack_from_forward", "tag_backward_with_forward"]


class CaptureError(ValueError):
    """The step cannot be captured as one static graph; the message (one line) names the op, the
    module whose forward ran it and what to do. A ValueError, so the CLI prints it as a user error;
    the tracing exception is chained as __cause__ for the full story."""


@contextlib.contextmanager
def module_stack(model: torch.nn.Module) -> Iterator[list[tuple[str, str]]]:
    """Track which modules' forwards are running while tracing: yields a list of
    (qualified name, class name), innermost last. The hooks exist only inside the block.

    A forward that raises never reaches its post-hook, so after a tracing failure the list still
    holds the chain of modules that were running when the failing op was called.

    While node meta is preserved (`_trace`), the stack is also fx's current ``nn_module_stack``
    (name -> (name, class name), outermost first, as torch.export writes it), which every node
    traced meanwhile copies into its meta: a later error about a node (an op with no JAX
    lowering) can name the module it came from.
    """
    stack: list[tuple[str, str]] = []
    handles = []

    def publish():
        if fx_traceback.has_preserved_node_meta():
            if stack:
                fx_traceback.current_meta["nn_module_stack"] = {name: (name, cls) for name, cls in stack}
            else:
                fx_traceback.current_meta.pop("nn_module_stack", None)

    try:
        for name, module in model.named_modules():
            def push(mod, args, name=name):
                stack.append((name, type(mod).__name__))
                publish()

            def pop(mod, args, output):
                stack.pop()
                publish()

            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop))
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _autograd_nodes(roots) -> Iterator:
    seen, todo = set(), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)


def tag_backward_with_forward(roots) -> None:
    """While the backward of `roots` (grad_fns) is traced, each node traced for a grad_fn records
    that grad_fn's sequence number as its ``seq_nr`` (the one the forward node that made it has),
    as torch's AOTAutograd does; `module_stack_from_forward` then gives it its forward's module."""
    if not fx_traceback.has_preserved_node_meta():
        return
    for node in _autograd_nodes(roots):
        node.register_prehook(lambda grad_output, seq_nr=node._sequence_nr(): fx_traceback.set_grad_fn_seq_nr(seq_nr))
        node.register_hook(lambda grad_input, grad_output: fx_traceback.reset_grad_fn_seq_nr())


def module_stack_from_forward(gm: torch.fx.GraphModule) -> None:
    """Backward nodes (seq_nr of a forward node, `tag_backward_with_forward`) get that forward
    node's ``nn_module_stack`` (their meta["custom"]["phase"] says they are the backward)."""
    forward = {}
    for node in gm.graph.nodes:
        if "nn_module_stack" in node.meta and node.meta.get("custom", {}).get("phase") != "backward":
            forward.setdefault(node.meta.get("seq_nr"), node.meta["nn_module_stack"])
    for node in gm.graph.nodes:
        if node.meta.get("custom", {}).get("phase") == "backward" and node.meta.get("seq_nr") in forward:
            node.meta["nn_module_stack"] = forward[node.meta["seq_nr"]]


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


def capture_error(error: BaseException, stack: list[tuple[str, str]]) -> CaptureError | None:
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
