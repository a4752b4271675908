"""TPU kernel variants, through TorchTPU (torch_tpu). Every kernel-layer use of `torch.tpu` is here.

Written against the torch_tpu 0.2.0 API and not run on a TPU by this project. What is checked
instead (`make tpu-check`, tests/tpu/): every `torch.tpu` name and call below against the real
package (the names exist, the arguments bind to the signatures, jax_op accepts our JAX functions),
and the JAX functions handed to jax_op (kernels/tpu_jax.py) run on CPU, the Pallas kernels in TPU
interpret mode, through a stand-in for jax_op, against the PyTorch reference kernels, forward and
backward. Imports are lazy: importing this module never imports torch_tpu (which aborts the
process where libtpu is missing) or jax, and each variant reports itself unavailable unless
torch_tpu (and jax, tokamax where needed) are installed.

Through `torch.tpu.pallas.jax_op` (one torch op for the forward, one for its VJP, bound by an
autograd.Function; checked numerically in interpret mode):
* attention "splash": JAX's splash attention (Pallas), causal, GQA, and packed documents through
  its segment ids; the same kernel is chunk_attention "splash" (context parallelism: a chunk of
  queries over the keys up to its end, splash's causal mask with an offset). Layout [B, H, S, D];
  the sequence must be a multiple of 128.
* grouped_mm "gmm": megablox's grouped matmul (Pallas), with its own VJP (gmm against the
  transposed weights for the input gradient, tgmm for the weight gradient).
* loss "tokamax": tokamax's `linear_softmax_cross_entropy_loss` (a Pallas kernel that never
  materialises the logits; implementation "mosaic_tpu"). tokamax takes weights [D, V] and has no
  ignore index, so the weight is passed transposed and ignored labels are refused. Its Mosaic
  kernel refuses to run off a TPU even in interpret mode, so the check runs tokamax's "xla"
  implementation of the same call: it verifies our wiring, not tokamax's kernel.

TorchTPU's native ops (signatures checked against the real package; cannot run without a TPU):
* attention "splash_sdpa": `torch.tpu.ops.splash_sdpa`, causal windows only (no segment ids in
  0.2.0), GQA through `enable_gqa`.
* grouped_mm "ragged_dot": `torch.tpu.ops.ragged_dot(lhs [T, D], rhs [E, D, F], group_sizes)` for
  the forward and the input gradient (against the transposed weights), and
  `torch.tpu.ops.ragged_dot_weight_grad(lhs, grad_output, group_sizes)` for the weight gradient.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
from torch import Tensor

from titan_tpu.kernels.attention import ATTENTION, CHUNK_ATTENTION
from titan_tpu.kernels.grouped_mm import GROUPED_MM, differentiable_grouped_mm
from titan_tpu.kernels.loss import LOSS
from titan_tpu.kernels.registry import Impl, KernelShapeError
from titan_tpu.tracing import is_tracing

__all__ = ["gmm_grouped_mm", "gmm_row_tile", "jax_op_fp8_grouped_linear", "jax_op_replaced", "ragged_all_to_all",
           "ragged_dot_grouped_mm",
           "splash_attention",
           "splash_block", "splash_chunk_attention", "splash_sdpa_attention", "tokamax_linear_cross_entropy"]

# tokamax's Pallas kernel. tests/tpu/ sets "xla" (tokamax's Mosaic kernel refuses CPU).
TOKAMAX_IMPLEMENTATION = "mosaic_tpu"


def _missing(*modules: str) -> str | None:
    """None when TorchTPU and these modules can be imported here (found without importing any)."""
    from titan_tpu import device  # lazily: kernels sit below the device layer

    absent = ([] if device._tpu_installed() else ["torch_tpu with libtpu"])
    absent += [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(absent)} (TorchTPU on a TPU VM)" if absent else None


def _jax_missing(*modules: str) -> Callable[[], str | None]:
    """The JAX form's availability (a step lowered to JAX on any machine: no TorchTPU needed)."""
    def why_not() -> str | None:
        absent = [m for m in ("jax", *modules) if importlib.util.find_spec(m) is None]
        return f"needs {', '.join(absent)} (.venv-tpu)" if absent else None
    return why_not


# -- JAX functions as torch ops ------------------------------------------------------------------

_jax_op_stand_in: Callable | None = None
_ragged_all_to_all_stand_in: Callable | None = None


def _jax_op() -> Callable:
    if _jax_op_stand_in is not None:
        return _jax_op_stand_in
    from torch.tpu.pallas import jax_op

    return jax_op


@contextlib.contextmanager
def jax_op_replaced(stand_in: Callable, *, ragged_all_to_all: Callable | None = None) -> Iterator[None]:
    """Run the jax_op variants through `stand_in` (same call as jax_op: (name, fn) -> op) instead of
    TorchTPU's jax_op, and, when given, `ragged_all_to_all` (same call as TorchTPU's op) in place of
    torch.tpu.ops.ragged_all_to_all. For tests/tpu/, which runs the JAX functions on CPU, and for a
    step captured for the JAX lowering (kernels/jax_traced.py)."""
    global _jax_op_stand_in, _ragged_all_to_all_stand_in
    previous = _jax_op_stand_in, _ragged_all_to_all_stand_in
    _jax_op_stand_in, _ragged_all_to_all_stand_in = stand_in, ragged_all_to_all
    try:
        yield
    finally:
        _jax_op_stand_in, _ragged_all_to_all_stand_in = previous


@functools.cache
def _ops(jax_op: Callable) -> SimpleNamespace:
    """The torch ops made from kernels/tpu_jax.py by `jax_op`; once per process (and stand-in)."""
    from titan_tpu.kernels import tpu_jax

    return SimpleNamespace(
        splash=jax_op("titan_tpu::splash_attention", tpu_jax.splash_attention),
        splash_vjp=jax_op("titan_tpu::splash_attention_vjp", tpu_jax.splash_attention_vjp),
        splash_at=jax_op("titan_tpu::splash_attention_at", tpu_jax.splash_attention_at),
        splash_at_vjp=jax_op("titan_tpu::splash_attention_at_vjp", tpu_jax.splash_attention_at_vjp),
        gmm=jax_op("titan_tpu::megablox_gmm", tpu_jax.grouped_mm),
        gmm_vjp=jax_op("titan_tpu::megablox_gmm_vjp", tpu_jax.grouped_mm_vjp),
        lce=jax_op("titan_tpu::tokamax_lce", tpu_jax.linear_cross_entropy),
        fp8_gmm=jax_op("titan_tpu::fp8_grouped_linear", tpu_jax.fp8_grouped_linear),
        fp8_gmm_vjp=jax_op("titan_tpu::fp8_grouped_linear_vjp", tpu_jax.fp8_grouped_linear_vjp),
        lce_vjp=jax_op("titan_tpu::tokamax_lce_vjp", tpu_jax.linear_cross_entropy_vjp),
    )


def _jax_ops() -> SimpleNamespace:
    return _ops(_jax_op())


# -- attention "splash" (jax_op) ------------------------------------------------------------------


def splash_block(*lengths: int) -> int:
    """Splash's query/key block: the largest of 512, 256, 128 that divides every length (the
    queries' and the keys')."""
    for block in (512, 256, 128):
        if all(length % block == 0 for length in lengths):
            return block
    raise KernelShapeError("splash", f"splash attention needs seq_len divisible by 128 (with --parallelism.cp, "
                           f"seq_len / (2 cp) too), got {', '.join(map(str, lengths))}; change --training.seq_len "
                           "or use the reference kernel")


class _SplashAttention(torch.autograd.Function):
    @staticmethod
    def forward(q_BHQD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, q_ids_BQ: Tensor, kv_ids_BS: Tensor,
                block: int) -> Tensor:
        return _jax_ops().splash(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.block = inputs[5]

    @staticmethod
    def backward(ctx, grad_BHQD):
        q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS = ctx.saved_tensors
        dq, dk, dv = _jax_ops().splash_vjp(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, grad_BHQD.contiguous(),
                                           ctx.block)
        return dq, dk, dv, None, None, None


class _SplashAttentionAt(torch.autograd.Function):
    """`_SplashAttention` with the queries' first key position a tensor (q_start: one kernel per
    place, picked when the step runs; kernels/tpu_jax.py splash_attention_at)."""

    @staticmethod
    def forward(q_BHQD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, q_ids_BQ: Tensor, kv_ids_BS: Tensor, q_start: Tensor,
                q_start_min: int, block: int) -> Tensor:
        return _jax_ops().splash_at(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, q_start, q_start_min, block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:6])
        ctx.q_start_min, ctx.block = inputs[6:]

    @staticmethod
    def backward(ctx, grad_BHQD):
        q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, q_start = ctx.saved_tensors
        dq, dk, dv = _jax_ops().splash_at_vjp(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, q_start,
                                              grad_BHQD.contiguous(), ctx.q_start_min, ctx.block)
        return dq, dk, dv, None, None, None, None, None


def _segment_ids(document_ids: Tensor | None, B: int, length: int, device) -> Tensor:
    """Splash's segment ids: the document ids, or one segment for a plain causal window."""
    if document_ids is None:
        return torch.zeros(B, length, dtype=torch.int32, device=device)
    return document_ids.to(torch.int32)


def splash_chunk_attention(q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, q_document_ids_BQ: Tensor | None = None,
                           k_document_ids_BS: Tensor | None = None, q_start: Tensor | None = None,
                           q_start_min: int = 0) -> Tensor:
    """The chunk_attention contract (kernels/attention.py): splash's causal mask offset by S - Q,
    or by q_start (a multiple of Q, at least q_start_min) when given."""
    B, Q, _, _ = q_BQHD.shape
    S = k_BSKD.shape[1]
    q_ids_BQ = _segment_ids(q_document_ids_BQ, B, Q, q_BQHD.device)
    kv_ids_BS = _segment_ids(k_document_ids_BS, B, S, q_BQHD.device)
    # Contiguous [B, heads, length, D]: what the JAX function's arrays are.
    q_BHQD, k_BKSD, v_BKSD = (t.transpose(1, 2).contiguous() for t in (q_BQHD, k_BSKD, v_BSKD))
    if q_start is None:
        o_BHQD = _SplashAttention.apply(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS, splash_block(Q, S))
    else:
        o_BHQD = _SplashAttentionAt.apply(q_BHQD, k_BKSD, v_BKSD, q_ids_BQ, kv_ids_BS,
                                          q_start.to(device=q_BQHD.device, dtype=torch.int32), q_start_min,
                                          splash_block(Q, S))
    return o_BHQD.transpose(1, 2)


def splash_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, document_ids_BS: Tensor | None = None) -> Tensor:
    return splash_chunk_attention(q_BSHD, k_BSKD, v_BSKD, document_ids_BS, document_ids_BS)


# -- grouped_mm "gmm" (jax_op) --------------------------------------------------------------------


def gmm_row_tile(rows: int, dim: int, ffn_dim: int) -> int:
    """megablox's row tile for [rows, dim] x [E, dim, ffn_dim]; the other tiles are 128 x 128.
    Mosaic wants the last block dimension a multiple of 128 (or the whole dimension) and the
    backward swaps dim and ffn_dim, so both must be multiples of 128 (found by lowering for TPU
    in tests/tpu/); the rows must split into whole tiles of 8 or more."""
    if dim % 128 or ffn_dim % 128:
        raise KernelShapeError("gmm", f"kernels.grouped_mm = gmm needs the model dim and the expert ffn dim to be "
                               f"multiples of 128, got {dim} and {ffn_dim}; use --kernels.grouped_mm ragged_dot or "
                               "reference")
    for tile in (128, 64, 32, 16, 8):
        if rows % tile == 0:
            return tile
    raise KernelShapeError("gmm", f"kernels.grouped_mm = gmm needs the routed token count (tokens x top-k) "
                           f"divisible by 8, got {rows}; change the batch or sequence length, or use "
                           "--kernels.grouped_mm ragged_dot")


class _JaxGroupedMatmul(torch.autograd.Function):
    """A grouped matmul (x's rows grouped by expert, each group against its expert's weight) through a
    pair of jax_op ops: `op` for the forward and `op`_vjp for both gradients, each given one static
    int (gmm's row tile, fp8's rowwise switch)."""

    @staticmethod
    def forward(x_TD: Tensor, w_E__: Tensor, group_sizes_E: Tensor, static: int, op: str) -> Tensor:
        return getattr(_jax_ops(), op)(x_TD, w_E__, group_sizes_E, static)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.static, ctx.op = inputs[3], inputs[4]

    @staticmethod
    def backward(ctx, grad_TF):
        x_TD, w_E__, group_sizes_E = ctx.saved_tensors
        vjp = getattr(_jax_ops(), ctx.op + "_vjp")
        grad_x, grad_w = vjp(x_TD, w_E__, group_sizes_E, grad_TF.contiguous(), ctx.static)
        return grad_x, grad_w, None, None, None


def gmm_grouped_mm(x_TD: Tensor, w_EDF: Tensor, group_sizes_E: Tensor) -> Tensor:
    row_tile = gmm_row_tile(x_TD.shape[0], x_TD.shape[1], w_EDF.shape[2])
    # w may be a transposed view of [E, F, D] weights (grouped_mm.py): the JAX side wants real strides.
    return _JaxGroupedMatmul.apply(x_TD.contiguous(), w_EDF.contiguous(), group_sizes_E.to(torch.int32), row_tile,
                                   "gmm")


# -- fp8 experts (jax_op): models/fp8.py's Float8 experts on TorchTPU -------------------------------


def jax_op_fp8_grouped_linear(x_TD: Tensor, w_EFD: Tensor, group_sizes_E: Tensor, *, rowwise: bool) -> Tensor:
    """x's rows of expert e @ w[e]^T in float8 (kernels/tpu_jax.py fp8_grouped_linear: quantised and
    multiplied on the JAX side, so no float8 tensor crosses jax_op): TorchTPU has no scaled grouped
    matmul of its own (torch-tpu 0.2.0)."""
    return _JaxGroupedMatmul.apply(x_TD.contiguous(), w_EFD.contiguous(), group_sizes_E.to(torch.int32),
                                   int(rowwise), "fp8_gmm")


# -- loss "tokamax" (jax_op) -----------------------------------------------------------------------


class _TokamaxLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(h_ND: Tensor, w_DV: Tensor, labels_N: Tensor) -> Tensor:
        return _jax_ops().lce(h_ND, labels_N, w_DV, TOKAMAX_IMPLEMENTATION)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad_total):
        h_ND, w_DV, labels_N = ctx.saved_tensors
        grad_h_ND, grad_w_DV = _jax_ops().lce_vjp(h_ND, labels_N, w_DV, grad_total, TOKAMAX_IMPLEMENTATION)
        return grad_h_ND, grad_w_DV, None


def tokamax_linear_cross_entropy(h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, *, ignore_index: int = -100,
                                 chunk_tokens: int = 0) -> Tensor:
    # No ignore index in tokamax: refusing is cheaper to get right than a silent wrong loss. The
    # check reads a value, so it runs eagerly only (a traced step cannot branch on data).
    if not is_tracing() and bool((labels_N == ignore_index).any()):
        raise ValueError("kernels.loss = tokamax has no ignore index; use --kernels.loss chunked for "
                         "labels with ignored tokens")
    # tokamax wants weights [D, V]: the gradient of the transposed copy comes back [D, V] and
    # autograd transposes it back through .t().
    return _TokamaxLinearCrossEntropy.apply(h_ND, w_VD.t().contiguous(), labels_N.to(torch.int32))


# -- TorchTPU's native ops ---------------------------------------------------------------------------


def splash_sdpa_attention(q_BSHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor,
                          document_ids_BS: Tensor | None = None) -> Tensor:
    if document_ids_BS is not None:
        raise ValueError("kernels.attention = splash_sdpa supports causal windows only (torch_tpu 0.2.0's "
                         "splash_sdpa has no segment ids); use --kernels.attention splash for documents")
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


def ragged_all_to_all(operand: Tensor, output: Tensor, input_offsets: Tensor, send_sizes: Tensor,
                      output_offsets: Tensor, recv_sizes: Tensor, group_name: str) -> Tensor:
    """TorchTPU's ragged all-to-all (XLA's RaggedAllToAll): expert parallelism's TPU dispatch
    (parallel/expert_parallel.py), here so that every torch_tpu call lives in this module. In a
    step captured for the JAX lowering, the stand-in op that becomes jax.lax.ragged_all_to_all."""
    op = _ragged_all_to_all_stand_in or torch.tpu.ops.ragged_all_to_all
    return op(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name)


ATTENTION.register(Impl("splash", splash_attention, ("tpu",),
                        "JAX splash attention (Pallas) through torch.tpu.pallas.jax_op; documents as segment ids",
                        frozenset({"documents"}), unavailable=lambda: _missing("jax"), jax_form=_jax_missing()))
CHUNK_ATTENTION.register(Impl("splash", splash_chunk_attention, ("tpu",),
                              "JAX splash attention (Pallas), its causal mask offset to the chunk's place",
                              frozenset({"documents"}), unavailable=lambda: _missing("jax"),
                              jax_form=_jax_missing()))
ATTENTION.register(Impl("splash_sdpa", splash_sdpa_attention, ("tpu",),
                        "TorchTPU's own splash_sdpa op, causal only", unavailable=_missing))
GROUPED_MM.register(Impl("gmm", gmm_grouped_mm, ("tpu",),
                         "megablox grouped matmul (Pallas) through torch.tpu.pallas.jax_op",
                         unavailable=lambda: _missing("jax"), jax_form=_jax_missing()))
GROUPED_MM.register(Impl("ragged_dot", ragged_dot_grouped_mm, ("tpu",),
                         "TorchTPU ragged_dot with ragged_dot_weight_grad", unavailable=_missing))
LOSS.register(Impl("tokamax", tokamax_linear_cross_entropy, ("tpu",),
                   "tokamax linear-softmax-cross-entropy (Pallas) through torch.tpu.pallas.jax_op",
                   unavailable=lambda: _missing("jax", "tokamax"), jax_form=_jax_missing("tokamax")))
