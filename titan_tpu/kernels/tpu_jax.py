"""The JAX functions that the TPU kernel variants hand to `torch.tpu.pallas.jax_op`.

Pure JAX: no torch, no torch_tpu. kernels/tpu.py turns each into a torch op with jax_op (one op for
the forward, one for its vector-Jacobian product) and binds the pair with an autograd.Function.
tests/tpu/ runs these same functions on a CPU, the Pallas kernels in TPU interpret mode, through a
stand-in for jax_op, and compares them with the PyTorch reference kernels.

jax_op derives the torch schema from the annotations (torch_tpu 0.2.0, pallas.py): every
parameter must be annotated, `jax.Array` parameters become tensors, everything else (int, str)
becomes a static argument baked into the compiled kernel, and the return annotation must be
`jax.Array` or a tuple of them. Hence the explicit annotations below.

Layouts are the torch side's: attention takes [B, heads, S, D]; grouped matmul [T, D] x [E, D, F];
the loss [N, D] hidden states and [D, V] weights (tokamax's layout).

Imported only by the kernels that run (and by tests/tpu/): importing it imports jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash,
    splash_attention_mask as splash_mask,
)

# -- attention: JAX's splash attention, causal, with segment ids for packed documents -----------


@functools.cache
def _splash_kernel(heads: int, q_len: int, kv_len: int, block: int, offset: int):
    """A causal splash kernel over `heads` query heads (the key/value heads may be fewer: splash's
    multi-head form takes grouped-query attention as it is). The q_len queries start at position
    `offset` of the kv_len keys (splash's causal mask with that offset: query i sees key
    j <= i + offset; 0 for self-attention, kv_len - q_len for the last q_len). Cached per shape:
    building the mask's block tables is host work done once; blocks past the diagonal are skipped."""
    causal = splash_mask.CausalMask((q_len, kv_len), offset=offset)
    mask = splash_mask.MultiHeadMask([causal for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Built as concrete arrays even when first called inside a trace: the cached kernel outlives it.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(mask=mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)


def splash_attention(q_BHQD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array, q_segment_ids_BQ: jax.Array,
                     kv_segment_ids_BS: jax.Array, block: int) -> jax.Array:
    """Causal attention, scale 1/sqrt(D), a token attending only to tokens of its own segment
    (document); grouped-query: query head h reads kv head h // (H / K). The Q queries are the last
    Q of the S key positions (Q == S: self-attention; kernels/attention.py, chunk_attention).
    Returns [B, H, Q, D]."""
    return _splash_at(q_BHQD, k_BKSD, v_BKSD, q_segment_ids_BQ, kv_segment_ids_BS, offset=k_BKSD.shape[2] -
                      q_BHQD.shape[2], block=block)


def _splash_at(q_BHQD, k_BKSD, v_BKSD, q_segment_ids_BQ, kv_segment_ids_BS, *, offset: int, block: int):
    """`splash_attention` with the queries starting at key position `offset` (a number)."""
    B, H, Q, D = q_BHQD.shape
    kernel = _splash_kernel(H, Q, k_BKSD.shape[2], block, offset)
    q_BHQD = (q_BHQD * D**-0.5).astype(q_BHQD.dtype)  # splash takes no softmax scale

    def one_sequence(args):
        q_HQD, k_KSD, v_KSD, q_ids_Q, kv_ids_S = args
        return kernel(q_HQD, k_KSD, v_KSD, segment_ids=splash.SegmentIds(q=q_ids_Q, kv=kv_ids_S))

    # A loop over the batch (lax.map), not vmap: Pallas's TPU interpret mode rejects a vmapped
    # kernel (jax 0.10.2: the added grid axis has no dimension semantics), and the loop is what
    # can be checked here. Each iteration is a whole kernel over all heads; per-device batches on
    # TPU are small.
    return jax.lax.map(one_sequence, (q_BHQD, k_BKSD, v_BKSD, q_segment_ids_BQ, kv_segment_ids_BS))


def splash_attention_vjp(q_BHQD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array, q_segment_ids_BQ: jax.Array,
                         kv_segment_ids_BS: jax.Array, grad_BHQD: jax.Array,
                         block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of `splash_attention` for q, k, v (splash's own backward kernels)."""
    _, vjp = jax.vjp(lambda q, k, v: splash_attention(q, k, v, q_segment_ids_BQ, kv_segment_ids_BS, block),
                     q_BHQD, k_BKSD, v_BKSD)
    return vjp(grad_BHQD)


def splash_attention_at(q_BHQD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array, q_segment_ids_BQ: jax.Array,
                        kv_segment_ids_BS: jax.Array, q_start: jax.Array, q_start_min: int,
                        block: int) -> jax.Array:
    """`splash_attention` with the Q queries at positions q_start .. q_start + Q - 1 of the S keys,
    q_start a value of the program (a multiple of Q, at least q_start_min; chunk_attention's
    q_start, kernels/attention.py). A splash kernel's causal offset is built into its block tables
    when it is made, so there is one kernel per possible start ((S - q_start_min) / Q of them) and
    `lax.switch` runs the one q_start names: each device runs one kernel, whose skipped blocks are
    those of its own place."""
    Q, S = q_BHQD.shape[2], k_BKSD.shape[2]
    starts = range(q_start_min, S - Q + 1, Q)
    branches = [functools.partial(_splash_at, offset=start, block=block) for start in starts]
    return jax.lax.switch((q_start - q_start_min) // Q, branches, q_BHQD, k_BKSD, v_BKSD, q_segment_ids_BQ,
                          kv_segment_ids_BS)


def splash_attention_at_vjp(q_BHQD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array, q_segment_ids_BQ: jax.Array,
                            kv_segment_ids_BS: jax.Array, q_start: jax.Array, grad_BHQD: jax.Array,
                            q_start_min: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of `splash_attention_at` for q, k, v (a switch over the kernels' backward)."""
    _, vjp = jax.vjp(lambda q, k, v: splash_attention_at(q, k, v, q_segment_ids_BQ, kv_segment_ids_BS, q_start,
                                                          q_start_min, block), q_BHQD, k_BKSD, v_BKSD)
    return vjp(grad_BHQD)


# -- grouped matmul: megablox gmm (forward and input gradient) and tgmm (weight gradient) -------


def _rows_in_groups(num_rows: int, group_sizes_E: jax.Array) -> jax.Array:
    """[T, 1] bool: row t belongs to some group (t < sum(group_sizes))."""
    return (jnp.arange(num_rows) < jnp.sum(group_sizes_E))[:, None]


def grouped_mm(x_TD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, row_tile: int) -> jax.Array:
    """Rows of x sorted by group, group e through w[e]; rows past sum(group_sizes) give zeros.
    Tiles: `row_tile` rows by 128 x 128 (kernels/tpu.py's gmm_row_tile checks the shapes)."""
    sizes_E = group_sizes_E.astype(jnp.int32)
    y_TF = megablox_gmm(x_TD, w_EDF, sizes_E, x_TD.dtype, (row_tile, 128, 128))
    # megablox leaves rows past the last group unwritten (it zeroes them only when some groups
    # live on another device): found by the interpret-mode check, where they held garbage.
    return jnp.where(_rows_in_groups(x_TD.shape[0], sizes_E), y_TF, 0)


def grouped_mm_vjp(x_TD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, grad_TF: jax.Array,
                   row_tile: int) -> tuple[jax.Array, jax.Array]:
    """Gradients of `grouped_mm` for x and w (megablox's custom VJP: gmm against w^T, and tgmm)."""
    _, vjp = jax.vjp(lambda x, w: grouped_mm(x, w, group_sizes_E, row_tile), x_TD, w_EDF)
    grad_x_TD, grad_w_EDF = vjp(grad_TF)
    # The input gradient is a gmm too: the same unwritten rows, which get no gradient.
    return jnp.where(_rows_in_groups(x_TD.shape[0], group_sizes_E), grad_x_TD, 0), grad_w_EDF


# -- fp8 grouped matmul: MoE experts in float8 (models/fp8.py, kernels/fp8_grouped_mm.py) ----------


def scaled_ragged_dot(a_TK: jax.Array, b_EKN: jax.Array, scale_a_T1: jax.Array, scale_b_E1N: jax.Array,
                      group_sizes_E: jax.Array, out_dtype) -> jax.Array:
    """Per group e, (a * scale_a) @ (b[e] * scale_b[e]): XLA's ragged dot on the float8 operands with an
    fp32 accumulator (`chlo.ragged_dot` on f8), times the dequantisation scales, which are constant
    along the contracted dimension (each row's own, its group's per column). Rows past the groups: 0.
    The JAX form of titan_tpu::scaled_grouped_mm (graph/jax_ops.py)."""
    sizes = group_sizes_E.astype(jnp.int32)
    out_TN = jax.lax.ragged_dot(a_TK, b_EKN, sizes, preferred_element_type=jnp.float32)
    group_T = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(a_TK.shape[0]), side="right")
    scale_b_TN = scale_b_E1N[jnp.minimum(group_T, sizes.shape[0] - 1), 0]
    return (out_TN * scale_a_T1.astype(jnp.float32) * scale_b_TN.astype(jnp.float32)).astype(out_dtype)


def scaled_ragged_dot_weight_grad(a_TM: jax.Array, b_TN: jax.Array, scale_a_EM1: jax.Array, scale_b_E1N: jax.Array,
                                  group_sizes_E: jax.Array, out_dtype) -> jax.Array:
    """[E, M, N]: per group e, (a_g * scale_a[e])^T @ (b_g * scale_b[e]): XLA's ragged dot with the
    groups along the contracted rows, on the float8 operands. The JAX form of
    titan_tpu::scaled_grouped_mm_weight_grad."""
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out_EMN = jax.lax.ragged_dot_general(a_TM, b_TN, group_sizes_E.astype(jnp.int32), numbers,
                                         preferred_element_type=jnp.float32)
    return (out_EMN * scale_a_EM1.astype(jnp.float32) * scale_b_E1N.astype(jnp.float32)).astype(out_dtype)


_F8 = {"e4m3": (jnp.float8_e4m3fn, 448.0), "e5m2": (jnp.float8_e5m2, 57344.0)}


def _quantize(x: jax.Array, fp8: str, axes) -> tuple[jax.Array, jax.Array]:
    """kernels/fp8.py's quantize in JAX: (x in fp8 scaled by FP8_MAX / amax over `axes`, all when None,
    kept as size-1 axes; the dequant scale amax / FP8_MAX)."""
    dtype, largest = _F8[fp8]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None)
    scale = largest / jnp.maximum(amax, 1e-12)
    return jnp.clip(x * scale, -largest, largest).astype(dtype), 1 / scale


def _quantize_groups(x_TM: jax.Array, fp8: str, group_sizes_E: jax.Array) -> tuple[jax.Array, jax.Array]:
    """kernels/fp8_grouped_mm.py's quantize_groups: one scale per group and column; scales [E, M]."""
    dtype, largest = _F8[fp8]
    E = group_sizes_E.shape[0]
    x = x_TM.astype(jnp.float32)
    group_T = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(x.shape[0]), side="right")
    amax_GM = jnp.zeros((E + 1, x.shape[1]), jnp.float32).at[group_T].max(jnp.abs(x))
    scale_GM = largest / jnp.maximum(amax_GM, 1e-12)
    return jnp.clip(x * scale_GM[group_T], -largest, largest).astype(dtype), 1 / scale_GM[:E]


def _f8_grouped(a_TK, b_EKN, sizes_E, a_fp8: str, rowwise: int, out_dtype):
    (T, _), (E, _, N) = a_TK.shape, b_EKN.shape
    qa, sa = _quantize(a_TK, a_fp8, (1,) if rowwise else None)
    qb, sb = _quantize(b_EKN, "e4m3", (1,) if rowwise else (1, 2))
    return scaled_ragged_dot(qa, qb, jnp.broadcast_to(sa, (T, 1)), jnp.broadcast_to(sb, (E, 1, N)), sizes_E, out_dtype)


def _f8_grouped_weight_grad(a_TM, b_TN, sizes_E, a_fp8: str, rowwise: int, out_dtype):
    E, M, N = sizes_E.shape[0], a_TM.shape[1], b_TN.shape[1]
    if rowwise:
        (qa, sa), (qb, sb) = _quantize_groups(a_TM, a_fp8, sizes_E), _quantize_groups(b_TN, "e4m3", sizes_E)
        sa, sb = sa[:, :, None], sb[:, None, :]
    else:
        (qa, sa), (qb, sb) = _quantize(a_TM, a_fp8, None), _quantize(b_TN, "e4m3", None)
    return scaled_ragged_dot_weight_grad(qa, qb, jnp.broadcast_to(sa, (E, M, 1)), jnp.broadcast_to(sb, (E, 1, N)),
                                         sizes_E, out_dtype)


def fp8_grouped_linear(x_TD: jax.Array, w_EFD: jax.Array, group_sizes_E: jax.Array, rowwise: int) -> jax.Array:
    """models/fp8.py's Float8 experts' matmul, x_e @ w[e]^T per group (w stored [E, F, D]), quantised
    here: what TorchTPU runs through jax_op (no float8 tensor crosses into torch)."""
    return _f8_grouped(x_TD, jnp.swapaxes(w_EFD, 1, 2), group_sizes_E, "e4m3", rowwise, x_TD.dtype)


def fp8_grouped_linear_vjp(x_TD: jax.Array, w_EFD: jax.Array, group_sizes_E: jax.Array, grad_TF: jax.Array,
                           rowwise: int) -> tuple[jax.Array, jax.Array]:
    """Its input and weight gradients, both grouped matmuls in float8 too (the gradient e4m3 under rowwise
    scaling, e5m2 under tensorwise), as models/fp8.py's `_Float8GroupedMM.backward`."""
    grad_fp8 = "e4m3" if rowwise else "e5m2"
    grad_x = _f8_grouped(grad_TF, w_EFD, group_sizes_E, grad_fp8, rowwise, x_TD.dtype)
    grad_w = _f8_grouped_weight_grad(grad_TF, x_TD, group_sizes_E, grad_fp8, rowwise, w_EFD.dtype)
    return grad_x, grad_w


# -- loss: tokamax's linear softmax cross-entropy ------------------------------------------------


def _tokamax():
    """tokamax, imported here (only the loss needs it). Its options are absl flags that it parses
    from sys.argv when first read, unless parsed already; the trainer's and titan-tpu's own options
    (--config) are not its flags and made that parse fail, so they are marked parsed with the
    program name alone (its defaults)."""
    import sys

    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1], known_only=True)
    return tokamax


def linear_cross_entropy(x_ND: jax.Array, labels_N: jax.Array, w_DV: jax.Array, implementation: str) -> jax.Array:
    """Summed cross-entropy of the logits x @ w against the labels, without materialising them
    (tokamax; implementation "mosaic_tpu" is its Pallas kernel, "xla" its plain-XLA form)."""
    return _tokamax().linear_softmax_cross_entropy_loss(x_ND, labels_N.astype(jnp.int32), w_DV, reduction="sum",
                                                     implementation=implementation)


def linear_cross_entropy_vjp(x_ND: jax.Array, labels_N: jax.Array, w_DV: jax.Array, grad: jax.Array,
                             implementation: str) -> tuple[jax.Array, jax.Array]:
    """Gradients of `linear_cross_entropy` for x and w (tokamax's own backward)."""
    _, vjp = jax.vjp(lambda x, w: linear_cross_entropy(x, labels_N, w, implementation), x_ND, w_DV)
    return vjp(grad)
