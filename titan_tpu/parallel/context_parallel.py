"""Context parallelism on the `cp` mesh axis: each rank holds a load-balanced share of every sequence.

Head-tail layout: a sequence of S tokens is cut into 2 * cp chunks of S / (2 cp), and cp rank r
holds chunks r and 2 cp - 1 - r. Under the causal mask an early chunk attends to few keys and a
late one to many, so each rank gets one of each and the same number of (query, key) pairs:

    cp 2, S 8:   positions 0 1 | 2 3 | 4 5 | 6 7     rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5

The cp ranks of one data-parallel rank read the same batch (the loader is sharded over the
data-parallel axes only, as for tensor parallelism). The plan, applied to the model before it is
initialised, keeps the model code single-device:

- a forward pre-hook on the model keeps the rank's tokens and labels and hands the model the
  global positions of those tokens (RoPE) and their document ids (from the whole sequence's
  positions, so a document crossing shards keeps one id);
- each attention module all-gathers keys and values over cp (and the document ids, with document
  masks), puts them in sequence order, and computes each of the rank's two chunks with the
  `chunk_attention` kernel (kernels/attention.py) against the keys up to the chunk's end: chunk
  i (of 2 cp) sees the first (i + 1) S / (2 cp) keys, causally aligned to the lower right, within
  its documents. No rank builds a mask over the whole sequence: the TPU (splash, its causal mask
  offset) and CUDA (flex, a block mask) kernels skip the masked blocks themselves, and the work of
  the two chunks sums to the same on every rank. The gather's backward is a reduce-scatter: a rank
  gets the gradient of its keys and values summed over every rank's queries;
- a forward hook sums the loss of the rank's tokens over cp (backward: identity), so every cp
  rank holds the batch's whole loss as tensor-parallel peers do (train/step.py: model_copies);
  `model(tokens)` without labels gathers the logits and puts them back in sequence order;
- a forward hook on each MoE layer sums its routing statistics over cp in the same way, so the
  balancing loss, the expert loads and the expert-bias update are those of the whole batch.

Parameters are replicated over cp (simple_fsdp._placements): each rank's gradient covers its own
tokens, a partial sum that SimpleFSDP all-reduces over cp like a data-parallel axis. The
collectives are functional collectives inside autograd Functions, so a captured step holds them
as graph nodes.

One program for every rank (a step captured for the JAX lowering, tracing.py
`one_program_for_every_rank`): the rank is then the group_rank op (parallel/group_rank.py, the mesh
axis index once lowered), not a number, and no shape may depend on it. The rank's positions are
computed from it, and each chunk attends to the keys up to the furthest end it has on any rank
(the first S / 2 for a head chunk, all S for a tail chunk) with its causal offset a value
(chunk_attention's q_start), the keys past its own end masked rather than cut off: the same shapes
on every rank. The trainer keeps its per-rank prefixes (the same numbers, fewer keys per chunk).

With tensor parallelism (cp x tp, tp the inner axis; tensor_parallel.py applied first) the two
plans nest without knowing of each other: the pre-hook above cuts the sequence to the rank's
S / cp tokens, and tp's sequence parallelism shards those further between blocks and gathers them
back to S / cp before attention and the feed-forward. So attention sees the rank's S / cp tokens
with its H / tp heads, the positions and document ids this hook computed (for S / cp tokens)
still describe them, and the gather over cp joins the keys and values of the same heads. The
loss is tp's vocabulary-parallel one over the rank's S / cp tokens, summed over cp here.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.kernels import document_ids_from_positions
from titan_tpu.kernels.registry import Impl
from titan_tpu.parallel.axes import CP_AXIS
from titan_tpu.parallel.group_rank import rank_in
from titan_tpu.parallel.tensor_parallel import _GatherAlong, _SumOverGroup, _wait, tp_size

__all__ = ["CP_AXIS", "check_context_parallel", "context_parallel", "cp_attention_saved_bytes", "cp_size",
           "head_tail_attention", "head_tail_positions", "sequence_order"]


def check_context_parallel(cp: int, *, seq_len: int, tp: int = 1) -> None:
    """One-line ValueError when `cp` ranks cannot split `seq_len` into 2 * cp equal chunks, or
    (with tensor parallelism) `tp` ranks cannot split a cp rank's S / cp tokens between blocks."""
    if cp < 1:
        raise ValueError(f"--parallelism.cp must be >= 1, got {cp}")
    if cp > 1 and seq_len % (2 * cp) != 0:
        raise ValueError(f"--parallelism.cp ({cp}) needs --training.seq_len ({seq_len}) divisible by 2 * cp = "
                         f"{2 * cp} (each rank holds 2 of 2 * cp equal chunks); change seq_len or cp")
    if cp > 1 and (seq_len // cp) % tp != 0:
        raise ValueError(f"--parallelism.cp ({cp}) x tp ({tp}) needs --training.seq_len / cp ({seq_len // cp}) "
                         "divisible by tp (a cp rank's tokens are sharded over tp between blocks); change seq_len")


def head_tail_positions(seq_len: int, cp: int, rank: int | Tensor, device=None) -> Tensor:
    """Global positions [S / cp] of the tokens cp rank `rank` holds: chunks rank and 2 cp - 1 - rank.
    rank: an int, or a 0-dim tensor (one program for every rank)."""
    c = seq_len // (2 * cp)
    if isinstance(rank, Tensor):
        offsets = torch.arange(c, device=device)
        rank = rank.to(device)
        return torch.cat([rank * c + offsets, (2 * cp - 1 - rank) * c + offsets])
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([head, torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


class ContextParallelPlan:
    """This rank's place on the cp axis, and the hooks and attention kernel built from it."""

    def __init__(self, *, group, cp: int, rank: int, documents: bool):
        self.group, self.cp, self.rank, self.documents = group, cp, rank, documents

    def cp_rank(self) -> int | Tensor:
        """This rank on cp: an int, or the group_rank op in a step captured as one program."""
        return rank_in(self.group, self.rank)

    def local_positions(self, seq_len: int, device) -> Tensor:
        if seq_len % (2 * self.cp) != 0:
            raise ValueError(f"context parallelism over {self.cp} ranks needs a sequence length divisible by "
                             f"{2 * self.cp}, got {seq_len}")
        return head_tail_positions(seq_len, self.cp, self.cp_rank(), device)

    def shard_inputs(self, module, args, kwargs):
        """Forward pre-hook: the rank's tokens, labels, RoPE positions and document ids."""
        tokens_BS, *rest = args
        B, S = tokens_BS.shape
        mine_S = self.local_positions(S, tokens_BS.device)
        labels_BS = rest[0] if rest else kwargs.pop("labels_BS", None)
        positions_BS = kwargs.pop("positions_BS", None)
        if positions_BS is None:  # plain causal windows: one document, positions 0..S-1
            document_ids_BS = torch.zeros(B, S // self.cp, dtype=torch.int32, device=tokens_BS.device)
            positions_BS = mine_S.unsqueeze(0).expand(B, -1)
        else:  # packed documents: ids from the whole sequence, positions restarting per document
            document_ids_BS = document_ids_from_positions(positions_BS)[:, mine_S]
            positions_BS = positions_BS[:, mine_S]
        labels = () if labels_BS is None else (labels_BS[:, mine_S],)
        return (tokens_BS[:, mine_S], *labels), {**kwargs, "positions_BS": positions_BS,
                                                 "document_ids_BS": document_ids_BS}

    def combine_outputs(self, module, args, output):
        """Forward hook: the loss summed over cp, or the logits gathered back into sequence order."""
        if isinstance(output, Tensor):  # logits [B, S / cp, V]
            return sequence_order(_wait(funcol.all_gather_tensor(output.contiguous(), 1, self.group)), self.cp)
        return output._replace(ce_sum=_SumOverGroup.apply(output.ce_sum, self.group))

    def sum_routing_statistics(self, module, args, output):
        """Forward hook on each MoE layer: its routing statistics [2, E] (tokens per expert, router
        probability sums) summed over cp, so that the balancing loss, the expert loads and the
        expert-bias update see the whole batch, as on one process. Backward: identity (a rank's
        probabilities get the gradient of their own tokens; the router's gradient is summed over
        cp with the other parameters')."""
        out_BSD, stats_2E = output
        return out_BSD, _SumOverGroup.apply(stats_2E, self.group)

    def attention(self, chunk_attention, q_BQHD: Tensor, k_BQKD: Tensor, v_BQKD: Tensor,
                  document_ids_BQ: Tensor | None) -> Tensor:
        """The attention kernel contract on this rank's queries, against every rank's keys;
        `chunk_attention` is the chosen kernel of that op (kernels/attention.py)."""
        k_BSKD = sequence_order(_GatherAlong.apply(k_BQKD, self.group, 1), self.cp)
        v_BSKD = sequence_order(_GatherAlong.apply(v_BQKD, self.group, 1), self.cp)
        ids_BS = None
        if self.documents:
            ids_BS = sequence_order(_wait(funcol.all_gather_tensor(document_ids_BQ.contiguous(), 1, self.group)),
                                    self.cp)
        return head_tail_attention(chunk_attention, q_BQHD, k_BSKD, v_BSKD, cp=self.cp, rank=self.cp_rank(),
                                   document_ids_BQ=document_ids_BQ if self.documents else None,
                                   document_ids_BS=ids_BS)


def sequence_order(gathered_BS: Tensor, cp: int) -> Tensor:
    """A cp all-gather's result (every rank's head and tail chunks, in rank order, on dim 1) in
    sequence order: the heads of ranks 0..cp-1, then the tails of ranks cp-1..0."""
    chunks = gathered_BS.unflatten(1, (cp, 2, -1))  # [B, rank, head/tail, chunk, ...]
    heads, tails = chunks[:, :, 0], chunks[:, :, 1].flip(1)
    return torch.cat([heads.flatten(1, 2), tails.flatten(1, 2)], dim=1)


def head_tail_attention(chunk_attention, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, cp: int,
                        rank: int | Tensor, document_ids_BQ: Tensor | None = None,
                        document_ids_BS: Tensor | None = None) -> Tensor:
    """Causal attention of cp rank `rank`'s queries (its head chunk, then its tail chunk) over the
    whole sequence's keys, in sequence order: each chunk against the keys up to its own end (an
    int rank), or, for a tensor rank (one program for every rank), against the keys up to the
    furthest end that chunk has on any rank, the first half of the sequence for a head chunk and
    all of it for a tail chunk, with the keys past its own end masked (its start a value,
    chunk_attention's q_start): the shapes are every rank's."""
    c = q_BQHD.shape[1] // 2
    outputs = []
    for half, chunk, furthest in ((slice(None, c), rank, cp * c), (slice(c, None), 2 * cp - 1 - rank, 2 * cp * c)):
        end = furthest if isinstance(chunk, Tensor) else (chunk + 1) * c
        # The least start a head (tail) chunk has: splash makes one kernel per possible start.
        start = {"q_start": chunk * c, "q_start_min": furthest - cp * c} if isinstance(chunk, Tensor) else {}
        outputs.append(chunk_attention(q_BQHD[:, half], k_BSKD[:, :end], v_BSKD[:, :end],
                                       None if document_ids_BQ is None else document_ids_BQ[:, half],
                                       None if document_ids_BS is None else document_ids_BS[:, :end], **start))
    return torch.cat(outputs, dim=1)


class _ContextParallelKernels:
    """An attention module's KernelConfig with attention replaced by the plan's."""

    def __init__(self, kernels, plan: ContextParallelPlan):
        self._kernels, self._plan = kernels, plan

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_kernels", "_plan"):
            raise AttributeError(name)  # copy/pickle probe these before __init__ has run
        return getattr(self._kernels, name)

    def attention_impl(self, device_type: str, *, documents: bool) -> Impl:
        chunk = self._kernels.chunk_attention_impl(device_type, documents=documents)
        return Impl("context_parallel", functools.partial(self._plan.attention, chunk.fn), (device_type,),
                    f"keys and values all-gathered over cp, each chunk by chunk_attention {chunk.name}",
                    frozenset({"documents"}))


def context_parallel(model: nn.Module, mesh: DeviceMesh, *, seq_len: int, documents: bool) -> nn.Module:
    """Apply the plan above to a (meta-device, not yet distributed) Transformer in place; its
    parameters are then distributed on `mesh` (replicated over its `cp` axis) by
    `materialize_and_init`. documents: batches carry per-token positions (document masks).
    Returns the model."""
    names = mesh.mesh_dim_names or ()
    if CP_AXIS not in names:
        raise ValueError(f"context_parallel needs a mesh with a {CP_AXIS!r} axis, got {names}; build it with "
                         "ParallelDims(cp=...)")
    cp = mesh.size(names.index(CP_AXIS))
    check_context_parallel(cp, seq_len=seq_len, tp=tp_size(mesh))
    plan = ContextParallelPlan(group=mesh.get_group(CP_AXIS), cp=cp, rank=mesh.get_local_rank(CP_AXIS),
                               documents=documents)
    # Scanned layers (model.layers a StackedBlocks) compute only through their template block.
    unrolled = [] if model.scan_layers else list(model.layers.values())
    for block in [*unrolled, *model.block_templates()]:
        block.attention.kernels.chunk_attention_impl(mesh.device_type, documents=documents)  # one line if it can't run
        block.attention.kernels = _ContextParallelKernels(block.attention.kernels, plan)
        if block.moe is not None:
            block.moe.register_forward_hook(plan.sum_routing_statistics)
    model.register_forward_pre_hook(plan.shard_inputs, with_kwargs=True)
    model.register_forward_hook(plan.combine_outputs)
    return model


def cp_attention_saved_bytes(*, batch_size: int, seq_len: int, cp: int, q_dim: int, kv_dim: int, dtype_bytes: int,
                             documents: bool, mask: bool, v_dim: int | None = None, padded_values: bool = False) -> int:
    """Bytes one block's attention keeps for its backward on a cp rank beyond what one process's
    attention keeps for the rank's own tokens (`attention_saved_per_token`), without activation
    checkpointing:
    - the gathered keys and values: every rank's, not only its own (the chunks' key prefixes are
      views of one sequence-ordered tensor);
    - the output twice: the kernel keeps each chunk's output, the output projection their
      concatenation (one process's projection reads the kernel's output itself);
    - where the kernel takes a per-element mask (`mask`: the sdpa and reference kernels), each
      chunk's [1 or B, c, end] mask in the compute dtype (SDPA's additive form): c (S + c)
      elements for the two chunks together, c = S / (2 cp), on every rank.
    q_dim, kv_dim: the queries' and the keys' widths per token; v_dim: the values' (and so the
    output's: H / K of them), kv_dim unless given (multi-head latent attention: wider keys).
    padded_values: the kernel pads each chunk's value prefix to the keys' width (CPU SDPA with
    multi-head latent attention, kernels/attention.py `pads_values`): it keeps those padded copies,
    S + c positions over the two chunks, instead of the gathered values, and one process already
    keeps an output and its narrower copy, so the output adds nothing."""
    q = seq_len // cp
    c = q // 2
    v_dim = kv_dim if v_dim is None else v_dim
    mask_elements = (batch_size if documents else 1) * c * (seq_len + c) if mask else 0
    if padded_values:
        return (batch_size * (seq_len - q) * kv_dim + batch_size * (seq_len - c) * kv_dim + mask_elements) * dtype_bytes
    keys = batch_size * (seq_len - q) * (kv_dim + v_dim)
    return (keys + batch_size * q * (q_dim // kv_dim) * v_dim + mask_elements) * dtype_bytes


def cp_size(mesh: DeviceMesh | None) -> int:
    """Size of the mesh's cp axis (1 without one)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index(CP_AXIS)) if CP_AXIS in names else 1
