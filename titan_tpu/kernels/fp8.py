"""fp8 matmuls: dynamic scaling (amax per tensor or per row) and the one op selection.

`quantize` is plain aten ops (abs, amax, clamp, a multiplication by the scale, a cast to the float8
format), shared by every path. `scaled_mm` is the one place the float8 matmul is chosen, with
`torch._scaled_mm`'s semantics: `scale_a` / `scale_b` are fp32 DEQUANT scales (amax / FP8_MAX),
0-dim under tensorwise scaling, [M, 1] and [1, N] under rowwise. On CUDA (and wherever
`emulate` is False and the device is not the CPU) it is `aten._scaled_mm.default`; emulated (the
CPU, or fp8.emulate) it dequantises both operands to fp32 and multiplies in fp32: exactly the
quantise-matmul-dequantise a float8 tensor core computes, but for fp32 summation order. A TPU
lowering routes the float8 matmul by replacing this one function.
"""

from __future__ import annotations

import torch

from titan_tpu.kernels import kernel_device_type

__all__ = ["E4M3", "E5M2", "FP8_MAX", "fp8_matmul", "quantize", "scaled_mm"]

E4M3 = torch.float8_e4m3fn  # weights and activations (and gradients under rowwise scaling)
E5M2 = torch.float8_e5m2  # gradients under tensorwise scaling (wider range, one mantissa bit fewer)
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale


def quantize(x: torch.Tensor, fp8: torch.dtype,
             dim: int | tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x in `fp8` with a dynamic scale FP8_MAX / amax (amax over the whole tensor, or along `dim`,
    kept as size-1 axes); returns (the float8 tensor, the fp32 dequant scale amax / FP8_MAX)."""
    x = x.float()
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    amax = amax.clamp(min=_EPS)
    scale = FP8_MAX[fp8] / amax
    q = (x * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    return q, scale.reciprocal()


def scaled_mm(a_f8: torch.Tensor, b_f8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, *, emulate: bool = False) -> torch.Tensor:
    """(a_f8 * scale_a) @ (b_f8 * scale_b) in out_dtype: `torch._scaled_mm`, or its fp32 emulation
    on the CPU or when `emulate`."""
    # A step captured on the CPU for the JAX lowering (kernels.device_type_as("cpu", "jax")) keeps
    # aten._scaled_mm itself, which the lowering makes XLA's f8 dot; torch's CPU op traces on fake tensors.
    if emulate or kernel_device_type(a_f8.device.type) == "cpu":
        return ((a_f8.float() * scale_a) @ (b_f8.float() * scale_b)).to(out_dtype)
    # _scaled_mm takes b column-major.
    return torch._scaled_mm(a_f8, b_f8.t().contiguous().t(), scale_a, scale_b, out_dtype=out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, *, rowwise: bool, a_fp8: torch.dtype = E4M3,
               b_fp8: torch.dtype = E4M3, out_dtype: torch.dtype = torch.float32,
               emulate: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] with both operands quantised: tensorwise one scale each, rowwise a per
    row of a (amax along K) and per column of b (amax along K)."""
    qa, sa = quantize(a, a_fp8, 1 if rowwise else None)
    qb, sb = quantize(b, b_fp8, 0 if rowwise else None)
    return scaled_mm(qa, qb, sa, sb, out_dtype, emulate=emulate)
