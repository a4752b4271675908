"""Graph passes on the captured training step: small functions from GraphModule to GraphModule.

* ``eliminate_dead_code``: drop nodes whose results nobody uses (side-effecting ops stay).
* ``split_graph(gm, mode)``: cut one program into several, for backends where one program is too
  large to compile quickly (XLA on TPU especially). ``fwd_bwd``: forward + loss, then backward +
  update. ``collectives``: every collective's wait in a program of its own (consecutive waits
  share one; a wait right after its collective ends that collective's program), so each program
  holds at most one round of communication and no backend can move a wait up into the compute it
  was placed after. The result is a GraphModule whose submodules ``submod_0``,
  ``submod_1``, ... run in order; ``compile_submodules`` hands each to a backend on its own.
* ``rematerialize``: activation checkpointing in the captured graph: forward ops tagged for
  recomputation while tracing are copied into the backward where they are needed.
* ``schedule_collectives(gm, prefetch=k)``: overlap communication with compute by node order: each
  forward all-gather is issued early enough that k stretches of compute (a block's forward; an
  embedding lookup or a norm does not count) run while it travels, and each gradient
  reduce-scatter's wait moves down to the first op that reads the gradient's values (clipping,
  after the whole backward), so the reduce-scatters run behind the remaining backward.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

SPLIT_MODES = ("none", "fwd_bwd", "collectives")
# node.meta["custom"] key of a recomputed copy: the checkpointed block call it recomputes.
REMAT_REGION = "remat_region"


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def rematerialize(gm: fx.GraphModule) -> fx.GraphModule:
    """Activation recomputation in a traced forward-loss-backward graph.

    Forward ops of checkpointed blocks carry recompute tags (node.meta["recompute"] and
    ["ac_graph_id"], set while tracing by models/common/activation_checkpoint.py); the backward
    region is the nodes annotated custom["phase"] = "backward" (capture.py annotates
    autograd.grad). Each tagged op that the backward needs is copied to just before its first
    backward use, so the forward copy's output dies early; a block's output that the next block
    reads stays saved. The copying is torch's own pass for such graphs (the one torch.compile
    runs); this function marks nothing new, applies it, and drops the tags afterwards so that no
    later compiler stage (AOTAutograd runs the same pass) recomputes twice.
    """
    from torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass import (
        remat_using_tags_for_fwd_loss_bwd_graph,
    )

    gm = remat_using_tags_for_fwd_loss_bwd_graph(gm)
    for node in gm.graph.nodes:
        if node.name.endswith("_recomputed"):
            # The copy's region, for the JAX lowering's CSE barrier (graph/jax_lowering.py
            # `_RematBarriers`); "custom" survives retracing. A new dict: the copy shares the original's.
            node.meta["custom"] = {**node.meta.get("custom", {}), REMAT_REGION: node.meta.get("ac_graph_id", -1)}
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)
    return gm


def recomputed_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes `rematerialize` added (torch's pass names each copy <original>_recomputed)."""
    return [n for n in gm.graph.nodes if n.name.endswith("_recomputed")]


def _is_collective(node: fx.Node, name: str) -> bool:
    return node.op == "call_function" and str(node.target) == f"_c10d_functional.{name}.default"


# Ops that only re-index their single tensor input: a wait may move below them with its value.
_VIEW_OPS = {"aten.slice.Tensor", "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
             "aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.alias.default",
             "aten.select.int", "aten.unsqueeze.default", "aten.squeeze.dim", "aten.expand.default",
             "aten.narrow.default", "aten.as_strided.default"}


def _wait_of(node: fx.Node) -> fx.Node | None:
    return next((u for u in node.users if _is_wait(u)), None)


def _ancestors_after(node: fx.Node, anchor_index: int, index: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The nodes `node` depends on that sit after position `anchor_index` (node included), in
    graph order; None if one of them is a collective or a placeholder (not movable)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or index[n] <= anchor_index:
            continue
        if n.op != "call_function" or (n is not node and "_c10d_functional" in str(n.target)):
            return None
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return sorted(seen, key=index.__getitem__)


def schedule_collectives(gm: fx.GraphModule, *, prefetch: int) -> fx.GraphModule:
    """Reorder the collectives of a captured step (see the module docstring); prefetch = 0 leaves
    the all-gathers where they are. The graph's values are unchanged: only node order moves."""
    if prefetch < 0:
        raise ValueError(f"prefetch = {prefetch} must be >= 0 (0: no all-gather prefetch)")
    graph = gm.graph
    if prefetch:
        # Forward gathers and the backward's re-gathers (re-sharding after the forward,
        # parallel/reshard.py) are prefetched each within their own phase: moving the first
        # re-gather above the backward would keep its weights alive from the forward again.
        gathers = [n for n in graph.nodes if _is_collective(n, "all_gather_into_tensor")]
        for backward in (False, True):
            _prefetch(graph, [g for g in gathers if _in_backward(g) == backward], prefetch)
    for rs in [n for n in graph.nodes if _is_collective(n, "reduce_scatter_tensor")]:
        wait = _wait_of(rs)
        if wait is None:
            continue
        # The wait and the view ops re-indexing its result move down to the first real use.
        moving, todo = [], [wait]
        while todo:
            n = todo.pop()
            moving.append(n)
            todo.extend(u for u in n.users if str(u.target) in _VIEW_OPS and len(u.all_input_nodes) == 1)
        users = [u for n in moving for u in n.users if u not in moving]
        if not users:
            continue
        index = {n: k for k, n in enumerate(graph.nodes)}
        first_use = min(users, key=index.__getitem__)
        for node in sorted(moving, key=index.__getitem__):
            first_use.prepend(node)
    graph.lint()
    gm.recompile()
    return gm


def _in_backward(node: fx.Node) -> bool:
    # Traced in autograd.grad (capture.py annotates it), or a forward op the rematerialize pass
    # copied into the backward (activation checkpointing recomputes a block's gathers too).
    return node.meta.get("custom", {}).get("phase") == "backward" or node.meta.get("autograd_backward", False)


# Ops that make a stretch of the graph worth hiding a collective behind (a block's matmuls and
# attention, a scanned stack's loop); a stretch without them (an embedding lookup, a norm) is not
# counted as a step of prefetch distance.
_COMPUTE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution", "_scaled_dot_product")


def _is_compute(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return True  # scan / while_loop / checkpoint bodies: a block's compute behind one node
    name = str(node.target).split(".")
    return len(name) > 1 and name[1].startswith(_COMPUTE_OPS) and name[1] != "mm_"


def _prefetch(graph: fx.Graph, gathers: list[fx.Node], prefetch: int) -> None:
    """Move each all-gather (with the chain building its buffer) up so that `prefetch` stretches
    of compute run while it travels: to just after the wait of the latest earlier all-gather that
    has `prefetch` compute stretches (between consecutive waits: one block's forward, say)
    between it and this gather's own wait. A stretch without compute (after the embedding's or
    the final norm's gather) does not count, so the block after the embedding and the output
    projection after the norm still get their weights behind a block's compute, or, with no
    compute before them at all, right after the first gather is issued."""
    waits = [_wait_of(g) for g in gathers]
    index = {n: k for k, n in enumerate(graph.nodes)}
    nodes = list(graph.nodes)
    # computes[j]: does the stretch from wait j to wait j + 1 compute anything?
    computes = [a is not None and b is not None and any(_is_compute(n) for n in nodes[index[a] + 1:index[b]])
                for a, b in zip(waits, waits[1:])]
    placed: dict[fx.Node, fx.Node] = {}
    for i in range(1, len(gathers)):
        anchor, stretches = gathers[0], 0
        for j in range(i - 1, -1, -1):
            stretches += computes[j]
            if stretches >= prefetch:
                anchor = waits[j]
                break
        if anchor is None:
            continue
        # Gathers moved to the same anchor keep their order: each goes after the one before.
        original, anchor = anchor, placed.get(anchor, anchor)
        index = {n: k for k, n in enumerate(graph.nodes)}
        if index[gathers[i]] <= index[anchor]:
            continue
        chain = _ancestors_after(gathers[i], index[anchor], index)
        if chain is None:
            continue
        for node in reversed(chain):
            anchor.append(node)  # appending in reverse keeps the chain's order right after anchor
        placed[original] = gathers[i]


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and "wait_tensor" in str(node.target)


def _forward_nodes(gm: fx.GraphModule, loss_output_index: int) -> set[fx.Node]:
    """Every node the loss value depends on: the forward pass and the loss itself."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][loss_output_index]
    seen, todo = set(), [loss]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return seen


def split_graph(gm: fx.GraphModule, mode: str, *, loss_output_index: int) -> fx.GraphModule:
    """Partition `gm` into sequential programs (see the module docstring); "none" returns `gm`.

    Partitions are assigned in graph (topological) order and never depend on a later one, so
    split_module can wire values from one program to the next.
    """
    if mode not in SPLIT_MODES:
        raise ValueError(f"compile.split = {mode!r}; use one of {', '.join(SPLIT_MODES)}")
    if mode == "none":
        return gm
    partition: dict[fx.Node, int] = {}
    if mode == "fwd_bwd":
        forward = _forward_nodes(gm, loss_output_index)
        for node in gm.graph.nodes:
            partition[node] = 0 if node in forward else 1
    else:
        # Waits sit in programs of their own (consecutive waits, and views re-indexing their
        # results, share one): a backend schedules the nodes of one program as it likes, and
        # Inductor's memory-driven order hoisted a wait that ended a program up to just after its
        # collective, undoing the overlap schedule_collectives had set up. A wait right after its
        # own collective (trace order: nothing to overlap) stays with it, as the program's end.
        current, waits_only, filled, previous = 0, False, False, None
        for node in gm.graph.nodes:
            wait = _is_wait(node) or (waits_only and str(node.target) in _VIEW_OPS
                                      and all(partition.get(n) == current for n in node.all_input_nodes))
            if filled and wait != waits_only and not (wait and node.args and node.args[0] is previous):
                current += 1
            waits_only, filled, previous = wait, True, node
            partition[node] = current
    # A multi-output op (the foreach optimizer ops) must sit with its getitems: otherwise a whole
    # list crosses from one program to the next, and compilers want flat tensor outputs. Moving a
    # getitem back to its source's program keeps the order monotonic.
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            partition[node] = partition[node.args[0]]
    split = split_module(gm, None, lambda node: partition[node], keep_original_order=True)
    split.graph.eliminate_dead_code()
    split.recompile()
    return split


class _Compiled(torch.nn.Module):
    """Holds a compiled callable where split_module expects a submodule."""

    def __init__(self, fn, *, single_output: bool):
        super().__init__()
        self.fn = fn
        self.single_output = single_output

    def forward(self, *args):
        out = self.fn(*args)
        return out[0] if self.single_output else out


def _tuple_output(gm: fx.GraphModule) -> bool:
    """Make `gm` return a tuple (what compilers require); True if it returned one bare value."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return False
    output.args = ((output.args[0],),)
    gm.recompile()
    return True


def compile_submodules(split: fx.GraphModule, example_inputs: list, backend) -> fx.GraphModule:
    """Compile each ``submod_i`` of a split graph on its own with `backend(gm, example_inputs)`.

    The example inputs of each program come from propagating the fake example inputs of the
    whole step through the split graph.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = detect_fake_mode(example_inputs)
    FakeTensorProp(split, fake_mode).propagate_dont_convert_inputs(*example_inputs)
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target.startswith("submod_"):
            sub = getattr(split, node.target)
            sub_inputs = [arg.meta["val"] for arg in node.args]
            single = _tuple_output(sub)
            setattr(split, node.target, _Compiled(backend(sub, sub_inputs), single_output=single))
    return split
