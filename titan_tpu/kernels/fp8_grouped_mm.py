"""fp8 grouped matmuls: an MoE layer's experts in float8 (docs/fp8.md "MoE experts").

The grouped forms of kernels/fp8.py's `scaled_mm`, as two torch custom ops with fake kernels, so a
captured step records each one whole and every backend gives it its own form:

    titan_tpu::scaled_grouped_mm(a_f8 [T, K], b_f8 [E, K, N], scale_a [T, 1], scale_b [E, 1, N],
                                 group_sizes [E], out_dtype) -> [T, N]
        the rows of group e: (a_f8 * scale_a) @ (b_f8[e] * scale_b[e]); rows past the last group: 0
    titan_tpu::scaled_grouped_mm_weight_grad(a_f8 [T, M], b_f8 [T, N], scale_a [E, M, 1],
                                             scale_b [E, 1, N], group_sizes [E], out_dtype) -> [E, M, N]
        group e: (a_g * scale_a[e])^T @ (b_g * scale_b[e]), summed over the group's rows

Rows are sorted by group, as kernels/grouped_mm.py's contract says. Scales are fp32 DEQUANT scales
(amax / FP8_MAX) constant along the contracted dimension, so the product of the float8 operands
times the scales is the dequantised product exactly. Under tensorwise scaling the caller expands
its one activation scale (and its one scale per expert) to these shapes.

Implementations:
* the default (the CPU, and `emulate` anywhere): both operands dequantised to fp32 and multiplied
  by torch's grouped GEMM in fp32 (kernels/grouped_mm.py's ops): the quantise-matmul-dequantise a
  float8 tensor core computes, but for fp32 summation order.
* CUDA: `torch._scaled_grouped_mm` (2d x 3d for the forward and the input gradient, 2d x 2d with
  the groups along the contracted rows for the weight gradient), which takes e4m3 operands only,
  row-wise scale vectors and a bf16 output (cast to `out_dtype` after). Written against torch's
  meta checks; not run on a GPU by this project.
* JAX (graph/jax_ops.py, the TPU path): `jax.lax.ragged_dot` / `ragged_dot_general` on the float8
  operands with an fp32 accumulator, times the scales: `chlo.ragged_dot` on f8E4M3FN in the program.
TorchTPU's runtime has no scaled grouped matmul (torch-tpu 0.2.0): there models/fp8.py hands the
whole fp8 expert matmul to JAX through jax_op (kernels/tpu.py `jax_op_fp8_grouped_linear`), and
these ops refuse its device (fp8.emulate on TorchTPU).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from titan_tpu.kernels.fp8 import E4M3, FP8_MAX
from titan_tpu.kernels.grouped_mm import _torch_grouped_mm, _torch_grouped_mm_weight_grad, group_ids
from titan_tpu.kernels.registry import kernel_device_type

__all__ = ["quantize_groups", "scaled_grouped_mm", "scaled_grouped_mm_weight_grad"]

_EPS = 1e-12  # amax floor, as kernels/fp8.py's


def quantize_groups(x_TM: Tensor, fp8: torch.dtype, group_sizes_E: Tensor) -> tuple[Tensor, Tensor]:
    """x in `fp8` with one dynamic scale per group and column (amax over the group's rows): the
    operands of the weight gradient under rowwise scaling, whose contracted dimension is the
    group's rows. Returns (the float8 [T, M], the fp32 dequant scales [E, M]). Rows past the last
    group get a scale of their own (they multiply nothing)."""
    E = group_sizes_E.shape[0]
    x = x_TM.float()
    group_T = group_ids(group_sizes_E, x.shape[0])  # E for rows past the last group
    with warnings.catch_warnings():  # "index_reduce() is in beta": the op is the one we want
        warnings.filterwarnings("ignore", message="index_reduce")
        amax_GM = x.new_zeros(E + 1, x.shape[1]).index_reduce(0, group_T, x.abs(), "amax")
    scale_GM = FP8_MAX[fp8] / amax_GM.clamp(min=_EPS)
    q = (x * scale_GM[group_T]).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    return q, scale_GM[:E].reciprocal()


# -- the ops -------------------------------------------------------------------------------------


@torch.library.custom_op("titan_tpu::scaled_grouped_mm", mutates_args=())
def _scaled_grouped_mm(a_f8: Tensor, b_f8: Tensor, scale_a: Tensor, scale_b: Tensor, group_sizes_E: Tensor,
                       out_dtype: torch.dtype) -> Tensor:
    return _emulated(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)


@_scaled_grouped_mm.register_fake
def _(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    return a_f8.new_empty(a_f8.shape[0], b_f8.shape[2], dtype=out_dtype)


@torch.library.custom_op("titan_tpu::scaled_grouped_mm_weight_grad", mutates_args=())
def _scaled_grouped_mm_weight_grad(a_f8: Tensor, b_f8: Tensor, scale_a: Tensor, scale_b: Tensor,
                                   group_sizes_E: Tensor, out_dtype: torch.dtype) -> Tensor:
    return _emulated_weight_grad(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)


@_scaled_grouped_mm_weight_grad.register_fake
def _(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    return a_f8.new_empty(group_sizes_E.shape[0], a_f8.shape[1], b_f8.shape[1], dtype=out_dtype)


def _row_scales(scale_EX: Tensor, group_sizes_E: Tensor, rows: int) -> Tensor:
    """[E, X] per-group values -> [rows, X], each row its group's (rows past the last: the last's)."""
    group_T = group_ids(group_sizes_E, rows).clamp(max=group_sizes_E.shape[0] - 1)
    return scale_EX[group_T]


def _emulated(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    a = a_f8.float() * scale_a
    b = b_f8.float() * scale_b
    return _torch_grouped_mm(a, b, group_sizes_E).to(out_dtype)


def _emulated_weight_grad(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    rows = a_f8.shape[0]
    a = a_f8.float() * _row_scales(scale_a.squeeze(2), group_sizes_E, rows)
    b = b_f8.float() * _row_scales(scale_b.squeeze(1), group_sizes_E, rows)
    return _torch_grouped_mm_weight_grad(a, b, group_sizes_E).to(out_dtype)


def _cuda_operands_e4m3(*tensors: Tensor) -> None:
    if any(t.dtype != E4M3 for t in tensors):
        raise ValueError("fp8 experts on CUDA: torch._scaled_grouped_mm takes e4m3 operands only, and tensorwise "
                         "scaling quantises gradients to e5m2; use --fp8.scaling rowwise (or --fp8.emulate true)")


def _without_rows_past_the_groups(y_TN: Tensor, offsets_E: Tensor) -> Tensor:
    rows = torch.arange(y_TN.shape[0], device=y_TN.device)
    return y_TN * (rows < offsets_E[-1]).unsqueeze(1).to(y_TN.dtype)  # no host sync


@_scaled_grouped_mm.register_kernel("cuda")
def _cuda_scaled_grouped_mm(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    _cuda_operands_e4m3(a_f8, b_f8)
    offsets = torch.cumsum(group_sizes_E, dim=0).to(torch.int32)
    # a row-major, b column-major in its last two dims; scales: [T] and [E, N]
    y = torch._scaled_grouped_mm(a_f8.contiguous(), b_f8.transpose(1, 2).contiguous().transpose(1, 2),
                                 scale_a.reshape(-1).contiguous(), scale_b.squeeze(1).contiguous(), offs=offsets,
                                 out_dtype=torch.bfloat16)
    return _without_rows_past_the_groups(y, offsets).to(out_dtype)


@_scaled_grouped_mm_weight_grad.register_kernel("cuda")
def _cuda_scaled_grouped_mm_weight_grad(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype):
    _cuda_operands_e4m3(a_f8, b_f8)
    offsets = torch.cumsum(group_sizes_E, dim=0).to(torch.int32)
    # 2d x 2d, groups along the contracted rows: a^T [M, T] row-major, b [T, N] column-major; scales
    # one per group and row of a^T ([E * M]) and per group and column of b ([E * N]).
    return torch._scaled_grouped_mm(a_f8.t().contiguous(), b_f8.t().contiguous().t(),
                                    scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous(),
                                    offs=offsets, out_dtype=torch.bfloat16).to(out_dtype)


# -- what model code calls -----------------------------------------------------------------------


def _direct(a_f8: Tensor, emulate: bool) -> bool:
    """Whether to run the emulation as plain ops rather than the op (emulate on a device with its own
    kernel); refuses TorchTPU, whose fp8 experts go through jax_op instead (models/fp8.py), so only
    fp8.emulate arrives here."""
    device_type = kernel_device_type(a_f8.device.type)
    if device_type == "tpu":
        raise ValueError("fp8.emulate with fp8.experts on TorchTPU: the emulation needs torch's grouped GEMM, "
                         "which TorchTPU has not; set --fp8.emulate false (the experts then run XLA's f8 ragged "
                         "dot through jax_op)")
    return emulate and device_type != "cpu"  # emulated on the JAX path too, as kernels/fp8.py's linears


def scaled_grouped_mm(a_f8: Tensor, b_f8: Tensor, scale_a: Tensor, scale_b: Tensor, group_sizes_E: Tensor,
                      out_dtype: torch.dtype, *, emulate: bool = False) -> Tensor:
    """Per group e, (a_f8 * scale_a) @ (b_f8[e] * scale_b[e]) in out_dtype (module docstring)."""
    if _direct(a_f8, emulate):
        return _emulated(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)
    return _scaled_grouped_mm(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)


def scaled_grouped_mm_weight_grad(a_f8: Tensor, b_f8: Tensor, scale_a: Tensor, scale_b: Tensor,
                                  group_sizes_E: Tensor, out_dtype: torch.dtype, *, emulate: bool = False) -> Tensor:
    """Per group e, (a_g * scale_a[e])^T @ (b_g * scale_b[e]) in out_dtype, [E, M, N]."""
    if _direct(a_f8, emulate):
        return _emulated_weight_grad(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)
    return _scaled_grouped_mm_weight_grad(a_f8, b_f8, scale_a, scale_b, group_sizes_E, out_dtype)
