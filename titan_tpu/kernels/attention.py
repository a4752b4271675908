"""Causal self-attention, optionally masked to documents packed into one window.

Contract of every implementation::

    attention(q_BSHD, k_BSKD, v_BSKD, document_ids_BS=None) -> o_BSHD

Grouped-query attention: the H query heads share K key/value heads in groups of H/K (query head h
reads kv head h // (H/K), the convention of SDPA's enable_gqa and of Llama/Qwen checkpoints).
Scale 1/sqrt(D). Position i attends to positions j <= i; with `document_ids_BS` (one integer per
token, equal within a document) only to those j of its own document, so a document packed after
another is computed exactly as if it were alone (its RoPE positions restart too, see the model).

Implementations (the registry picks one per device; `titan-tpu kernels` lists them):

* reference: the masked softmax written out in fp32. The definition; runs everywhere; memory
  grows with S^2 per head.
* sdpa: torch's scaled_dot_product_attention: is_causal for plain windows (flash kernels on CPU
  and CUDA), a boolean [B, 1, S, S] mask for documents (CPU flash takes masks; CUDA uses the
  memory-efficient kernel).
* flex: FlexAttention with a block mask built from the document ids, which skips the blocks
  that cross documents; compiled, on CUDA only (no backward on CPU); the CUDA choice for documents.
* splash (TPU, kernels/tpu.py): TorchTPU's splash attention kernel, causal windows.

The second op, ``chunk_attention``, is causal attention of a chunk of queries over the keys up to
the chunk's end: context parallelism (parallel/context_parallel.py) computes each rank's two
sequence chunks with it, against the prefix of the gathered keys each one sees, so no rank builds
a mask over the whole sequence and every kernel skips the causally masked blocks itself::

    chunk_attention(q_BQHD, k_BSKD, v_BSKD, q_document_ids_BQ=None, k_document_ids_BS=None,
                    q_start=None, q_start_min=0) -> o_BQHD

The Q queries are the last Q positions of the S keys: query i sees key j if j <= S - Q + i (the
causal mask aligned to the lower right; Q == S is plain causal attention) and, with document ids,
both are in the same document. Implementations: reference and sdpa (a boolean [B or 1, Q, S]
mask: the CPU choice), flex (a block mask from the same rule, nothing materialised per element: the
CUDA choice) and splash (TPU: splash's causal mask with an offset and separate query and key
segment ids).

q_start (a 0-dim integer tensor, a value of the step) places the queries at positions q_start ..
q_start + Q - 1 of the S keys instead: query i sees key j <= q_start + i, the keys past the chunk
masked rather than absent. So every cp rank's chunks have the same shapes, whatever their place,
and one program can run on every rank (the JAX lowering, parallel/context_parallel.py); splash
needs q_start a multiple of Q (one kernel per place, chosen when the step runs), and makes kernels
for the places from q_start_min on (a number: the least q_start can be); the others ignore it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_tpu.kernels.registry import Impl, Op

__all__ = ["ATTENTION", "CHUNK_ATTENTION", "allowed_BSS", "chunk_allowed_BQS", "document_ids_from_positions",
           "masked_sdpa", "pads_values"]

ATTENTION = Op("attention", config_key="kernels.attention")
CHUNK_ATTENTION = Op("chunk_attention", config_key="kernels.chunk_attention")


def document_ids_from_positions(positions_BS: Tensor) -> Tensor:
    """Document ids from per-token positions that restart at 0 where a document starts (the
    loader's form, as TorchTitan's): id = number of document starts so far in the window."""
    return torch.cumsum(positions_BS == 0, dim=1, dtype=torch.int32)


def allowed_BSS(S: int, document_ids_BS: Tensor | None, device: torch.device) -> Tensor:
    """Boolean [B (or 1), S, S] mask: query i may attend key j (causal, same document); the chunk
    mask below with the chunk the whole window."""
    return chunk_allowed_BQS(S, S, document_ids_BS, document_ids_BS, device)


def chunk_allowed_BQS(Q: int, S: int, q_document_ids_BQ: Tensor | None, k_document_ids_BS: Tensor | None,
                      device: torch.device, q_start: Tensor | None = None) -> Tensor:
    """Boolean [B (or 1), Q, S] mask of chunk attention: the Q queries are the last Q of the S
    positions (or start at position q_start), query i sees key j <= S - Q + i (q_start + i) of its
    own document."""
    if q_start is None:
        causal_QS = torch.ones(Q, S, dtype=torch.bool, device=device).tril(diagonal=S - Q)
    else:
        query_Q = q_start.to(device) + torch.arange(Q, device=device)
        causal_QS = torch.arange(S, device=device)[None, :] <= query_Q[:, None]
    if q_document_ids_BQ is None:
        return causal_QS.unsqueeze(0)
    return causal_QS & (q_document_ids_BQ.unsqueeze(2) == k_document_ids_BS.unsqueeze(1))


def reference_chunk_attention(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, q_document_ids_BQ: Tensor | None = None,
                              k_document_ids_BS: Tensor | None = None, q_start: Tensor | None = None,
                              q_start_min: int = 0) -> Tensor:
    """The masked softmax written out in fp32, grouped-query."""
    Q, H, D = q_BQHD.shape[1:]
    group = H // k_BSKD.shape[2]
    q_BHQD = q_BQHD.transpose(1, 2).float()
    k_BHSD = k_BSKD.transpose(1, 2).repeat_interleave(group, dim=1).float()
    v_BHSD = v_BSKD.transpose(1, 2).repeat_interleave(group, dim=1).float()
    scores_BHQS = (q_BHQD @ k_BHSD.transpose(-1, -2)) * D**-0.5
    allowed_BQS = chunk_allowed_BQS(Q, k_BSKD.shape[1], q_document_ids_BQ, k_document_ids_BS, q_BQHD.device, q_start)
    probs_BHQS = scores_BHQS.masked_fill(~allowed_BQS.unsqueeze(1), float("-inf")).softmax(dim=-1)
    return (probs_BHQS @ v_BHSD).to(q_BQHD.dtype).transpose(1, 2)


def reference_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                        document_ids_BS: Tensor | None = None) -> Tensor:
    return reference_chunk_attention(q_BSHD, k_BSKD, v_BSKD, document_ids_BS, document_ids_BS)


# CPU flash attention in bf16 is slower than in fp32 at small head dims: forward + backward of
# [8, 256, 16 heads, 16] took 1.6-1.7x as long in bf16 as in fp32 (inputs cast up, output down),
# while at head_dim 64 and 128 bf16 was 1.1-1.4x faster (AMD EPYC with avx512_bf16, one thread,
# 2026-12-04). Up to this head dim SDPA on CPU computes in fp32 (more precise, never less).
CPU_FP32_ATTENTION_MAX_HEAD_DIM = 16


def _sdpa_dtype(q: Tensor) -> torch.dtype:
    """The dtype SDPA computes in for these queries: fp32 for bf16/fp16 on CPU at small head dims
    (see CPU_FP32_ATTENTION_MAX_HEAD_DIM), else the inputs' own."""
    if q.device.type == "cpu" and q.dtype != torch.float32 and q.shape[-1] <= CPU_FP32_ATTENTION_MAX_HEAD_DIM:
        return torch.float32
    return q.dtype


def sdpa_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                   document_ids_BS: Tensor | None = None) -> Tensor:
    if document_ids_BS is not None:
        return masked_sdpa(q_BSHD, k_BSKD, v_BSKD, allowed_BSS(q_BSHD.shape[1], document_ids_BS, q_BSHD.device))
    return _sdpa(q_BSHD, k_BSKD, v_BSKD, is_causal=True)


def sdpa_chunk_attention(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, q_document_ids_BQ: Tensor | None = None,
                         k_document_ids_BS: Tensor | None = None, q_start: Tensor | None = None,
                         q_start_min: int = 0) -> Tensor:
    """SDPA with the chunk's boolean mask, [1 or B, Q, S] (SDPA's is_causal aligns the mask to the
    upper left, which is wrong when Q < S)."""
    allowed = chunk_allowed_BQS(q_BQHD.shape[1], k_BSKD.shape[1], q_document_ids_BQ, k_document_ids_BS,
                                q_BQHD.device, q_start)
    return masked_sdpa(q_BQHD, k_BSKD, v_BSKD, allowed)


def masked_sdpa(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, allowed_BQS: Tensor) -> Tensor:
    """Attention of Q queries over S keys (grouped-query) where the boolean [B (or 1), Q, S] mask
    allows, through torch's SDPA; every query must be allowed at least one key."""
    return _sdpa(q_BQHD, k_BSKD, v_BSKD, attn_mask=allowed_BQS.unsqueeze(1))


def pads_values(device_type: str, qk_head_dim: int, v_head_dim: int) -> bool:
    """Whether the sdpa implementation pads the values to the queries' head dim on this device:
    CPU's flash kernel needs q, k and v of one head dim (multi-head latent attention's values are
    narrower than its queries), and without it SDPA falls back to the math path, which keeps the
    [S, S] probabilities of every head for the backward. Zero columns change nothing in the output
    but its width, which is sliced back; the cost is the padded values and output the kernel keeps
    (the planner counts them, models/common/mla.py). CUDA's memory-efficient kernel takes the
    narrower values as they are."""
    return device_type == "cpu" and v_head_dim < qk_head_dim


def _sdpa(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, **kwargs) -> Tensor:
    """torch's SDPA on [batch, sequence, heads, head dim] tensors (it wants heads before sequence;
    the transposes are views, the kernels take strides), grouped-query, in `_sdpa_dtype`."""
    gqa = q_BQHD.shape[2] != k_BSKD.shape[2]
    dtype = _sdpa_dtype(q_BQHD)
    v_dim = v_BSKD.shape[-1]
    if pads_values(q_BQHD.device.type, q_BQHD.shape[-1], v_dim):
        v_BSKD = F.pad(v_BSKD, (0, q_BQHD.shape[-1] - v_dim))
    o_BHQD = F.scaled_dot_product_attention(q_BQHD.transpose(1, 2).to(dtype), k_BSKD.transpose(1, 2).to(dtype),
                                            v_BSKD.transpose(1, 2).to(dtype), enable_gqa=gqa, **kwargs)
    return o_BHQD[..., :v_dim].transpose(1, 2).to(q_BQHD.dtype)


_compiled_flex = None


def _flex_kernel(device_type: str):
    """flex_attention, compiled once per process on CUDA (eagerly it runs an unfused reference,
    which is what the CPU tests of its forward use)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def flex_chunk_attention(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, q_document_ids_BQ: Tensor | None = None,
                         k_document_ids_BS: Tensor | None = None, q_start: Tensor | None = None,
                         q_start_min: int = 0) -> Tensor:
    """FlexAttention with a block mask from the chunk rule (Q == S: plain causal attention)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, Q, H, _ = q_BQHD.shape
    S = k_BSKD.shape[1]
    offset = S - Q if q_start is None else q_start.to(q_BQHD.device)
    if q_document_ids_BQ is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx + offset >= kv_idx) & (q_document_ids_BQ[b, q_idx] == k_document_ids_BS[b, kv_idx])
    block_mask = create_block_mask(mask_mod, B if q_document_ids_BQ is not None else None, None, Q, S,
                                   device=q_BQHD.device)
    kernel = _flex_kernel(q_BQHD.device.type)
    o_BHQD = kernel(q_BQHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2), block_mask=block_mask,
                    enable_gqa=H != k_BSKD.shape[2])
    return o_BHQD.transpose(1, 2)


def flex_attention_impl(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                        document_ids_BS: Tensor | None = None) -> Tensor:
    return flex_chunk_attention(q_BSHD, k_BSKD, v_BSKD, document_ids_BS, document_ids_BS)


ATTENTION.register(Impl("reference", reference_attention, ("cpu", "cuda", "tpu"),
                        "masked softmax in fp32 (the definition; S^2 memory)", frozenset({"documents"})))
ATTENTION.register(Impl("sdpa", sdpa_attention, ("cpu", "cuda"),
                        "torch SDPA: flash kernels when causal, a boolean mask for documents",
                        frozenset({"documents"})))
# CUDA only: FlexAttention has no backward on CPU (torch 2.13). Its forward runs on CPU, which is
# how the tests check the block mask against the reference.
ATTENTION.register(Impl("flex", flex_attention_impl, ("cuda",),
                        "FlexAttention with a document block mask, compiled", frozenset({"documents"})))

CHUNK_ATTENTION.register(Impl("reference", reference_chunk_attention, ("cpu", "cuda", "tpu"),
                              "masked softmax in fp32 (the definition; Q x S memory)", frozenset({"documents"})))
CHUNK_ATTENTION.register(Impl("sdpa", sdpa_chunk_attention, ("cpu", "cuda"),
                              "torch SDPA with a boolean [Q, S] mask", frozenset({"documents"})))
CHUNK_ATTENTION.register(Impl("flex", flex_chunk_attention, ("cuda",),
                              "FlexAttention with a block mask, compiled", frozenset({"documents"})))
