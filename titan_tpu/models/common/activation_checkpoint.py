"""Activation checkpointing of transformer blocks: trade recomputation for activation memory.

Modes (`--activation_checkpoint.mode`):

* ``none``: autograd keeps every intermediate the backward needs.
* ``full``: only each block's input is kept; the whole block is run again during the backward.
* ``selective``: inside each block, the outputs of the ops in `SAVED_OPS` (matmuls and
  attention: the expensive ones) are kept and everything else (norms, RoPE, SwiGLU's pointwise
  ops, casts) is recomputed. Saves the many elementwise intermediates for a fraction of a
  forward's cheap ops.

Two mechanisms, one policy:

* Run eagerly, a checkpointed block is `torch.utils.checkpoint` (non-reentrant; selective mode
  with a selective-checkpoint policy): autograd drops the block's intermediates and reruns it in
  the backward.
* Traced (the graph trainer's make_fx capture, and the body of a scanned layer, which torch's
  scan always traces), the block runs under `_RecomputeTagger`: every op it records is tagged in
  node.meta with the policy ("recompute": MUST_SAVE for `SAVED_OPS` in selective mode, else
  PREFER_RECOMPUTE; ops that may draw random numbers, like SDPA, are saved) and the block's
  region id ("ac_graph_id"), the tags torch.compile's own
  checkpointing uses. The compiler side acts on them: the graph trainer's `rematerialize` pass
  (graph/passes.py) copies tagged forward ops into the backward where they are used, and scan's
  forward/backward partitioner recomputes tagged ops of its body instead of saving them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.fx.traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_tpu.tracing import is_tracing

__all__ = ["AC_MODES", "SAVED_OPS", "checkpointed"]

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: matmuls and fused attention (what is costly to
# recompute). Everything else in a block is elementwise or a reduction over one row.
SAVED_OPS = frozenset({
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})

# One region id per checkpointed block call: the partitioners keep a value that one region
# produces and a later region consumes (the block boundary) rather than recomputing across it.
_region_ids = itertools.count()


def _policy(mode: str, func) -> CheckpointPolicy:
    if mode == "selective" and func in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        # Ops that may draw random numbers (SDPA, for its dropout) are kept even in full mode
        # when traced: the graph rematerialization pass cannot replay them. Costs one [B, S, D]
        # attention output (and its logsumexp) per block over "keep only the block input".
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return _policy("selective", func)


class _RecomputeTagger(TorchDispatchMode):
    """While tracing a block: each recorded op gets node.meta["recompute"] and ["ac_graph_id"]."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.region = next(_region_ids)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The tracer below us copies these fields of current_meta into the node it creates.
        fx_traceback.current_meta["recompute"] = _policy(self.mode, func)
        fx_traceback.current_meta["ac_graph_id"] = self.region
        return func(*args, **(kwargs or {}))


def checkpointed(fn: Callable, mode: str) -> Callable:
    """`fn` itself for mode none; else `fn` whose intermediates are recomputed in the backward."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return fn

    @functools.wraps(fn)
    def run(*args):
        if is_tracing():
            # preserve_node_meta makes the tracer copy current_meta into nodes; it restores
            # current_meta on exit, so the tags end with the block.
            with fx_traceback.preserve_node_meta(), _RecomputeTagger(mode):
                return fn(*args)
        context = {}
        if mode == "selective":
            context["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(fn, *args, use_reentrant=False, **context)

    return run
