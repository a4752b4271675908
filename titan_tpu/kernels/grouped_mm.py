"""Grouped matrix multiply: the experts of a mixture-of-experts layer, all in one op.

Contract of every implementation::

    grouped_mm(x_TD, w_EDF, group_sizes_E) -> y_TF

The rows of `x_TD` are sorted by group: the first group_sizes[0] rows go through w[0], the next
group_sizes[1] through w[1], and so on; rows past sum(group_sizes) give zeros (as JAX's and
TorchTPU's ragged_dot do), so a caller can run only some experts over a fixed-size buffer, as
expert parallelism does. Static shapes throughout: the sizes are a tensor, never read into Python
by a traced graph. `w_EDF` may be a transposed view of weights stored
[E, F, D] (nn.Linear's layout).

* reference: every row through every expert (one matmul against all experts side by side), then
  each row keeps its own group's result. E times the FLOPs; static and differentiable everywhere;
  the definition the others are tested against.
* torch (CPU, CUDA): torch's grouped GEMM (`F.grouped_mm`), wrapped as the custom ops
  `titan_tpu::grouped_mm` and `titan_tpu::grouped_mm_weight_grad` with fake kernels and bound by
  an autograd.Function, because torch 2.13's own
  meta kernel accepts only bf16, which stops make_fx from capturing an fp32 step. On CPU it
  needs row strides that are multiples of 16 bytes (dims multiples of 4 in fp32).
* ragged_dot (TPU, kernels/tpu.py): `torch.tpu.ops.ragged_dot` forward, `ragged_dot_weight_grad`
  for the weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_tpu.kernels.registry import Impl, Op

__all__ = ["GROUPED_MM", "differentiable_grouped_mm", "group_ids", "with_linear_layout"]

GROUPED_MM = Op("grouped_mm", config_key="kernels.grouped_mm")


def group_ids(group_sizes_E: Tensor, num_rows: int) -> Tensor:
    """The group of each of `num_rows` sorted rows ([T] int64), from the sizes, static-shaped."""
    ends_E = torch.cumsum(group_sizes_E, dim=0)
    return torch.searchsorted(ends_E, torch.arange(num_rows, device=group_sizes_E.device), right=True)


def reference_grouped_mm(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
    E, D, Fd = w_EDF.shape
    all_TEF = (x_TD @ w_EDF.permute(1, 0, 2).reshape(D, E * Fd)).view(-1, E, Fd)
    group_T = group_ids(group_sizes_E, x_TD.shape[0])
    mine_TF = all_TEF.gather(1, group_T.clamp(max=E - 1).view(-1, 1, 1).expand(-1, 1, Fd)).squeeze(1)
    return mine_TF * (group_T < E).unsqueeze(1)  # rows past the last group: zeros


# -- torch's grouped GEMM as a custom op with a fake kernel ------------------------------------


def _offsets(group_sizes_E: Tensor) -> Tensor:
    return torch.cumsum(group_sizes_E, dim=0).to(torch.int32)


@torch.library.custom_op("titan_tpu::grouped_mm", mutates_args=())
def _torch_grouped_mm(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
    offsets = _offsets(group_sizes_E)
    y_TF = F.grouped_mm(x_TD, w_EDF, offs=offsets)
    # The kernel leaves rows past the last group unwritten: zero them (an opaque op may read the
    # total; a traced graph only sees the op).
    y_TF[int(offsets[-1]):] = 0
    return y_TF


@_torch_grouped_mm.register_fake
def _(x_TD, w_EDF, group_sizes_E):
    return x_TD.new_empty(x_TD.shape[0], w_EDF.shape[2])


@torch.library.custom_op("titan_tpu::grouped_mm_weight_grad", mutates_args=())
def _torch_grouped_mm_weight_grad(x_TD: Tensor, grad_TF: Tensor, group_sizes_E: Tensor) -> Tensor:
    """d(loss)/d(w) [E, D, F]: per group, x_g^T @ grad_g (grouped GEMM with the jagged dim inside)."""
    return F.grouped_mm(x_TD.t(), grad_TF, offs=_offsets(group_sizes_E))


@_torch_grouped_mm_weight_grad.register_fake
def _(x_TD, grad_TF, group_sizes_E):
    return x_TD.new_empty(group_sizes_E.shape[0], x_TD.shape[1], grad_TF.shape[1])


def differentiable_grouped_mm(matmul: Callable, weight_grad: Callable) -> Callable:
    """A grouped matmul with gradients from two kernels: matmul(x_TD, w_EDF, sizes) -> y_TF (also
    used for the input gradient, against the transposed weights) and weight_grad(x_TD, grad_TF,
    sizes) -> [E, D, F]. An autograd.Function with setup_context (not a custom op's
    register_autograd), so that torch.func transforms (the vjp inside a scanned, checkpointed
    layer's backward) accept it. The result also has a `.linear_layout` form (see
    `with_linear_layout`) taking the weights as stored, [E, F, D]."""

    class GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(x_TD: Tensor, w: Tensor, group_sizes_E: Tensor, linear_layout: bool) -> Tensor:
            return matmul(x_TD, w.transpose(1, 2) if linear_layout else w, group_sizes_E)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.linear_layout = inputs[3]
            ctx.save_for_backward(*inputs[:3])  # w as passed in: the stored weights in linear layout

        @staticmethod
        def backward(ctx, grad_TF):
            x_TD, w, group_sizes_E = ctx.saved_tensors
            grad_TF = grad_TF.contiguous()  # kernels want real strides (a loss's grad can be expanded)
            w_EFD = w if ctx.linear_layout else w.transpose(1, 2)
            grad_x = matmul(grad_TF, w_EFD, group_sizes_E) if ctx.needs_input_grad[0] else None
            grad_w = weight_grad(x_TD, grad_TF, group_sizes_E) if ctx.needs_input_grad[1] else None
            if grad_w is not None and ctx.linear_layout:
                grad_w = grad_w.transpose(1, 2)
            return grad_x, grad_w, None, None

    def grouped_mm(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
        return GroupedMM.apply(x_TD, w_EDF, group_sizes_E, False)

    def linear_layout(x_TD: Tensor, w_EFD: Tensor, group_sizes_E: Tensor) -> Tensor:
        return GroupedMM.apply(x_TD, w_EFD, group_sizes_E, True)

    grouped_mm.linear_layout = linear_layout
    return grouped_mm


def with_linear_layout(grouped_mm: Callable) -> Callable:
    """(x_TD, w_EFD, group_sizes_E) -> y_TF = grouped_mm(x_TD, w_EFD.transpose(1, 2), sizes): the
    experts' weights as stored (nn.Linear's [out, in] layout).

    Where the kernel has a form that takes them so (`differentiable_grouped_mm`), its backward
    reads the stored weights rather than their transposed view. That matters inside a scanned body
    in graph mode: scan functionalises the body (the view becomes a `transpose_copy`) before its
    partitioner picks what the forward saves, so a backward reading the view saved a transposed
    copy of every layer's expert weights per step, where the stored weights' slice is saved by
    reference (the same fix as models/common/scan.py `_LinearSavingItsWeight` for `F.linear`).
    Other kernels get the transposed view, as before."""
    own = getattr(grouped_mm, "linear_layout", None)
    if own is not None:
        return own
    return lambda x_TD, w_EFD, group_sizes_E: grouped_mm(x_TD, w_EFD.transpose(1, 2), group_sizes_E)


torch_grouped_mm = differentiable_grouped_mm(_torch_grouped_mm, _torch_grouped_mm_weight_grad)


GROUPED_MM.register(Impl("reference", reference_grouped_mm, ("cpu", "cuda", "tpu"),
                         "every row through every expert, keep its own (E x the FLOPs; the definition)"))
GROUPED_MM.register(Impl("torch", torch_grouped_mm, ("cpu", "cuda"),
                         "torch's grouped GEMM (F.grouped_mm) as a custom op with a fake kernel"))
