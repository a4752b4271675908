"""Tensor parallelism with sequence parallelism (Megatron layout) on the `tp` mesh axis.

Parameters (their DTensor placement on the tp axis, `TP_PLACEMENT` on the module):

    tok_embeddings          Shard(0)   row-parallel over the vocabulary
    attention.wq/wk/wv      Shard(0)   column-parallel: each rank owns H/tp query and K/tp kv heads
    attention.wo            Shard(1)   row-parallel: partial sums of the block's output
    MLA wq or wq_b, wkv_b   Shard(0)   column-parallel by heads (multi-head latent attention)
    MLA wq_a, wkv_a         Replicate  the low-rank down-projections, whole on every rank
    feed_forward.w1/w3      Shard(0)   column-parallel over the hidden dim F
    feed_forward.w2         Shard(1)   row-parallel
    output                  Shard(0)   column-parallel over the vocabulary
    every norm (q/k norms)  Replicate  their gradients are partial sums, all-reduced over tp

Activations between blocks are sharded on the sequence ([B, S/tp, D]: sequence parallelism), so
the norms and residual adds run on a rank's own S/tp tokens. Before attention and before the
feed-forward the sequence is all-gathered ([B, S, D]); their row-parallel outputs are partial sums
that are reduce-scattered back onto the sequence shards. Each collective's backward is the other
one. The embedding looks up the tokens of its own vocabulary rows (zeros elsewhere) and its partial
sums are reduce-scattered the same way; after the final norm the sequence is gathered once more and
the loss kernel computes a vocabulary-parallel cross-entropy on the local logits [N, V/tp] (one
max and two sums over tp per chunk), so the logits are never gathered.

The model code stays single-device: this module sets the local head counts on each attention
module, adds forward hooks for the sequence collectives, swaps the embedding's class for one whose
forward is vocabulary-parallel, and hands the model a loss kernel bound to its vocabulary shard.
The collectives are functional collectives (`_c10d_functional` ops) inside autograd Functions,
so a traced step (graph/capture.py) holds them as graph nodes. SimpleFSDP (simple_fsdp.py) stores
the parameters as DTensors on the whole mesh and, when a module reads a weight, gathers the
data-parallel axes only: the module computes with its tp shard as a plain tensor.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from titan_tpu.parallel.axes import TP_AXIS
from titan_tpu.parallel.group_rank import rank_in

__all__ = ["TP_AXIS", "TP_PLACEMENT", "check_tensor_parallel", "reduce_scatter_along", "tensor_parallel",
           "tp_placement"]

TP_PLACEMENT = "_tp_placement"  # module attribute: the tp placement of the module's own parameters


def tp_placement(module: nn.Module) -> Placement:
    """The placement of `module`'s parameters on the tp axis (Replicate unless the plan shards them)."""
    return module.__dict__.get(TP_PLACEMENT, Replicate())


def check_tensor_parallel(args, tp: int, *, seq_len: int | None = None) -> None:
    """One-line ValueErrors for a model (TransformerArgs) that `tp` ranks cannot split evenly."""
    if tp < 1:
        raise ValueError(f"--parallelism.tp must be >= 1, got {tp}")
    if tp == 1:
        return
    # An MoE model's routed and shared experts run on the rank's sequence shard, whole (expert
    # parallelism, not tp, divides them): only its dense blocks' feed-forward is split by tp.
    dense_ffn = getattr(args, "moe", None) is None or any(not args.is_moe_layer(i) for i in range(args.n_layers))
    for key, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                       *((("ffn_hidden_dim", args.ffn_hidden_dim),) if dense_ffn else ()),
                       ("vocab_size", args.vocab_size)):
        if value % tp != 0:
            raise ValueError(f"--parallelism.tp ({tp}) must divide the model's {key} ({value}); "
                             "choose a tp that divides it")
    if seq_len is not None and seq_len % tp != 0:
        raise ValueError(f"--parallelism.tp ({tp}) must divide --training.seq_len ({seq_len}): "
                         "activations are sharded on the sequence between blocks")


# ---------------------------------------------------------------------------------------------
# Sequence collectives with their backward
# ---------------------------------------------------------------------------------------------


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


# The Functions below take their context in `setup_context`, apart from `forward`: torch.func
# transforms (the vjp in scan's recomputing backward, models/common/scan.py) only accept
# autograd Functions written that way.


class _GatherAlong(torch.autograd.Function):
    """Gather dim `dim` over the group ([B, S/tp, D] -> [B, S, D] with dim 1: the sequence; ep's
    token rows with dim 0); backward: reduce-scatter (sum) of the gradient's partial sums."""

    @staticmethod
    def forward(x, group, dim):
        return _wait(funcol.all_gather_tensor(x.contiguous(), dim, group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.dim, ctx.group)), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    """Partial sums summed over the group and scattered on dim `dim` ([B, S, D] -> [B, S/tp, D] with
    dim 1); backward: all-gather of the gradient."""

    @staticmethod
    def forward(x, group, dim):
        return _wait(funcol.reduce_scatter_tensor(x.contiguous(), "sum", dim, group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.all_gather_tensor(grad.contiguous(), ctx.dim, ctx.group)), None, None


class _SumOverGroup(torch.autograd.Function):
    """Each rank's partial loss -> the sum over the group; backward: identity (every rank's
    gradient flows into its own share). Context parallelism sums the loss and the routing
    statistics with it, tensor parallelism the routing statistics."""

    @staticmethod
    def forward(x, group):
        return _wait(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # the backward needs nothing (torch.func wants forward and context apart, see tensor_parallel.py)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reduce_scatter_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """`x` summed over `group`, each rank keeping its 1 / size of dim `dim` (pipeline stages share
    out the last stage's outputs with it too); the gradient is all-gathered back."""
    return _ReduceScatterAlong.apply(x, group, dim)


def _gather_input(group, module, args):
    return (_GatherAlong.apply(args[0], group, 1), *args[1:])


def _reduce_scatter_output(group, module, args, output):
    return _ReduceScatterAlong.apply(output, group, 1)


def _gather_output(group, module, args, output):
    return _GatherAlong.apply(output, group, 1)


def _gather_logits(group, module, args, output):
    # model(tokens) without labels: each rank computed its vocabulary columns of the logits.
    if isinstance(output, torch.Tensor):
        return _wait(funcol.all_gather_tensor(output.contiguous(), output.dim() - 1, group))
    return output


# ---------------------------------------------------------------------------------------------
# Vocabulary-parallel embedding and loss
# ---------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding whose weight (as read) holds rows [start, start + V/tp) of the vocabulary, start
    = the rank on tp times V/tp: tokens outside them look up zeros, and the partial sums are
    reduce-scattered onto the sequence shards."""

    _tp_group: object
    _tp_rank: int

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        w_vD = self.weight
        local_BS = tokens_BS - _vocab_start(self._tp_group, self._tp_rank, w_vD.shape[0])
        mine_BS = (local_BS >= 0) & (local_BS < w_vD.shape[0])
        h_BSD = F.embedding(torch.where(mine_BS, local_BS, 0), w_vD).masked_fill(~mine_BS.unsqueeze(-1), 0.0)
        return _ReduceScatterAlong.apply(h_BSD, self._tp_group, 1)


def _vocab_start(group, rank: int, shard_rows: int) -> int | torch.Tensor:
    """The first vocabulary row of this rank's shard: an int, or in a step captured as one program
    for every rank the rank's group_rank op times the shard's rows (parallel/group_rank.py)."""
    return rank_in(group, rank) * shard_rows


class _VocabParallelKernels:
    """The model's KernelConfig, with the loss kernel bound to this rank's vocabulary shard."""

    def __init__(self, kernels, *, rank: int, shard_rows: int, group):
        self._kernels, self._rank, self._shard_rows, self._group = kernels, rank, shard_rows, group

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_kernels", "_rank", "_shard_rows", "_group"):
            raise AttributeError(name)  # copy/pickle probe these before __init__ has run
        return getattr(self._kernels, name)

    def loss_fn(self, device_type: str):
        from titan_tpu.kernels.loss import chunked_linear_cross_entropy

        start = _vocab_start(self._group, self._rank, self._shard_rows)
        return functools.partial(chunked_linear_cross_entropy, chunk_tokens=self._kernels.loss_chunk_tokens,
                                 vocab_shard=(start, self._group))


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


# The plan: module paths -> the tp placement of their weights. Shard(0) splits a linear's output
# features (column-parallel: q, k, v and the gate and up projections, one head or hidden unit per
# rank), Shard(1) its input features (row-parallel: the attention output and down projections,
# whose partial sums the block's reduce-scatter adds). Paths are relative to a block, or to the
# model for the vocabulary-parallel embedding and output projection; per layer, SimpleFSDP shifts
# a stacked weight's placement one dim in (simple_fsdp._module_placements).
FEED_FORWARD_PLAN: dict[str, Placement] = {
    "feed_forward.w1": Shard(0), "feed_forward.w3": Shard(0), "feed_forward.w2": Shard(1),
}
BLOCK_PLAN: dict[str, Placement] = {
    "attention.wq": Shard(0), "attention.wk": Shard(0), "attention.wv": Shard(0), "attention.wo": Shard(1),
    **FEED_FORWARD_PLAN,
}
# Multi-head latent attention (models/common/mla.py): the per-head projections split by heads
# (the query, full-rank wq or the low-rank query's up-projection wq_b, and the key-value
# up-projection wkv_b, column-parallel; wo row-parallel). The down-projections wq_a and wkv_a
# (with their norms q_norm and kv_norm) stay whole on every rank: their outputs are small (the
# ranks q_lora_rank and kv_lora_rank, 1536 and 512 on 671B, against 128 heads x 192) and every
# head reads all of them, so splitting them would only add a gather; wkv_a's decoupled RoPE key
# is shared by all heads. Their gradients are partial sums over the rank's heads, all-reduced.
MLA_BLOCK_PLAN: dict[str, Placement] = {
    "attention.wq": Shard(0), "attention.wq_a": Replicate(), "attention.wq_b": Shard(0),
    "attention.wkv_a": Replicate(), "attention.wkv_b": Shard(0), "attention.wo": Shard(1),
    **FEED_FORWARD_PLAN,
}
MODEL_PLAN: dict[str, Placement] = {"tok_embeddings": Shard(0), "output": Shard(0)}


def _set_placement(module: nn.Module | None, placement: Placement) -> None:
    if module is not None:
        module.__dict__[TP_PLACEMENT] = placement


def _apply_plan(root: nn.Module, plan: dict[str, Placement]) -> None:
    """Set each planned module's placement; a path whose module is None (an absent projection) is
    skipped, an attribute the model does not have is an error."""
    for path, placement in plan.items():
        module = root
        for name in path.split("."):
            module = getattr(module, name) if module is not None else None
        _set_placement(module, placement)


def block_plan(args) -> dict[str, Placement]:
    """The plan of a model's blocks: `MLA_BLOCK_PLAN` with multi-head latent attention, else
    `BLOCK_PLAN`."""
    return BLOCK_PLAN if getattr(args, "mla", None) is None else MLA_BLOCK_PLAN


def _place_block_weights(block: nn.Module, plan: dict[str, Placement]) -> None:
    """The tp placements of a block's weights (or of a scanned stack's). An MoE block's dense
    feed-forward is None, and a scanned stack (models/common/scan.py StackedBlocks) keeps only the
    submodules its block has: its paths are skipped."""
    _apply_plan(block, {path: placement for path, placement in plan.items()
                        if getattr(block, path.split(".")[0], None) is not None})


def _parallelize_block(block: nn.Module, group, tp: int, plan: dict[str, Placement]) -> list:
    """A block that computes: its weights' placements, local head counts, sequence collectives.

    An MoE block's experts (`block.moe`) run between the sequence collectives, on the rank's S / tp
    tokens, with their weights whole on tp (expert_parallel.py says why): each tp rank routes its own
    tokens, and its routing statistics are summed over tp so that the balancing loss, the expert
    loads and the bias update see the whole sequence, as on one process."""
    attn, ffn = block.attention, block.feed_forward
    _place_block_weights(block, plan)
    attn.n_heads //= tp
    if hasattr(attn, "n_kv_heads"):  # MLA has no separate key-value heads
        attn.n_kv_heads //= tp
    handles = []
    for module in (attn, ffn) if ffn is not None else (attn,):
        handles.append(module.register_forward_pre_hook(functools.partial(_gather_input, group)))
        handles.append(module.register_forward_hook(functools.partial(_reduce_scatter_output, group)))
    if getattr(block, "moe", None) is not None:
        handles.append(block.moe.register_forward_hook(functools.partial(_sum_routing_statistics, group)))
    return handles


def _sum_routing_statistics(group, module, args, output):
    """Forward hook on an MoE layer: its routing statistics [2, E] summed over tp (backward:
    identity, a rank's router probabilities get the gradient of its own tokens)."""
    out_BSD, stats_2E = output
    return out_BSD, _SumOverGroup.apply(stats_2E, group)


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, seq_len: int | None = None) -> nn.Module:
    """Apply the plan above to a (meta-device, not yet distributed) Transformer in place; its
    parameters are then distributed by `materialize_and_init` / `data_parallel` on `mesh`, whose
    `tp` axis they are sharded on. Returns the model."""

    names = mesh.mesh_dim_names or ()
    if TP_AXIS not in names:
        raise ValueError(f"tensor_parallel needs a mesh with a {TP_AXIS!r} axis, got {names}; build it with "
                         "ParallelDims(tp=...)")
    tp = mesh.size(names.index(TP_AXIS))
    args = model.args
    check_tensor_parallel(args, tp, seq_len=seq_len)
    if model.kernels.loss not in ("auto", "chunked"):
        raise ValueError(f"--parallelism.tp > 1 computes a vocabulary-parallel loss in the chunked kernel; set "
                         f"--kernels.loss chunked (got {model.kernels.loss!r})")
    group = mesh.get_group(TP_AXIS)
    rank = mesh.get_local_rank(TP_AXIS)
    plan = block_plan(args)
    if model.scan_layers:
        # Each stack (a StackedBlocks) only stores the weights; its template block,
        # which the scan body runs, computes.
        for _, stack in model.stacks():  # one, or one per run of identical blocks
            _place_block_weights(stack, plan)
        unrolled = []
    else:
        unrolled = list(model.layers.values())
    for block in [*unrolled, *model.block_templates()]:
        _parallelize_block(block, group, tp, plan)
    model.tok_embeddings.__class__ = VocabParallelEmbedding
    model.tok_embeddings._tp_group = group
    model.tok_embeddings._tp_rank = rank
    _apply_plan(model, MODEL_PLAN)
    model.norm.register_forward_hook(functools.partial(_gather_output, group))
    model.register_forward_hook(functools.partial(_gather_logits, group))
    model.kernels = _VocabParallelKernels(model.kernels, rank=rank, shard_rows=args.vocab_size // tp, group=group)
    return model


def tp_size(mesh: DeviceMesh | None) -> int:
    """Size of the mesh's tp axis (1 without one)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index(TP_AXIS)) if TP_AXIS in names else 1
