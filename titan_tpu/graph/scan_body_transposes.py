"""An Inductor pass: matmuls inside a scan body read a transposed operand as a view, not a copy.

torch's scan autograd functionalises the body it partitions, and functionalisation turns the
body's views into copy ops (`t` / `permute` become `permute_copy`, which decomposes to
``clone(permute(x), memory_format=contiguous)``). A block's ``x @ W^T`` therefore copied every
matmul weight of its layer into a fresh buffer on each iteration of the forward loop (and the
backward's ``grad_y^T @ x`` copied grad_y): per layer and step a full copy of the layer's weights
that the unrolled model, whose ``mm`` reads the transposed view in place, never makes.

This pass, run by graph/compile.py as part of Inductor's post-grad custom pass, finds in every
scan body ``clone(permute(x))`` whose only readers are matrix operands of ``mm`` / ``bmm`` /
``addmm`` and lets those read ``permute(x)`` directly (the matmul kernels take any strides; the
values are the same, only the operand's memory layout differs). Counts in
`scan_body_transpose_stats`.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx

__all__ = ["drop_transpose_copies", "scan_body_transpose_stats"]

scan_body_transpose_stats: Counter = Counter()

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def _is_transpose_copy(node: fx.Node) -> bool:
    """clone(permute(x)) that only reorders the last two dims, read only as a matmul operand."""
    if not (node.op == "call_function" and node.target is torch.ops.aten.clone.default):
        return False
    src = node.args[0]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and src.target is torch.ops.aten.permute.default):
        return False
    dims = list(src.args[1])
    n = len(dims)
    if n < 2 or dims != [*range(n - 2), n - 1, n - 2]:
        return False
    # mm(a, b) / bmm(a, b): both operands are matrices; addmm(bias, a, b): not the bias.
    return all(user.target in _MATMULS and not (user.target is torch.ops.aten.addmm.default and user.args[0] is node)
               for user in node.users)


def drop_transpose_copies(gm: fx.GraphModule) -> int:
    """Rewrite every scan body of `gm` (the subgraphs its scan nodes call); returns how many
    copies were dropped."""
    bodies = {n.args[0].target for n in gm.graph.nodes
              if n.op == "call_function" and n.target is torch.ops.higher_order.scan}
    dropped = 0
    for name in sorted(bodies):
        body: fx.GraphModule = getattr(gm, name)
        copies = [n for n in body.graph.nodes if _is_transpose_copy(n)]
        for node in copies:
            node.replace_all_uses_with(node.args[0])
            body.graph.erase_node(node)
        if copies:
            body.recompile()
        dropped += len(copies)
    scan_body_transpose_stats["copies_dropped"] += dropped
    return dropped
