"""Multi-head latent attention (MLA, DeepSeek-V2/V3): attention whose keys and values are
computed from a small shared latent, with a separate RoPE part of the key shared by every head.

Per token x [D]:

* query: wq x, or with a low-rank query (q_lora_rank > 0) wq_b(q_norm(wq_a x)); per head
  [qk_nope_head_dim | qk_rope_head_dim], RoPE applied to the second part.
* key-value latent: wkv_a x = [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]; k_rope gets RoPE
  and is shared by all heads; wkv_b(kv_norm(c)) gives each head's [k_nope | v (v_head_dim)].
* each head attends with q = [q_nope | q_rope] against k = [k_nope | k_rope], scale
  1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's correction
  (rope.softmax_scale_factor), and wo maps the H * v_head_dim outputs back to D.

RoPE rotates interleaved pairs, which is DeepSeek's own layout (transformers' rope_interleave),
so Hugging Face weights need no permutation. The latent norms use eps 1e-6 as DeepSeek's
reference code and transformers do. Parameter names follow TorchTitan's DeepSeek-V3 (wq or
wq_a / q_norm / wq_b, wkv_a, kv_norm, wkv_b, wo). Keys and values are expanded per head before
the attention kernel (the training form; the latent-absorbed form is an inference trick). A decode
cache keeps the compressed form, the normalised latent and the RoPE key (kv_cache.py), and expands
the keys and values from it at each step: the training math, at the cost of wkv_b over the cached
positions per step.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_tpu.kernels import KernelConfig
from titan_tpu.kernels.attention import masked_sdpa
from titan_tpu.models.common.kv_cache import LayerCache
from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import apply_rope

LATENT_NORM_EPS = 1e-6


@dataclass
class MLAArgs:
    """Multi-head latent attention's dimensions (HF names: q_lora_rank, kv_lora_rank, ...)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: the query is one full projection (wq), as in DeepSeek-V2-Lite

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model mla.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ValueError(f"model mla.q_lora_rank must be >= 0 (0: no low-rank query), got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model mla.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class MLA(nn.Module):
    def __init__(self, *, dim: int, n_heads: int, args: MLAArgs, softmax_scale_factor: float = 1.0,
                 rope_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope,
                 kernels: KernelConfig | None = None):
        super().__init__()
        self.args = args
        self.n_heads = n_heads
        self.rope_fn = rope_fn
        self.kernels = kernels or KernelConfig()
        # The kernel scales scores by 1 / sqrt(qk_head_dim); YaRN's correction multiplies q.
        self.q_scale = softmax_scale_factor
        qk = args.qk_head_dim
        if args.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * args.v_head_dim, dim, bias=False)

    def cache_entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What a decode cache keeps per token (models/common/kv_cache.py): the compressed form, the
        normalised latent and the RoPE key shared by the heads, not every head's key and value."""
        return (self.args.kv_lora_rank,), (1, self.args.qk_rope_head_dim)

    def forward(self, x_BSD: torch.Tensor, rope_xSP2: torch.Tensor,
                document_ids_BS: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """cache: decoding (kv_cache.py): the tokens' latents and RoPE keys are written into it and
        the keys and values of every cached position are expanded from them."""
        a, H = self.args, self.n_heads
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_nope_BSHN, q_rope_BSHR = q.view(B, S, H, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        q_rope_BSHR = self.rope_fn(q_rope_BSHR, rope_xSP2)
        latent_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        k_rope_BS1R = self.rope_fn(k_rope_BSR.unsqueeze(2), rope_xSP2)
        latent_BSC = self.kv_norm(latent_BSC)
        if cache is not None:  # from here on, every cached position's (S keys, where the queries are fewer)
            latent_BSC, k_rope_BS1R = cache.write(latent_BSC, k_rope_BS1R)
        S_keys = latent_BSC.shape[1]
        kv_BSHX = self.wkv_b(latent_BSC).view(B, S_keys, H, a.qk_nope_head_dim + a.v_head_dim)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        q_BSHQ = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        if self.q_scale != 1.0:
            q_BSHQ = q_BSHQ * self.q_scale
        k_BSHQ = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(B, S_keys, H, a.qk_rope_head_dim)], dim=-1)
        if cache is not None:
            o_BSHV = masked_sdpa(q_BSHQ, k_BSHQ, v_BSHV.contiguous(), cache.visible_BQS)
        else:
            attention = self.kernels.attention_impl(x_BSD.device.type, documents=document_ids_BS is not None).fn
            o_BSHV = attention(q_BSHQ, k_BSHQ, v_BSHV.contiguous(), document_ids_BS)
        return self.wo(o_BSHV.reshape(B, S, H * a.v_head_dim))

    @torch.no_grad()
    def init_weights(self, *, std: float, depth_std: float) -> None:
        """TorchTitan-style: input-side projections N(0, std), wo depth-scaled, norms 1."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=depth_std, a=-3 * depth_std, b=3 * depth_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()


def mla_params(*, dim: int, n_heads: int, args: MLAArgs) -> int:
    """Parameters of one MLA layer (norms included)."""
    qk = args.qk_head_dim
    query = (dim * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * n_heads * qk) if args.q_lora_rank \
        else dim * n_heads * qk
    kv = dim * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank \
        + args.kv_lora_rank * n_heads * (args.qk_nope_head_dim + args.v_head_dim)
    return query + kv + n_heads * args.v_head_dim * dim


def mla_saved_per_token(*, n_heads: int, args: MLAArgs, tp: int = 1,
                        padded_values: bool = False) -> tuple[float, float]:
    """What `MLA.forward` keeps for its backward per token, without checkpointing, as
    (compute-dtype elements, fp32 elements), its input counted by the block: wkv_a's output (RoPE
    and kv_norm read views of it), kv_norm's input * rstd and output (wkv_b's input), the expanded
    q and k, the values and the kernel's output (wo's input) with its log-sum-exp; with a low-rank
    query, q_norm's input, input * rstd and output.
    padded_values: the attention kernel widened the values to the queries' head dim
    (kernels/attention.py `pads_values`: CPU's flash kernel): it keeps the padded values and its
    padded output, and wo reads a copy of the output's real columns.
    Checked against autograd's saved tensors in tests/test_deepseek_v3.py (CPU, padded).
    tp: on one of tp ranks (parallel/tensor_parallel.py MLA_BLOCK_PLAN), the per-head tensors of
    its H / tp heads; the latent ones, computed whole on every rank, whole."""
    H, qk, v, c = n_heads / tp, args.qk_head_dim, args.v_head_dim, args.kv_lora_rank
    attention = 4 * H * qk + H * v if padded_values else 2 * H * qk + 2 * H * v
    elements = attention + (c + args.qk_rope_head_dim) + 2 * c
    fp32 = H + 1
    if args.q_lora_rank:
        elements += 3 * args.q_lora_rank
        fp32 += 1
    return elements, fp32


def mla_matmul_outputs_per_token(*, dim: int, n_heads: int, args: MLAArgs, tp: int = 1,
                                 padded_values: bool = False) -> tuple[float, float]:
    """Outputs of MLA's matmuls and of the kernel per token (what selective checkpointing keeps);
    tp: on one of tp ranks, its H / tp heads' (the latent projections' and wo's whole);
    padded_values: the kernel's output as wide as the queries (`mla_saved_per_token`)."""
    H = n_heads / tp
    kernel_output = H * (args.qk_head_dim if padded_values else args.v_head_dim)
    elements = H * args.qk_head_dim + args.kv_lora_rank + args.qk_rope_head_dim \
        + H * (args.qk_nope_head_dim + args.v_head_dim) + kernel_output + dim
    if args.q_lora_rank:
        elements += args.q_lora_rank
    return elements, H
