"""Causal grouped-query self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3).

The attention itself is the kernel layer's op (titan_tpu/kernels/attention.py): the module asks
its `KernelConfig` for the implementation that runs on the device of its inputs.
"""

from collections.abc import Callable

import torch
from torch import nn

from titan_tpu.kernels import KernelConfig
from titan_tpu.kernels.attention import masked_sdpa
from titan_tpu.models.common.kv_cache import LayerCache
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import apply_rope


class Attention(nn.Module):
    """Multi-head attention where K kv heads are shared by groups of H/K query heads.

    Parameter names (wq, wk, wv, wo, q_norm, k_norm) follow TorchTitan so checkpoints match.
    """

    def __init__(
        self,
        *,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        rope_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope,
        kernels: KernelConfig | None = None,
    ):
        super().__init__()
        self.rope_fn = rope_fn  # apply_rope, or apply_rope_real where complex views are not allowed
        self.kernels = kernels or KernelConfig()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        # Qwen3 normalises each head of q and k over head_dim before RoPE.
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None

    def cache_entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What a decode cache keeps per token (models/common/kv_cache.py): the key after RoPE, the value."""
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    def forward(self, x_BSD: torch.Tensor, rope_xSP2: torch.Tensor,
                document_ids_BS: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """rope_xSP2: this batch's RoPE rows (rope.rope_rows); document_ids_BS: None for plain
        causal windows, else one id per token and attention stays within each document.
        cache: decoding (kv_cache.py): the tokens' keys and values are written into it and the
        queries attend over the cached positions up to their own."""
        B, S, _ = x_BSD.shape
        q_BSHD = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k_BSKD = self.wk(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        v_BSKD = self.wv(x_BSD).view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BSHD = self.q_norm(q_BSHD)
            k_BSKD = self.k_norm(k_BSKD)
        q_BSHD = self.rope_fn(q_BSHD, rope_xSP2)
        k_BSKD = self.rope_fn(k_BSKD, rope_xSP2)
        if cache is not None:
            k_BSKD, v_BSKD = cache.write(k_BSKD, v_BSKD)  # now every cached position's
            o_BSHD = masked_sdpa(q_BSHD, k_BSKD, v_BSKD, cache.visible_BQS)
        else:
            attention = self.kernels.attention_impl(x_BSD.device.type, documents=document_ids_BS is not None).fn
            o_BSHD = attention(q_BSHD, k_BSKD, v_BSKD, document_ids_BS)
        return self.wo(o_BSHD.reshape(B, S, self.n_heads * self.head_dim))


def attention_saved_per_token(*, n_heads: int, n_kv_heads: int, head_dim: int,
                              qk_norm: bool, partitioned: bool = False) -> tuple[int, int]:
    """What `Attention.forward` keeps for its backward per token, without activation
    checkpointing, as (elements of the compute dtype, fp32 elements); its input (the normalised
    hidden state) is counted by the block.

    The attention kernel keeps q and k after RoPE, v, and its output (which is also wo's input:
    SDPA writes it in [B, S, H, D] memory order, so the reshape is a view) plus one log-sum-exp per
    head. RoPE keeps nothing of its own (the rotation does not need the gradient of its angles).
    With qk_norm each per-head RMSNorm keeps its input and input * rstd, and one rstd per head.

    partitioned: what a min-cut partitioner keeps (scan's own autograd in graph mode,
    models/common/scan.py), whose traced body is functionalised: the reshape of the kernel's output
    into wo's input is a copy there, so the output is kept twice (the kernel's layout and wo's);
    the per-head RMSNorms keep their input and rstd (`rms_norm_saved_per_row`)."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    elements, fp32 = 2 * q + 2 * kv + (q if partitioned else 0), n_heads
    if qk_norm:
        from titan_tpu.models.common.norms import rms_norm_saved_per_row

        for rows in (n_heads, n_kv_heads):
            per_row, per_row_fp32 = rms_norm_saved_per_row(head_dim, partitioned=partitioned)
            elements += rows * per_row
            fp32 += rows * per_row_fp32
    return elements, fp32


def attention_matmul_outputs_per_token(*, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Outputs of the matmuls and of the attention kernel per token, (compute-dtype, fp32)
    elements: what selective activation checkpointing keeps of an attention layer (q, k, v, the
    attention output and its log-sum-exp, wo's output)."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    return 2 * q + 2 * kv + dim, n_heads
