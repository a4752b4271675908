"""The output projection fused with the cross-entropy loss.

Contract of every implementation::

    linear_cross_entropy(h_ND, w_VD, labels_N, *, ignore_index=-100, chunk_tokens=0) -> loss (0-dim fp32)

the *summed* next-token cross-entropy of the logits ``h_ND @ w_VD.T`` (N tokens, D hidden, V vocab)
against `labels_N`, skipping tokens labelled `ignore_index`. Summed, not averaged: the step divides
by the token count of the whole step on all ranks (see train/step.py).

Why: the logits are the largest tensor of a step. At Qwen3's vocab of 151,936 and 8 x 1024 tokens
they are 5 GB in fp32, and their gradient another 5 GB. The chunked implementation never holds
more than one chunk of them.

* reference: materialises the logits and calls F.cross_entropy. The definition.
* chunked: a loop over chunks of `chunk_tokens` tokens. For each chunk it computes the logits,
  the loss and, right away, the chunk's gradients (softmax minus one-hot), then drops the logits;
  the backward only scales the saved gradients by the incoming one. That is three matmuls per
  chunk (logits, grad of h, grad of w), the same as the materialised form, and no recomputation.
  Gradients are computed only when an input requires them (not in validation). Written in plain
  ops, so make_fx captures it into the graph-mode step (unlike torch's F.linear_cross_entropy,
  which mutates in place inside its forward). chunk_tokens = 0 picks chunks of about 64M logits
  (256 MB in fp32), a multiple of 128 tokens, so small vocabularies run as one chunk.
* tokamax (TPU, kernels/tpu.py): tokamax's Pallas linear-softmax-cross-entropy through TorchTPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_tpu.kernels.registry import Impl, Op
from titan_tpu.kernels.sequence_point import needs_sequence_points, sequence_point

__all__ = ["LOSS", "auto_chunk_tokens"]

LOSS = Op("loss", config_key="kernels.loss")

_CHUNK_LOGITS = 1 << 26  # logits per chunk when chunk_tokens = 0: 256 MB in fp32


def auto_chunk_tokens(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk for chunk_tokens = 0: about `_CHUNK_LOGITS` logits, a multiple of 128
    tokens (matmul tiles), never more than the tokens there are."""
    chunk = max(128, (_CHUNK_LOGITS // vocab_size) // 128 * 128)
    return min(chunk, num_tokens)


def reference_linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, *, ignore_index: int = -100,
                                   chunk_tokens: int = 0) -> Tensor:
    logits_NV = (h_ND @ w_VD.t()).float()
    return F.cross_entropy(logits_NV, labels_N, ignore_index=ignore_index, reduction="sum")


def _chunk_loss_and_grad_logits(h_CD: Tensor, w_VD: Tensor, labels_C: Tensor, ignore_index: int,
                                with_grad: bool, vocab_shard: tuple | None = None) -> tuple[Tensor, Tensor | None]:
    """Summed loss of one chunk and, with_grad, d(loss)/d(logits) = softmax - one_hot (fp32).

    The gradient is built in the logits' own buffer (in place: these are fresh intermediates, and
    a traced graph is functionalised by the compiler), so a chunk costs one [C, V] buffer.
    vocab_shard (start, group): `w_VD` holds vocabulary rows [start, start + V) of a vocabulary
    split over `group` (tensor parallelism): the log-sum-exp and the target logit are reduced over
    the group (a max and two sums), so every rank gets the whole loss from its own logits."""
    logits_CV = (h_CD @ w_VD.t()).float()
    valid_C = labels_C != ignore_index
    if vocab_shard is None:
        mine_C = valid_C
        safe_labels_C = torch.where(valid_C, labels_C, 0)
        logsumexp_C = torch.logsumexp(logits_CV, dim=-1)
        target_C = logits_CV.gather(1, safe_labels_C.unsqueeze(1)).squeeze(1)
    else:
        logsumexp_C, target_C, mine_C, safe_labels_C = _vocab_parallel_terms(logits_CV, labels_C, valid_C,
                                                                             vocab_shard)
    loss = ((logsumexp_C - target_C) * valid_C).sum()
    if not with_grad:
        return loss, None
    grad_logits_CV = logits_CV.sub_(logsumexp_C.unsqueeze(1)).exp_()  # softmax
    minus_one_C = torch.full_like(target_C, -1.0) if vocab_shard is None else -mine_C.to(target_C.dtype)
    grad_logits_CV.scatter_add_(1, safe_labels_C.unsqueeze(1), minus_one_C.unsqueeze(1))
    return loss, grad_logits_CV.mul_(valid_C.unsqueeze(1))


def _vocab_parallel_terms(logits_CV: Tensor, labels_C: Tensor, valid_C: Tensor, vocab_shard: tuple):
    """(log-sum-exp over the whole vocabulary, target logit, whether the label is in this shard,
    the label's local index or 0) for a chunk of vocabulary-sharded logits."""
    import torch.distributed._functional_collectives as funcol

    start, group = vocab_shard
    local_C = labels_C - start
    mine_C = valid_C & (local_C >= 0) & (local_C < logits_CV.shape[1])
    safe_labels_C = torch.where(mine_C, local_C, 0)
    max_C = funcol.all_reduce(logits_CV.amax(dim=-1), "max", group)
    sum_exp_C = funcol.all_reduce((logits_CV - max_C.unsqueeze(1)).exp().sum(dim=-1), "sum", group)
    target_C = logits_CV.gather(1, safe_labels_C.unsqueeze(1)).squeeze(1) * mine_C
    target_C = funcol.all_reduce(target_C, "sum", group)
    return max_C + sum_exp_C.log(), target_C, mine_C, safe_labels_C


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, ignore_index: int, chunk: int,
                with_grad: bool, vocab_shard: tuple | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h_chunks = []
        # The weight gradient accumulates in fp32 across chunks, in place: one [V, D] buffer; none
        # for a frozen output projection (LoRA).
        grad_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) \
            if with_grad and w_VD.requires_grad else None
        # Traced for XLA, each chunk starts after the previous chunk's results (kernels/sequence_point.py):
        # else XLA fuses the running sums (the loss's, the weight gradient's) into one loop each at the
        # end, which holds every chunk's logits (43 fp32 [384, 151936] at once in a Qwen3-8B step) or
        # [V, D] weight-gradient product.
        ordered = with_grad and needs_sequence_points(h_ND.device.type)
        for start in range(0, h_ND.shape[0], chunk):
            h_CD = h_ND[start:start + chunk]
            if ordered and start > 0:
                sums = (total, grad_h_chunks[-1]) + (() if grad_w_VD is None else (grad_w_VD,))
                *sums, h_CD = sequence_point(*sums, h_CD)
                total, grad_h_chunks[-1] = sums[:2]
                grad_w_VD = sums[2] if grad_w_VD is not None else None
            loss, grad_logits_CV = _chunk_loss_and_grad_logits(h_CD, w_VD, labels_N[start:start + chunk],
                                                               ignore_index, with_grad, vocab_shard)
            total = total + loss
            if with_grad:
                g_CV = grad_logits_CV.to(h_ND.dtype)
                grad_h_chunks.append(g_CV @ w_VD)
                if grad_w_VD is None:
                    continue
                if grad_w_VD.dtype == g_CV.dtype:
                    grad_w_VD.addmm_(g_CV.t(), h_CD)
                else:  # bf16 compute: the product in bf16, summed in fp32
                    grad_w_VD.add_(g_CV.t() @ h_CD)
        if not with_grad:
            return total, None, None
        return total, torch.cat(grad_h_chunks), None if grad_w_VD is None else grad_w_VD.to(w_VD.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, grad_h_ND, grad_w_VD = output
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        ctx.mark_non_differentiable(*(t for t in output[1:] if t is not None))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, _grad_h, _grad_w):
        # Scaled in place: the saved gradients are this function's own buffers and are used once,
        # so the [V, D] weight gradient is never copied.
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        grad_w = None if grad_w_VD is None else grad_w_VD.mul_(grad_total.to(grad_w_VD.dtype))
        return grad_h_ND.mul_(grad_total.to(grad_h_ND.dtype)), grad_w, None, None, None, None, None


def chunked_linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, *, ignore_index: int = -100,
                                 chunk_tokens: int = 0, vocab_shard: tuple | None = None) -> Tensor:
    """vocab_shard (start, group): vocabulary-parallel form (`_chunk_loss_and_grad_logits`); the
    gradient of h it returns is this shard's part, summed over the group by the caller's
    collective (tensor parallelism's sequence all-gather, whose backward reduce-scatters)."""
    chunk = chunk_tokens if chunk_tokens > 0 else auto_chunk_tokens(h_ND.shape[0], w_VD.shape[0])
    with_grad = torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)
    total, _, _ = _ChunkedLinearCrossEntropy.apply(h_ND, w_VD, labels_N, ignore_index, chunk, with_grad,
                                                   vocab_shard)
    return total


# A loss kernel's feature: it skips labels equal to ignore_index (chat data trains only the
# assistant's tokens). One without it is refused for such data, and auto passes over it.
IGNORED_LABELS = frozenset({"ignored labels"})

LOSS.register(Impl("reference", reference_linear_cross_entropy, ("cpu", "cuda", "tpu"),
                   "materialised logits + F.cross_entropy (the definition)", features=IGNORED_LABELS))
LOSS.register(Impl("chunked", chunked_linear_cross_entropy, ("cpu", "cuda", "tpu"),
                   "token chunks, gradients computed per chunk; never holds the whole logits", features=IGNORED_LABELS))


def loss_memory_bytes(impl: str, *, tokens: int, vocab_size: int, dim: int, dtype_bytes: int,
                      chunk_tokens: int = 0, vocab_parallel: bool = False, weight_trained: bool = True
                      ) -> tuple[int, int]:
    """(bytes kept from the forward to the backward, extra bytes live at the kernel's peak) of
    the output projection + loss over `tokens` tokens, for the planner (titan_tpu/plan).

    reference: the fp32 log-softmax [N, V] is kept; at its peak the logits and their gradient
    are live beside it. chunked: the gradients it computes in the forward are kept (h's [N, D]
    in the compute dtype, w's [V, D] accumulated in fp32 unless w is frozen: weight_trained False,
    LoRA); at its peak one chunk's fp32 logits [C, V] (and their compute-dtype copy when that is not
    fp32) and the per-chunk pieces of h's gradient beside their concatenation. vocab_parallel
    (tensor parallelism, `vocab_size` the rank's shard): the log-sum-exp over the shards
    (`_vocab_parallel_terms`) forms the max-shifted logits and their exp out of place, two more fp32
    [C, V] buffers live beside the logits until their sum. tokamax (TPU): a fused kernel that keeps
    no logits; counted as chunked with the automatic chunk (its own blocks are smaller).
    tokamax_xla: tokamax's plain-XLA form of the same call (what `titan-tpu compile` lowers, the
    Mosaic kernel needing a chip): it keeps h and a log-sum-exp per token and, at its peak, the
    [N, V] logits in the compute dtype."""
    n, v, d = tokens, vocab_size, dim
    if impl == "reference":
        return n * v * 4, 2 * n * v * 4
    if impl == "tokamax_xla":
        return n * d * dtype_bytes + n * 4, n * v * dtype_bytes
    chunk = chunk_tokens if chunk_tokens > 0 else auto_chunk_tokens(n, v)
    chunk = min(chunk, n)
    kept = n * d * dtype_bytes + (v * d * 4 if weight_trained else 0)
    peak = chunk * v * 4 + (chunk * v * dtype_bytes if dtype_bytes != 4 else 0) + n * d * dtype_bytes
    if vocab_parallel:
        peak += 2 * chunk * v * 4
    return kept, peak
