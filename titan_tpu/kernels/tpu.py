"""TPU kernel variants, through TorchTPU (torch_tpu). Every kernel-layer use of `torch.tpu` is here.

Written against the torch_tpu 0.2.0 public API (../shared/reference/torch_tpu_0.2.0_api.txt in the
team's design notes) and not run on a TPU by this project yet; the TPU-check issue verifies these
calls against the real package and runs the JAX kernels on CPU in TPU interpret mode. Imports are
lazy: importing this module never imports torch_tpu (which aborts the process where libtpu is
missing), and each implementation reports itself unavailable unless torch_tpu is installed.

* attention "splash": `torch.tpu.ops.splash_sdpa`, TorchTPU's splash-attention Pallas kernel.
  Layout [B, H, S, D] (HEAD_DIM_MINOR), GQA through `enable_gqa`. Causal windows only: the 0.2.0
  signature has no segment ids, so document-masked attention on TPU takes the reference (XLA
  fuses the masked softmax, at S^2 memory per head) until a segment-id kernel (JAX's splash
  attention with SegmentIds through `torch.tpu.pallas.jax_op`) is added.
* grouped_mm "ragged_dot": `torch.tpu.ops.ragged_dot(lhs [T, D], rhs [E, D, F], group_sizes)`
  for the forward and the input gradient (against the transposed weights), and
  `torch.tpu.ops.ragged_dot_weight_grad(lhs, grad_output, group_sizes)` for the weight gradient,
  bound by an autograd.Function.
* loss "tokamax": tokamax's `linear_softmax_cross_entropy_loss` (a Pallas kernel that never
  materialises the logits) registered as torch ops with `torch.tpu.pallas.jax_op`: one op for the
  forward, one for its vector-Jacobian product (jax.vjp), bound together by an autograd.Function.
  tokamax takes weights [H, V] and has no ignore index, so the weight is passed transposed and
  ignored labels are refused.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from titan_tpu.kernels.attention import ATTENTION
from titan_tpu.kernels.grouped_mm import GROUPED_MM, differentiable_grouped_mm
from titan_tpu.kernels.loss import LOSS
from titan_tpu.kernels.registry import Impl

__all__ = ["ragged_dot_grouped_mm", "splash_attention", "tokamax_linear_cross_entropy"]


def _missing(*modules: str) -> str | None:
    """None when TorchTPU and these modules can be imported here (found without importing any)."""
    from titan_tpu import device  # lazily: kernels sit below the device layer

    absent = ([] if device._tpu_installed() else ["torch_tpu with libtpu"])
    absent += [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)} (TorchTPU on a TPU VM)" if absent else None


def splash_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, document_ids_BS: Tensor | None = None) -> Tensor:
    if document_ids_BS is not None:
        raise ValueError("kernels.attention = splash supports causal windows only (torch_tpu 0.2.0 has no segment "
                         "ids); use --kernels.attention reference or --data.document_mask false")
    o_BHSD = torch.tpu.ops.splash_sdpa(q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2),
                                       is_causal=True, enable_gqa=q_BSHD.shape[2] != k_BSKD.shape[2])
    return o_BHSD.transpose(1, 2)


def _ragged_dot(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
    return torch.tpu.ops.ragged_dot(x_TD, w_EDF, group_sizes_E)


def _ragged_dot_weight_grad(x_TD: Tensor, grad_TF: Tensor, group_sizes_E: Tensor) -> Tensor:
    return torch.tpu.ops.ragged_dot_weight_grad(x_TD, grad_TF, group_sizes_E)


_ragged_dot_with_grad = differentiable_grouped_mm(_ragged_dot, _ragged_dot_weight_grad)


def ragged_dot_grouped_mm(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
    return _ragged_dot_with_grad(x_TD, w_EDF, group_sizes_E.to(torch.int32))


@functools.cache
def _tokamax_ops():
    """(forward op, backward op) registered with torch.tpu.pallas.jax_op; built once per process."""
    import jax
    import tokamax
    from torch.tpu.pallas import jax_op

    def loss_sum(x_NH, labels_N, w_HV):
        return tokamax.linear_softmax_cross_entropy_loss(x_NH, labels_N, w_HV, reduction="sum",
                                                         implementation="mosaic_tpu")

    def loss_vjp(x_NH, labels_N, w_HV, grad):
        _, vjp = jax.vjp(lambda x, w: loss_sum(x, labels_N, w), x_NH, w_HV)
        return vjp(grad)

    return jax_op("titan_tpu::tokamax_lce_fwd", loss_sum), jax_op("titan_tpu::tokamax_lce_bwd", loss_vjp)


class _TokamaxLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(h_ND: Tensor, w_HV: Tensor, labels_N: Tensor) -> Tensor:
        forward_op, _ = _tokamax_ops()
        return forward_op(h_ND, labels_N, w_HV)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_total):
        h_ND, w_HV, labels_N = ctx.saved_tensors
        _, backward_op = _tokamax_ops()
        grad_h_ND, grad_w_HV = backward_op(h_ND, labels_N, w_HV, grad_total)
        return grad_h_ND, grad_w_HV, None


def tokamax_linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, *, ignore_index: int = -100,
                                 chunk_tokens: int = 0) -> Tensor:
    # No ignore index in tokamax: refusing is cheaper to get right than a silent wrong loss. The
    # check reads a value, so it runs eagerly only (a traced step cannot branch on data).
    from titan_tpu.models.common.tracing import is_tracing

    if not is_tracing() and bool((labels_N == ignore_index).any()):
        raise ValueError("kernels.loss = tokamax has no ignore index; use --kernels.loss chunked for "
                         "labels with ignored tokens")
    # tokamax wants weights [H, V]: the transposed view's gradient comes back transposed too.
    return _TokamaxLinearCrossEntropy.apply(h_ND, w_VD.t(), labels_N)


ATTENTION.register(Impl("splash", splash_attention, ("tpu",), "TorchTPU splash attention (Pallas), causal only",
                        unavailable=_missing))
GROUPED_MM.register(Impl("ragged_dot", ragged_dot_grouped_mm, ("tpu",),
                         "TorchTPU ragged_dot (Pallas grouped matmul) with ragged_dot_weight_grad",
                         unavailable=_missing))
LOSS.register(Impl("tokamax", tokamax_linear_cross_entropy, ("tpu",),
                   "tokamax linear-softmax-cross-entropy (Pallas) through torch.tpu.pallas.jax_op",
                   unavailable=lambda: _missing("jax", "tokamax")))
