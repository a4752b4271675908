"""Rotary position embeddings (RoPE) in the interleaved-pair convention.

Convention: within each head, the pairs (x[2i], x[2i+1]) are rotated by the angle
``pos * inv_freq[i]``. This is the layout of Meta's original Llama code and of TorchTitan, so
native checkpoints stay compatible with them. Hugging Face checkpoints use the "rotate half"
layout instead (pairs (x[i], x[i + hd/2])); `models/hub/adapter.py` permutes the wq/wk rows on import and
export, which makes the two models compute the same function.

The rotation is a complex multiply (as in Meta's and TorchTitan's code) on a table stored as
real (cos, sin) pairs; see `apply_rope` for why, and docs/decisions.md for the TPU note.
"""

import math
from dataclasses import dataclass

import torch

from titan_tpu.tracing import is_tracing


@dataclass
class RopeScaling:
    """Frequency scaling: Llama 3.1's (HF ``rope_type: "llama3"``, the default) or YaRN's
    (``rope_type: "yarn"``, DeepSeek-V3; the beta_* and mscale* fields are YaRN's only)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"  # llama3 | yarn
    beta_fast: float = 32.0  # yarn: rotations above which frequencies are kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by factor
    mscale: float = 0.0  # yarn: 0 = unset; with mscale_all_dim, cos/sin scale = m(mscale) / m(mscale_all_dim)
    mscale_all_dim: float = 0.0  # yarn: 0 = unset; else the softmax scale gets m(mscale_all_dim)^2
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions

    def __post_init__(self):
        if self.rope_type not in ("llama3", "yarn"):
            raise ValueError(f"model rope_scaling.rope_type must be llama3 or yarn, got {self.rope_type!r}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies the RoPE table's cos and sin by (1 for every other kind), as
    transformers derives it from factor, mscale and mscale_all_dim."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def softmax_scale_factor(scaling: RopeScaling | None) -> float:
    """DeepSeek's correction of the softmax scale under YaRN: m(mscale_all_dim)^2 (1 without)."""
    if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by `factor`, those turning more than beta_fast times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return (inv_freq / s.factor) * (1 - keep) + inv_freq * keep


def rope_inv_freq(*, head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies, shape [head_dim // 2], fp32, on the current default device.

    The arithmetic mirrors HF's "default" and "llama3" rope types step by step (same op order,
    fp32 throughout) so that imported HF models reproduce HF logits to rounding.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`, and blend
    # smoothly in between. Wavelengths are measured against the original training context.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cache(
    *, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None
) -> torch.Tensor:
    """The RoPE table, shape [max_seq_len, head_dim // 2, 2], fp32: (cos, sin) of each angle.

    Stored as real numbers (so dtype casts, meta tensors and checkpoints treat it like any other
    buffer) and viewed as unit complex numbers where it is applied.
    Created on the current default device (meta under ``with torch.device("meta")``). Under YaRN
    both are multiplied by its attention factor (`rope_attention_factor`), as transformers does.
    """
    inv_freq = rope_inv_freq(head_dim=head_dim, theta=theta, scaling=scaling)
    positions = torch.arange(max_seq_len, dtype=torch.int64).float()
    angles_SP = torch.outer(positions, inv_freq)  # P = head_dim // 2 pairs
    table = torch.stack([angles_SP.cos(), angles_SP.sin()], dim=-1)
    factor = rope_attention_factor(scaling)
    return table if factor == 1.0 else table * factor


def rope_rows(table_SP2: torch.Tensor, seq_len: int, positions_BS: torch.Tensor | None = None) -> torch.Tensor:
    """The table rows a batch needs: the first `seq_len` rows ([S, P, 2]), or, with per-token
    positions (restarting at each packed document), one row per token ([B, S, P, 2])."""
    if positions_BS is None:
        return table_SP2[:seq_len]
    return table_SP2[positions_BS]


def apply_rope(x_BSHD: torch.Tensor, rope_xSP2: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x_BSHD`` by the angles of its rows of the table
    (`rope_rows`: [S, P, 2] shared by the batch, or [B, S, P, 2] per token).

    Each pair (a, b) is read as the complex number a + ib and multiplied by e^(i angle): one
    fused elementwise kernel forward and one backward, where the same rotation in real
    arithmetic (swap the pair, two multiplies, an add) costs about five times as much on CPU.
    Computed in fp32 and cast back, so bf16 activations do not lose precision in the angles.

    That is the eager choice. While traced for a compiler, the real-arithmetic form is recorded
    instead (`apply_rope_real`, the same values): compilers fuse it into neighbouring kernels,
    Inductor generates no code for complex ops (it falls back to eager kernels on strided
    complex views), and complex support in TorchTPU's lowering is unverified.
    """
    if is_tracing():
        return apply_rope_real(x_BSHD, rope_xSP2)
    rotation_xS1P = torch.view_as_complex(rope_xSP2.float()).unsqueeze(-2)  # broadcast over heads
    x_BSHP = torch.view_as_complex(x_BSHD.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(x_BSHP * rotation_xS1P).flatten(-2).to(x_BSHD.dtype)


def apply_rope_real(x_BSHD: torch.Tensor, rope_xSP2: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in real arithmetic: each pair (a, b) becomes (a cos - b sin, a sin + b cos).

    Same values as the complex form (bitwise on CPU in our tests). `apply_rope` records it when
    traced; the scanned layer body uses it directly (its functionalised trace has no autograd
    formula for `view_as_complex_copy`). Slower in eager on CPU (see `apply_rope`).
    """
    cos_xS1P = rope_xSP2[..., 0].float().unsqueeze(-2)
    sin_xS1P = rope_xSP2[..., 1].float().unsqueeze(-2)
    a_BSHP, b_BSHP = x_BSHD.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([a_BSHP * cos_xS1P - b_BSHP * sin_xS1P, a_BSHP * sin_xS1P + b_BSHP * cos_xS1P], dim=-1)
    return rotated.flatten(-2).to(x_BSHD.dtype)


def rope_real_saved_per_position(head_dim: int) -> int:
    """fp32 elements per sequence position that `apply_rope_real` keeps for its backward in a
    scanned body under scan's own autograd (graph mode, models/common/scan.py): cos and sin
    (head_dim / 2 each), and a copy of the RoPE rows it reads (head_dim), which the partitioner
    stacks per layer like any other saved value. The planner counts it once per layer."""
    return 2 * head_dim
