"""An Inductor pass: run a scan over flipped stacks as a loop that reads the stacks backwards.

torch's scan autograd (and our own `_ScanRecomputingLayers`) runs the backward of scanned layers
as a scan over *flipped* stacks: every saved activation stack and every stacked weight the backward
reads goes through `torch.flip` (a full copy), and the stacked gradients it writes are flipped back
(another copy of each): data movement a step pays that the unrolled model never does.

This pass, registered as Inductor's post-grad custom pass by graph/compile.py, finds each
``scan(body, init, [flip(x_0), flip(x_1), ...], extra)`` whose xs are all flips of dim 0 and
whose stacked outputs are read only through a flip of dim 0 (or not at all), and lowers it to a
while loop as Inductor's own `decompose_scan_to_while_loop` does, except that iteration i reads
slice ``L-1-i`` of each unflipped ``x`` and writes its outputs into slice ``L-1-i`` of the output
buffers. Those buffers then hold the flipped-back stacks, so the flips on both sides go (the
unused ones die in dead-code elimination). Same body, same slices, same order of iterations: the
values are bitwise those of the flipped form. A scan that does not have this form is left to
Inductor's own lowering.

Counts of what it did are kept in `reverse_scan_stats` (rewritten scans and the flips they made
unnecessary), for tests and benchmarks.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["SCAN_REVERSE", "ReverseScanPass", "drop_body_copies", "mark_reverse_scans", "marked_reverse",
           "reverse_scan_stats", "write_matmuls_into_stacks"]

reverse_scan_stats: Counter = Counter()

# mm(a, b, out=out) as an op Inductor lowers (it refuses aten's out= overloads): a fallback kernel
# that mutates `out`, a slice of a stack the loop owns.
_LIB = torch.library.Library("titan_tpu", "FRAGMENT")
_LIB.define("mm_into(Tensor a, Tensor b, Tensor(a!) out) -> ()")


def _mm_into(a, b, out) -> None:
    torch.mm(a, b, out=out)


_LIB.impl("mm_into", _mm_into, "CompositeExplicitAutograd")
# Fake tensors run it too: the write bumps `out`'s version, which is how Inductor's while-loop
# lowering sees which loop operands the body mutates.
torch.library.register_fake("titan_tpu::mm_into", _mm_into, lib=_LIB)

# aten.flip, or prims.rev as AOTAutograd's decompositions leave it
_FLIPS = (torch.ops.aten.flip.default, torch.ops.prims.rev.default)


def _is_flip_dim0(node) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _FLIPS):
        return False
    dims = list(node.args[1])
    return dims in ([0], [-node.args[0].meta["val"].dim()])


def _stacked_output_users(scan_node: fx.Node, n_carry: int) -> list[list[fx.Node]] | None:
    """For each user getitem of a stacked output (index >= n_carry): its users, if each is a flip
    of dim 0; None if any stacked output is read another way."""
    out = []
    for user in scan_node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        if user.args[1] >= n_carry:
            if not all(_is_flip_dim0(u) for u in user.users):
                return None
            out.append(list(user.users))
    return out


# Views a matmul's output passes through before it is copied into its stack slice.
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _matmul_source(node):
    """The `mm` whose output `node` is (through views), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.ops.aten.mm.default:
        return node
    return None


def _into_stack(y: fx.Node) -> fx.Node | None:
    """The `mm` that can write the stacked output `y` (a view of the product) into its stack slice:
    same dtype, both contiguous (the stack slice has y's strides)."""
    mm = _matmul_source(y)
    if mm is None:
        return None
    slot, product = y.meta.get("val"), mm.meta.get("val")
    if not (isinstance(slot, torch.Tensor) and isinstance(product, torch.Tensor)):
        return None
    if (slot.dtype != product.dtype or slot.device != product.device or slot.numel() != product.numel()
            or not slot.is_contiguous() or not product.is_contiguous()):
        return None
    return mm


def write_matmuls_into_stacks(body: fx.GraphModule) -> int:
    """In a loop body: ``select(stack, 0, i).copy_(view(mm(a, b)))`` -> ``mm_into(a, b, <slice i
    of stack>)``, every other reader of the product reading the slice. The matmul then writes its
    result where the copy put it (one pass less over the data; the values are the same kernel's).
    Returns how many matmuls now write into their stacks."""
    graph = body.graph
    done = 0
    for copy in [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]:
        dst, src = copy.args[:2]
        mm = _into_stack(src) if isinstance(src, fx.Node) else None
        if (mm is None or copy.users or copy.kwargs
                or not (isinstance(dst, fx.Node) and dst.target is torch.ops.aten.select.int
                        and dst.args[0].op == "placeholder")):
            continue
        slot, product = dst.meta["val"], mm.meta["val"]
        # The slot's select reads only the loop index and the stack: it may move up to the matmul.
        with graph.inserting_before(mm):
            slot_node = graph.call_function(torch.ops.aten.select.int, dst.args)
            slot_node.meta.update(dst.meta)
            out = graph.call_function(torch.ops.aten.view.default, (slot_node, list(product.shape)))
            out.meta["val"] = slot.view(product.shape)
            graph.call_function(torch.ops.titan_tpu.mm_into.default, (*mm.args, out))
            written = graph.call_function(torch.ops.aten.view.default, (slot_node, list(product.shape)))
            written.meta["val"] = out.meta["val"]
        mm.replace_all_uses_with(written)
        graph.erase_node(copy)
        graph.erase_node(mm)
        done += 1
    if done:
        graph.eliminate_dead_code()
        body.recompile()
    _check_write_order(body)
    return done


# Copies a functionalised loop body keeps that Inductor runs as eager fallback kernels (one
# dispatch, an allocation and a pass over the data each, per iteration): detach_copy(x) is x in a
# graph that builds no tape, select_copy(x, d, i) is the view select(x, d, i).
_COPY_VIEWS = {torch.ops.aten.detach_copy.default: None, torch.ops.aten.select_copy.int: torch.ops.aten.select.int}


def _written_placeholders(body: fx.GraphModule) -> set[fx.Node]:
    """The body's inputs (loop operands) that some op writes, through views."""
    written = set()
    for node in body.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for arg, schema in zip(node.args, node.target._schema.arguments):
                while isinstance(arg, fx.Node) and arg.op != "placeholder":
                    arg = arg.args[0] if arg.args else None
                if schema.is_write and isinstance(arg, fx.Node):
                    written.add(arg)
    return written


def _is_view(node) -> bool:
    """An op whose result aliases its first argument (select, view, permute, ...)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.args):
        return False
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _written_later(node: fx.Node) -> bool:
    """Whether a reader of `node`, or of a view of it, may write it (an argument it mutates, an op
    we cannot see into), or returns it from the loop body (an output must not alias an input)."""
    for user in node.users:
        if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
            return True
        schema_args = user.target._schema.arguments
        by_name = {a.name: a for a in schema_args}
        passed = [*zip(user.args, schema_args), *((v, by_name.get(k)) for k, v in user.kwargs.items())]
        if any(arg is node and (schema is None or schema.is_write) for arg, schema in passed):
            return True
        if _is_view(user) and user.args[0] is node and _written_later(user):
            return True
    return False


def drop_body_copies(body: fx.GraphModule) -> int:
    """In a loop body: ``detach_copy(x)`` -> ``x`` and ``select_copy(x, d, i)`` -> ``select(x, d,
    i)``, where neither the copy nor its source is written afterwards (x not a view of a stack the
    body writes, no reader mutating the copy, the copy not a loop output). Readers get the same
    values without the copy. Returns how many copies went."""
    graph = body.graph
    written = _written_placeholders(body)
    done = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _COPY_VIEWS]:
        src = node.args[0]
        root = src  # what src is a view of
        while _is_view(root):
            root = root.args[0]
        if node.kwargs or root in written or _written_later(node):
            continue
        view = _COPY_VIEWS[node.target]
        if view is None:
            replacement = src
        else:
            with graph.inserting_before(node):
                replacement = graph.call_function(view, node.args)
            replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        done += 1
    if done:
        body.recompile()
    return done


def _check_write_order(body: fx.GraphModule) -> None:
    """Inductor's while-loop lowering pairs the body's mutated operands with its outputs in the
    order the body first writes them: that order must be the operands' own."""
    placeholders = {n: i for i, n in enumerate(body.graph.find_nodes(op="placeholder"))}
    first = []
    for node in body.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for arg, schema in zip(node.args, node.target._schema.arguments):
                while isinstance(arg, fx.Node) and arg not in placeholders:
                    arg = arg.args[0] if arg.args else None
                if schema.is_write and arg in placeholders and placeholders[arg] not in first:
                    first.append(placeholders[arg])
    if first != sorted(first):
        raise AssertionError(f"scan loop body writes its stacks out of order {first}: Inductor would mix them up")


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """Lower one scan node to a while loop (reading its stacks backwards where its xs are all
    flips of dim 0 and its stacked outputs are read only through flips); returns the loop's body."""
    from torch._higher_order_ops.scan import _extract_carry_and_out
    from torch._inductor.fx_passes.post_grad import resolve_shape_to_proxy
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, MatchContext
    from torch.utils import _pytree as pytree

    combine_subgraph, fx_init, fx_xs, fx_additional = node.args
    if node.kwargs or not fx_xs:
        return None
    n_carry = len(fx_init)
    output_flips = _stacked_output_users(node, n_carry) if all(_is_flip_dim0(x) for x in fx_xs) else None
    reverse = output_flips is not None
    sub_gm: fx.GraphModule = getattr(gm, combine_subgraph.target)
    _, ys_outputs = _extract_carry_and_out(node.meta["val"], n_carry)
    unflipped_xs = [x.args[0] for x in fx_xs] if reverse else list(fx_xs)
    # The loop's stacks in the order the body will first write them (see `_check_write_order`):
    # those a matmul writes in place (write_matmuls_into_stacks) where the matmul runs, then the
    # others, copied at the end of the body.
    body_nodes = {n: i for i, n in enumerate(sub_gm.graph.nodes)}
    y_nodes = pytree.tree_leaves(sub_gm.graph.find_nodes(op="output")[0].args[0])[n_carry:]
    seen, keys = set(), []
    for j, y in enumerate(y_nodes):
        mm = _into_stack(y) if isinstance(y, fx.Node) else None
        keys.append((0, body_nodes[mm]) if mm is not None and mm not in seen else (1, j))
        seen.add(mm)
    order = sorted(range(len(ys_outputs)), key=keys.__getitem__)
    args, tree_spec = pytree.tree_flatten((list(fx_init), unflipped_xs, list(fx_additional)))

    def reversed_loop(*flat):
        init, xs, additional = pytree.tree_unflatten(flat, tree_spec)
        length = xs[0].size(0)
        bound = {a.node.expr: a for a in pytree.tree_leaves((flat, length)) if isinstance(a, torch.SymInt)}
        ys_bufs = [torch.empty_strided(resolve_shape_to_proxy(y.size(), bound),
                                       resolve_shape_to_proxy(y.stride(), bound),
                                       device=y.device, dtype=y.dtype, layout=y.layout)
                   for y in (ys_outputs[k] for k in order)]
        loop_idx = torch.zeros([], dtype=torch.int64, device=torch.device("cpu"))
        operands = (loop_idx, ys_bufs, init, xs)
        flat_operands, operands_spec = pytree.tree_flatten(operands)
        _, with_additional_spec = pytree.tree_flatten((*operands, additional))

        def cond_fn(*a):
            return pytree.tree_unflatten(a, with_additional_spec)[0] < length

        def body_fn(*a):
            idx, bufs, carry, xs_, extra = pytree.tree_unflatten(a, with_additional_spec)
            i = idx.item()
            torch.ops.aten._assert_scalar.default(i >= 0, "")
            torch.ops.aten._assert_scalar.default(i < length, "")
            layer = length - 1 - i if reverse else i  # iteration i of the flipped scan reads slice i of flip(x)
            sub_xs = [torch.ops.aten.select.int(x, 0, layer) for x in xs_]
            next_carry, ys = _extract_carry_and_out(sub_gm(*carry, *sub_xs, *extra), n_carry)
            for k, buf in zip(order, bufs):
                torch.ops.aten.select.int(buf, 0, layer).copy_(ys[k])
            return idx + 1, *bufs, *next_carry, *xs_

        _, ys_out, last_carry, _ = pytree.tree_unflatten(
            torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(flat_operands), tuple(additional)),
            operands_spec)
        in_order = [None] * len(order)
        for k, y in zip(order, ys_out):
            in_order[k] = y
        return [*last_carry, *in_order]  # reversed: ys_out in layer order, what flip(scan's ys) was

    # One matched node, as Inductor's pattern matcher would hand it to decompose_scan_to_while_loop.
    pattern = CallFunctionVarArgs(torch.ops.higher_order.scan)
    match = Match(MatchContext([pattern], {pattern: node}, graph=gm.graph), pattern)
    match.nodes = [node]
    before = set(gm.graph.nodes)
    match.replace_by_example(reversed_loop, args, run_functional_passes=False)
    (loop,) = [n for n in gm.graph.nodes if n not in before and n.target is torch.ops.higher_order.while_loop]
    if reverse:
        # The getitems of the stacked outputs now read the layer-ordered buffers: their flips are the result.
        for flips in output_flips:
            for flip in flips:
                flip.replace_all_uses_with(flip.args[0])
                gm.graph.erase_node(flip)
        reverse_scan_stats["scans"] += 1
        reverse_scan_stats["flips_removed"] += len(fx_xs) + sum(len(f) for f in output_flips)
    else:
        reverse_scan_stats["forward_scans"] += 1
    return getattr(gm, loop.args[1].target)


# TorchTPU's mark for a scan to run in reverse (torch_tpu/_internal/compile/scan.py,
# SCAN_REVERSE_ANNOTATION): read from the "custom" meta of the body's nodes, where
# `torch.fx.traceback.annotate` puts it. Step i of the loop then reads and writes row L-1-i.
SCAN_REVERSE = "torch_tpu_scan_reverse"


def mark_reverse_scans(gm: fx.GraphModule) -> int:
    """The TPU form of this module's pass, on the captured graph: each ``scan`` whose xs are all
    flips of dim 0 and whose stacked outputs are read only through flips of dim 0 takes the
    unflipped stacks, its outputs' flips go, and it is marked to run in reverse (`SCAN_REVERSE`)
    on the scan node and on every node of its body. TorchTPU builds such a scan as a reverse
    `stablehlo.while` loop (on a TPU each flip is a full copy of a stack); the JAX lowering reads
    the same mark (graph/jax_lowering.py). The mark on the scan node is what carries it through a
    re-trace of the graph (make_fx with preserved node meta gives the body's new nodes the meta of
    the node being run). Same body, same slices, same order of iterations. Returns how many scans
    were marked. Only for a backend that reads the mark: any other would run the loop forwards."""
    marked = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]:
        body, init, xs, additional = node.args
        if node.kwargs or not xs or not all(_is_flip_dim0(x) for x in xs):
            continue
        output_flips = _stacked_output_users(node, len(init))
        if output_flips is None:
            continue
        node.args = (body, init, [x.args[0] for x in xs], additional)
        for flips in output_flips:
            for flip in flips:
                flip.replace_all_uses_with(flip.args[0])
                gm.graph.erase_node(flip)
        node.meta.setdefault("custom", {})[SCAN_REVERSE] = True
        for body_node in getattr(gm, body.target).graph.nodes:
            body_node.meta.setdefault("custom", {})[SCAN_REVERSE] = True
        marked += 1
    if marked:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return marked


def marked_reverse(body: fx.GraphModule) -> bool:
    """Whether a scan body carries `SCAN_REVERSE` (as TorchTPU reads it)."""
    return any(n.meta.get("custom", {}).get(SCAN_REVERSE, False) for n in body.graph.nodes)


class ReverseScanPass(CustomGraphPass):
    """Inductor post-grad custom pass (torch._inductor.config.post_grad_custom_post_pass)."""

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        scans = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]
        bodies = [body for body in (_rewrite(gm, n) for n in scans) if body is not None]
        if not bodies:
            return
        for body in bodies:
            reverse_scan_stats["matmuls_into_stacks"] += write_matmuls_into_stacks(body)
            reverse_scan_stats["copies_dropped"] += drop_body_copies(body)
        graph.eliminate_dead_code()
        gm.recompile()

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
