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

__all__ = ["ReverseScanPass", "reverse_scan_stats"]

reverse_scan_stats: Counter = Counter()

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


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> bool:
    from torch._higher_order_ops.scan import _extract_carry_and_out
    from torch._inductor.fx_passes.post_grad import resolve_shape_to_proxy
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, MatchContext
    from torch.utils import _pytree as pytree

    combine_subgraph, fx_init, fx_xs, fx_additional = node.args
    if node.kwargs or not fx_xs or not all(_is_flip_dim0(x) for x in fx_xs):
        return False
    n_carry = len(fx_init)
    output_flips = _stacked_output_users(node, n_carry)
    if output_flips is None:
        return False
    sub_gm: fx.GraphModule = getattr(gm, combine_subgraph.target)
    _, ys_outputs = _extract_carry_and_out(node.meta["val"], n_carry)
    unflipped_xs = [x.args[0] for x in fx_xs]
    args, tree_spec = pytree.tree_flatten((list(fx_init), unflipped_xs, list(fx_additional)))

    def reversed_loop(*flat):
        init, xs, additional = pytree.tree_unflatten(flat, tree_spec)
        length = xs[0].size(0)
        bound = {a.node.expr: a for a in pytree.tree_leaves((flat, length)) if isinstance(a, torch.SymInt)}
        ys_bufs = [torch.empty_strided(resolve_shape_to_proxy(y.size(), bound),
                                       resolve_shape_to_proxy(y.stride(), bound),
                                       device=y.device, dtype=y.dtype, layout=y.layout) for y in ys_outputs]
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
            layer = length - 1 - i  # iteration i of the flipped scan reads slice i of flip(x)
            sub_xs = [torch.ops.aten.select.int(x, 0, layer) for x in xs_]
            next_carry, ys = _extract_carry_and_out(sub_gm(*carry, *sub_xs, *extra), n_carry)
            for y, buf in zip(ys, bufs):
                torch.ops.aten.select.int(buf, 0, layer).copy_(y)
            return idx + 1, *bufs, *next_carry, *xs_

        _, ys_out, last_carry, _ = pytree.tree_unflatten(
            torch.ops.higher_order.while_loop(cond_fn, body_fn, tuple(flat_operands), tuple(additional)),
            operands_spec)
        return [*last_carry, *ys_out]  # ys_out in layer order: what flip(scan's ys) was

    # One matched node, as Inductor's pattern matcher would hand it to decompose_scan_to_while_loop.
    pattern = CallFunctionVarArgs(torch.ops.higher_order.scan)
    match = Match(MatchContext([pattern], {pattern: node}, graph=gm.graph), pattern)
    match.nodes = [node]
    match.replace_by_example(reversed_loop, args, run_functional_passes=False)
    # The getitems of the stacked outputs now read the layer-ordered buffers: their flips are the result.
    for flips in output_flips:
        for flip in flips:
            flip.replace_all_uses_with(flip.args[0])
            gm.graph.erase_node(flip)
    reverse_scan_stats["scans"] += 1
    reverse_scan_stats["flips_removed"] += len(fx_xs) + sum(len(f) for f in output_flips)
    return True


class ReverseScanPass(CustomGraphPass):
    """Inductor post-grad custom pass (torch._inductor.config.post_grad_custom_post_pass)."""

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        scans = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan]
        if not any([_rewrite(gm, n) for n in scans]):
            return
        graph.eliminate_dead_code()
        gm.recompile()

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
