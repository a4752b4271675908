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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_tpu.kernels.registry import Impl, Op

__all__ = ["ATTENTION", "allowed_BSS", "document_ids_from_positions", "masked_sdpa"]

ATTENTION = Op("attention", config_key="kernels.attention")


def document_ids_from_positions(positions_BS: Tensor) -> Tensor:
    """Document ids from per-token positions that restart at 0 where a document starts (the
    loader's form, as TorchTitan's): id = number of document starts so far in the window."""
    return torch.cumsum(positions_BS == 0, dim=1, dtype=torch.int32)


def allowed_BSS(S: int, document_ids_BS: Tensor | None, device: torch.device) -> Tensor:
    """Boolean [B (or 1), S, S] mask: query i may attend key j (causal, same document)."""
    causal_SS = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    if document_ids_BS is None:
        return causal_SS.unsqueeze(0)
    same_document_BSS = document_ids_BS.unsqueeze(2) == document_ids_BS.unsqueeze(1)
    return causal_SS & same_document_BSS


def reference_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                        document_ids_BS: Tensor | None = None) -> Tensor:
    B, S, H, D = q_BSHD.shape
    group = H // k_BSKD.shape[2]
    q_BHSD = q_BSHD.transpose(1, 2).float()
    k_BHSD = k_BSKD.transpose(1, 2).repeat_interleave(group, dim=1).float()
    v_BHSD = v_BSKD.transpose(1, 2).repeat_interleave(group, dim=1).float()
    scores_BHSS = (q_BHSD @ k_BHSD.transpose(-1, -2)) * D**-0.5
    allowed_B1SS = allowed_BSS(S, document_ids_BS, q_BSHD.device).unsqueeze(1)
    probs_BHSS = scores_BHSS.masked_fill(~allowed_B1SS, float("-inf")).softmax(dim=-1)
    return (probs_BHSS @ v_BHSD).to(q_BSHD.dtype).transpose(1, 2)


def sdpa_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                   document_ids_BS: Tensor | None = None) -> Tensor:
    if document_ids_BS is not None:
        return masked_sdpa(q_BSHD, k_BSKD, v_BSKD, allowed_BSS(q_BSHD.shape[1], document_ids_BS, q_BSHD.device))
    # SDPA wants heads before sequence; the transposes are views (the kernels take strides).
    gqa = q_BSHD.shape[2] != k_BSKD.shape[2]
    o_BHSD = F.scaled_dot_product_attention(q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2),
                                            is_causal=True, enable_gqa=gqa)
    return o_BHSD.transpose(1, 2)


def masked_sdpa(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, allowed_BQS: Tensor) -> Tensor:
    """Attention of Q queries over S keys (grouped-query) where the boolean [B (or 1), Q, S] mask
    allows, through torch's SDPA; every query must be allowed at least one key."""
    gqa = q_BQHD.shape[2] != k_BSKD.shape[2]
    o_BHQD = F.scaled_dot_product_attention(q_BQHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2),
                                            attn_mask=allowed_BQS.unsqueeze(1), enable_gqa=gqa)
    return o_BHQD.transpose(1, 2)


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


def flex_attention_impl(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                        document_ids_BS: Tensor | None = None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    B, S, H, _ = q_BSHD.shape
    if document_ids_BS is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx])
    block_mask = create_block_mask(mask_mod, B if document_ids_BS is not None else None, None, S, S,
                                   device=q_BSHD.device)
    kernel = _flex_kernel(q_BSHD.device.type)
    o_BHSD = kernel(q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2), block_mask=block_mask,
                    enable_gqa=H != k_BSKD.shape[2])
    return o_BHSD.transpose(1, 2)


ATTENTION.register(Impl("reference", reference_attention, ("cpu", "cuda", "tpu"),
                        "masked softmax in fp32 (the definition; S^2 memory)", frozenset({"documents"})))
ATTENTION.register(Impl("sdpa", sdpa_attention, ("cpu", "cuda"),
                        "torch SDPA: flash kernels when causal, a boolean mask for documents",
                        frozenset({"documents"})))
# CUDA only: FlexAttention has no backward on CPU (torch 2.13). Its forward runs on CPU, which is
# how the tests check the block mask against the reference.
ATTENTION.register(Impl("flex", flex_attention_impl, ("cuda",),
                        "FlexAttention with a document block mask, compiled", frozenset({"documents"})))
