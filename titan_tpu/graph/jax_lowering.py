"""Run a captured step's FX graph as a JAX function: the program XLA compiles is the step we capture.

Two stages:

1. `functional_graph(gm, example_inputs)` traces the captured graph once more, functionalised
   (in-place ops such as ``add_`` and ``_foreach_mul_`` become their out-of-place forms, views
   become copies) and decomposed to core ATen, so the lowering below only ever sees pure ops on
   values, which is what a JAX array is. The collectives of SimpleFSDP and tp/cp/ep are already
   functional (``_c10d_functional``) and pass through unchanged.
2. `to_jax(gm, group_axes)` returns a function of JAX arrays that walks the graph in order and
   evaluates each node with the JAX form of its op (the table `LOWERINGS`). It computes the values
   of *one device*; `shard_step` wraps it in `shard_map` over a mesh whose axes carry our mesh
   names, where each collective becomes the `jax.lax` collective over the axes of its process
   group (all_gather_into_tensor -> all_gather, reduce_scatter_tensor -> psum_scatter,
   all_reduce -> psum/pmax/pmin, all_to_all_single -> all_to_all; wait_tensor is the identity).
   Three ops of ours are collectives too: TorchTPU's ragged all-to-all, captured as its stand-in
   (kernels/jax_traced.py), -> ragged_all_to_all, ``titan_tpu::group_rank`` (a rank the step
   reads as a value, parallel/group_rank.py) -> axis_index over the group's axes, so a rank-dependent
   number of cp or ep is one program's value on every device, not a constant per rank; and
   ``titan_tpu::pp_permute`` (pipeline stages handing activations on, parallel/pipeline.py) ->
   ppermute, XLA's collective-permute over the pp axis.

Every node's result is cast to the dtype the trace recorded for it, and its shape checked against
the recorded one: torch and JAX promote mixed dtypes differently (a 0-dim float64 tensor times a
float32 tensor stays float32 in torch), and the trace is the reference for both.

Our own lowering instead of torchax's table: the captured steps of our models use about 80 core
ATen ops (listed in LOWERINGS), and torchax 0.0.13 does not import under torch 2.13. An op missing
here is one line naming it (`JaxLoweringError`).

Imports jax: used only by `titan-tpu compile` and tests/tpu/ (.venv-tpu).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import torch
import torch.fx
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

import titan_tpu.kernels.grouped_mm  # noqa: F401 - registers the titan_tpu:: custom ops the table names
from titan_tpu.graph.reverse_scan import marked_reverse

__all__ = ["LOWERINGS", "JaxLoweringError", "functional_graph", "global_shape", "jax_dtype", "rank_constants",
           "shard_step", "to_jax"]

aten = torch.ops.aten
funcol = torch.ops._c10d_functional


class JaxLoweringError(ValueError):
    """An op of the captured graph has no JAX lowering; the one-line message names it."""


def functional_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """`gm` traced again without mutations or views, decomposed to core ATen (see the module docstring).
    example_inputs: the captured step's fake inputs (CapturedStep.example_inputs). Run node by node
    (fx.Interpreter) with node meta preserved, so each new node keeps the meta of the node it
    came from: its module (``nn_module_stack``, graph/capture.py) for error messages."""
    import torch.fx.traceback as fx_traceback

    pure = torch.func.functionalize(lambda *inputs: torch.fx.Interpreter(gm).run(*inputs),
                                    remove="mutations_and_views")
    with fx_traceback.preserve_node_meta():
        return make_fx(pure, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*example_inputs)


_DTYPES = {torch.float32: jnp.float32, torch.float64: jnp.float64, torch.bfloat16: jnp.bfloat16,
           torch.float16: jnp.float16, torch.int64: jnp.int64, torch.int32: jnp.int32, torch.int16: jnp.int16,
           torch.int8: jnp.int8, torch.uint8: jnp.uint8, torch.bool: jnp.bool_,
           # fp8 (kernels/fp8.py): XLA casts round to nearest even, as torch's do; both give NaN past
           # the largest finite value, which is why the quantisation clamps first.
           torch.float8_e4m3fn: jnp.float8_e4m3fn, torch.float8_e5m2: jnp.float8_e5m2}


def jax_dtype(dtype: torch.dtype):
    """The JAX dtype for a torch dtype, as JAX will hold it (64-bit types narrow unless x64 is on)."""
    if dtype not in _DTYPES:
        raise JaxLoweringError(f"dtype {dtype} has no JAX equivalent here; use float32 or bfloat16")
    return jax.dtypes.canonicalize_dtype(_DTYPES[dtype])


# -- the op table ---------------------------------------------------------------------------------

def _dims(x, dim) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(x.ndim))
    return tuple(d % max(x.ndim, 1) for d in (dim if isinstance(dim, (list, tuple)) else [dim]))


def _arg_dtype(dtype):
    return None if dtype is None else jax_dtype(dtype)


def _expand(x, size):
    size = [x.shape[i - (len(size) - x.ndim)] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(x, size)


def _slice(x, dim=0, start=None, end=None, step=1):
    n = x.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else min(start, n))
    end = n if end is None else (end + n if end < 0 else min(end, n))
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, max(start, end), step)
    return x[tuple(index)]


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    n = x.shape[dim]
    start = 0 if start is None else (start + n if start < 0 else min(start, n))
    end = n if end is None else (end + n if end < 0 else min(end, n))
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x.at[tuple(index)].set(src)


def _select_scatter(x, src, dim, index):
    where = [slice(None)] * x.ndim
    where[dim] = index
    return x.at[tuple(where)].set(src)


def _as_strided(x, size, stride, storage_offset=0):
    # Read as from x's storage in row-major order (what the functionalised graph's values are:
    # SimpleFSDP views a gathered flat bucket this way): a gather at the strided positions.
    flat = x.reshape(-1)
    position = jnp.asarray(storage_offset or 0)
    for axis, (n, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = n
        position = position + (jnp.arange(n) * step).reshape(shape)
    return flat[jnp.broadcast_to(position, tuple(size))]


def _constant_pad(x, pad, value=0):
    # torch's pad list runs from the last dimension backwards, (before, after) per dimension; a
    # negative width cuts (SimpleFSDP's gradient of a weight padded to shard evenly), as lax.pad does.
    widths = [(pad[i], pad[i + 1], 0) for i in range(len(pad) - 2, -1, -2)]
    return jax.lax.pad(x, jnp.asarray(value, x.dtype), [(0, 0, 0)] * (x.ndim - len(widths)) + widths)


def _index(x, indices):
    # aten.index: None keeps a dimension; the tensor indices broadcast together (numpy's rules,
    # which JAX's advanced indexing follows).
    return x[tuple(slice(None) if i is None else i for i in indices)]


def _index_put(x, indices, values, accumulate=False):
    at = x.at[tuple(slice(None) if i is None else i for i in indices)]
    return at.add(values) if accumulate else at.set(values)


def _gather(x, dim, index):
    return jnp.take_along_axis(x, index, axis=dim)


def _scatter_at(x, dim, index):
    # Every index position names one element of x: the full index tuple with the given index on
    # `dim` and the position's own coordinates elsewhere.
    grids = list(jnp.indices(index.shape, sparse=True))
    grids[dim] = index
    return x.at[tuple(grids)]


def _scatter_add(x, dim, index, src):
    return _scatter_at(x, dim, index).add(src[tuple(slice(0, s) for s in index.shape)])


def _scatter(x, dim, index, src):
    # Positions named twice keep one of their values (torch leaves which undefined too).
    src = src[tuple(slice(0, s) for s in index.shape)] if jnp.ndim(src) else src
    return _scatter_at(x, dim, index).set(src)


def _searchsorted(sorted_sequence, values, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None or sorted_sequence.ndim != 1:
        raise JaxLoweringError("aten.searchsorted with a sorter or a batched sequence has no JAX lowering")
    side = side or ("right" if right else "left")
    return jnp.searchsorted(sorted_sequence, values, side=side).astype(jnp.int32 if out_int32 else jnp.int64)


def _sort(x, stable=None, dim=-1, descending=False):
    indices = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, indices, axis=dim), indices


def _topk(x, k, dim=-1, largest=True, sorted=True):
    moved = jnp.moveaxis(x, dim, -1)
    values, indices = jax.lax.top_k(moved if largest else -moved, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices, -1, dim)


def _div_mode(x, y, rounding_mode=None):
    if rounding_mode == "floor":
        return jnp.floor_divide(x, y)
    if rounding_mode == "trunc":
        return jnp.trunc(x / y).astype(jnp.result_type(x, y))
    return jnp.true_divide(x, y)


def _remainder(x, y):
    return jnp.remainder(x, y)


def _vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    x = x if dtype is None else x.astype(_arg_dtype(dtype))
    axes = _dims(x, dim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    if ord == math.inf:
        return jnp.max(jnp.abs(x), axis=axes, keepdims=keepdim)
    return jnp.sum(jnp.abs(x) ** ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


def _reference_attention(q_BHSD, k_BKSD, v_BKSD, is_causal, scale, mask=None):
    """softmax(q k^T * scale) v with grouped-query heads, in float32: the sdpa backward's forward.
    mask: SDPA's attn_mask, boolean (True: attend) or additive, broadcast to [B, H, Q, S]."""
    heads, kv_heads = q_BHSD.shape[1], k_BKSD.shape[1]
    if kv_heads != heads:
        k_BKSD = jnp.repeat(k_BKSD, heads // kv_heads, axis=1)
        v_BKSD = jnp.repeat(v_BKSD, heads // kv_heads, axis=1)
    scores_BHQS = jnp.einsum("bhqd,bhsd->bhqs", q_BHSD, k_BKSD) * scale
    if is_causal:
        q_len, kv_len = scores_BHQS.shape[-2:]
        allowed_QS = jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + (kv_len - q_len)
        scores_BHQS = jnp.where(allowed_QS, scores_BHQS, -jnp.inf)
    if mask is not None:
        scores_BHQS = (jnp.where(mask, scores_BHQS, -jnp.inf) if mask.dtype == jnp.bool_
                       else scores_BHQS + mask.astype(scores_BHQS.dtype))
    return jnp.einsum("bhqs,bhsd->bhqd", jax.nn.softmax(scores_BHQS, axis=-1), v_BKSD)


def _sdpa_flash_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None,
                             scale=None):
    # No core-ATen decomposition exists for this backward: differentiate the reference forward.
    if dropout_p:
        raise JaxLoweringError("aten._scaled_dot_product_flash_attention_for_cpu_backward with dropout "
                               "has no JAX lowering")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _, vjp = jax.vjp(lambda q, k, v: _reference_attention(q, k, v, is_causal, scale, attn_mask), q, k, v)
    return vjp(grad_out)


def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution (1-, 2- or 3-d, channels first, as torch lays them out): a vision tower's
    patch embedding."""
    if transposed:
        raise JaxLoweringError("aten.convolution.default with transposed=True has no JAX lowering")
    dims = x.ndim - 2
    spatial = "DHW"[3 - dims:]

    def per_dim(values):  # one value stands for every spatial dim, as torch allows
        return tuple(values) * (dims // len(values))

    dimension_numbers = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    out = jax.lax.conv_general_dilated(x, w, window_strides=per_dim(stride), padding=[(p, p) for p in per_dim(padding)],
                                       rhs_dilation=per_dim(dilation), dimension_numbers=dimension_numbers,
                                       feature_group_count=groups)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * (x.ndim - 2))
    return out


def _convolution_backward(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
                          output_mask):
    """(input, weight, bias) gradients, those `output_mask` asks for: the vjp of `_convolution`."""
    _, vjp = jax.vjp(lambda x, w: _convolution(x, w, None, stride, padding, dilation, transposed, output_padding,
                                               groups), x, w)
    grad_x, grad_w = vjp(grad_out)
    grad_b = grad_out.sum(axis=(0, *range(2, grad_out.ndim))) if output_mask[2] else None
    return (grad_x if output_mask[0] else None, grad_w if output_mask[1] else None, grad_b)


def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    """(output, mean, 1 / std) over the trailing `normalized_shape` dims, the statistics kept with
    those dims as ones (their backward, decomposed, reads them), computed in at least fp32."""
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    stats_dtype = jnp.promote_types(x.dtype, jnp.float32)
    x32 = x.astype(stats_dtype)
    mean = jnp.mean(x32, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), axis=axes, keepdims=True) + eps)
    out = (x32 - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(x.dtype), mean, rstd


def _avg_pool2d(x, kernel_size, stride=(), padding=(0, 0), ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    """Average pooling over the last two dims in non-overlapping windows that tile them (Gemma 3's
    projector pools the tower's patches so): a reshape and a mean. Other poolings are refused."""
    kh, kw = tuple(kernel_size) * (2 // len(kernel_size))
    strides = tuple(stride or kernel_size) * (2 // len(stride or kernel_size))
    h, w = x.shape[-2:]
    if any(padding) or ceil_mode or divisor_override or strides != (kh, kw) or h % kh or w % kw:
        raise JaxLoweringError("aten.avg_pool2d.default has a JAX lowering for windows that tile the image only "
                               "(stride = kernel, no padding)")
    tiles = x.reshape(*x.shape[:-2], h // kh, kh, w // kw, kw)
    return tiles.mean(axis=(-3, -1))


def _avg_pool2d_backward(grad_out, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                           divisor_override), x)
    return vjp(grad_out)[0]


def _grouped_mm(x_TD, w_EDF, group_sizes_E):
    # ragged_dot: rows past sum(group_sizes) give zeros, as our grouped_mm contract says.
    return jax.lax.ragged_dot(x_TD, w_EDF, group_sizes_E.astype(jnp.int32))


def _grouped_mm_weight_grad(x_TD, grad_TF, group_sizes_E):
    num_groups = group_sizes_E.shape[0]
    w_EDF = jnp.zeros((num_groups, x_TD.shape[1], grad_TF.shape[1]), x_TD.dtype)
    _, vjp = jax.vjp(lambda w: _grouped_mm(x_TD, w, group_sizes_E), w_EDF)
    return vjp(grad_TF)[0]


def _foreach(fn: Callable) -> Callable:
    """A `_foreach_*` op: `fn` applied per list element; list arguments are zipped, others shared."""
    def run(*args, **kwargs):
        n = len(args[0])
        pick = lambda a, i: a[i] if isinstance(a, (list, tuple)) else a  # noqa: E731
        return [fn(*(pick(a, i) for a in args), **kwargs) for i in range(n)]
    return run


def _scaled_mm(a_MK, b_KN, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """aten._scaled_mm: out = (a * scale_a) @ (b * scale_b) (+ bias), with dequantisation scales in fp32:
    0-dim (tensorwise) or [M, 1] and [1, N] (rowwise). The dot stays on the float8 operands with an fp32
    accumulator (XLA's f8 dot, the TPU's fp8 MXU path on chips that have one); the scales multiply its
    output, which is the same product because each scale is constant along the contracted dimension."""
    if scale_result is not None:
        raise JaxLoweringError("aten._scaled_mm with scale_result (an fp8 output) has no JAX lowering; "
                               "give the fp8 matmul a bf16 or fp32 out_dtype")
    out_MN = jax.lax.dot_general(a_MK, b_KN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    out_MN = out_MN * scale_a.astype(jnp.float32) * scale_b.astype(jnp.float32)
    if bias is not None:
        out_MN = out_MN + bias.astype(jnp.float32)
    return out_MN.astype(_arg_dtype(out_dtype) or a_MK.dtype)


def _full(size, value, dtype=None, **_):
    return jnp.full(size, value, dtype=_arg_dtype(dtype or torch.float32))


def _arange(start, end, step=1, dtype=None, **_):
    return jnp.arange(start, end, step, dtype=_arg_dtype(dtype or torch.int64))


def _scalar_tensor(value, dtype=None, **_):
    return jnp.asarray(value, dtype=_arg_dtype(dtype or torch.float32))


def _full_like(x, value, dtype=None, **_):
    return jnp.full(x.shape, value, dtype=_arg_dtype(dtype) or x.dtype)


def _to_copy(x, dtype=None, **_):
    return x if dtype is None else x.astype(_arg_dtype(dtype))


def _sum(x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(x, axis=_dims(x, dim), keepdims=keepdim, dtype=_arg_dtype(dtype))


def _mean(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(x, axis=_dims(x, dim), keepdims=keepdim, dtype=_arg_dtype(dtype))


def _clamp(x, min=None, max=None):
    return jnp.clip(x, min, max)


def _squeeze(x, dims=None):
    dims = [d % x.ndim for d in ([dims] if isinstance(dims, int) else dims or range(x.ndim))]
    return jnp.squeeze(x, axis=tuple(d for d in dims if x.shape[d] == 1))


def _softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(x, axis=dim)


def _log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(x, axis=dim)


def _unbind(x, dim=0):
    return [jnp.squeeze(t, axis=dim) for t in jnp.split(x, x.shape[dim], axis=dim)]


def _split_with_sizes(x, sizes, dim=0):
    offsets = [sum(sizes[:i]) for i in range(1, len(sizes))]
    return jnp.split(x, offsets, axis=dim)


def _split(x, split_size, dim=0):
    n = x.shape[dim]
    return jnp.split(x, list(range(split_size, n, split_size)), axis=dim)


def _select(x, dim, index):
    return jnp.take(x, index, axis=dim)


LOWERINGS: dict[object, Callable] = {
    operator.getitem: operator.getitem,
    # elementwise
    aten.abs.default: jnp.abs,
    aten.sign.default: jnp.sign,
    aten.add.Tensor: lambda x, y, alpha=1: x + y * alpha if alpha != 1 else x + y,
    aten.add.Scalar: lambda x, y, alpha=1: x + y * alpha,
    aten.sub.Tensor: lambda x, y, alpha=1: x - y * alpha if alpha != 1 else x - y,
    aten.sub.Scalar: lambda x, y, alpha=1: x - y * alpha,
    aten.rsub.Scalar: lambda x, y, alpha=1: y - x * alpha,
    aten.mul.Tensor: jnp.multiply,
    aten.mul.Scalar: jnp.multiply,
    aten.div.Tensor: jnp.true_divide,
    aten.div.Scalar: jnp.true_divide,
    aten.div.Tensor_mode: _div_mode,
    aten.remainder.Scalar: _remainder,
    aten.remainder.Tensor: _remainder,
    aten.neg.default: jnp.negative,
    aten.exp.default: jnp.exp,
    aten.log.default: jnp.log,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: jax.lax.rsqrt,
    aten.reciprocal.default: jnp.reciprocal,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.tanh.default: jnp.tanh,
    aten.gelu.default: _gelu,  # its backward is decomposed (erf, exp)
    aten.erf.default: jax.lax.erf,
    aten.cos.default: jnp.cos,
    aten.sin.default: jnp.sin,
    aten.pow.Tensor_Scalar: jnp.power,
    aten.pow.Tensor_Tensor: jnp.power,
    aten.pow.Scalar: jnp.power,
    aten.clamp.default: _clamp,
    aten.where.self: jnp.where,
    aten.eq.Scalar: jnp.equal,
    aten.eq.Tensor: jnp.equal,
    aten.ne.Scalar: jnp.not_equal,
    aten.ne.Tensor: jnp.not_equal,
    aten.ge.Scalar: jnp.greater_equal,
    aten.ge.Tensor: jnp.greater_equal,
    aten.gt.Scalar: jnp.greater,
    aten.gt.Tensor: jnp.greater,
    aten.le.Scalar: jnp.less_equal,
    aten.le.Tensor: jnp.less_equal,
    aten.lt.Scalar: jnp.less,
    aten.lt.Tensor: jnp.less,
    aten.maximum.default: jnp.maximum,
    aten.minimum.default: jnp.minimum,
    aten.bitwise_and.Tensor: jnp.bitwise_and,
    aten.bitwise_or.Tensor: jnp.bitwise_or,
    aten.bitwise_not.default: jnp.bitwise_not,
    aten.logical_and.default: jnp.logical_and,
    aten.logical_or.default: jnp.logical_or,
    aten.logical_not.default: jnp.logical_not,
    aten.clone.default: lambda x, memory_format=None: x,
    aten.detach_copy.default: lambda x: x,
    aten.alias_copy.default: lambda x: x,
    aten.alias.default: lambda x: x,
    aten.copy.default: lambda x, src, non_blocking=False: jnp.broadcast_to(src, x.shape).astype(x.dtype),
    aten._to_copy.default: _to_copy,
    # reductions
    aten.sum.dim_IntList: _sum,
    aten.sum.default: lambda x, dtype=None: _sum(x, None, False, dtype),
    aten.mean.dim: _mean,
    aten.mean.default: lambda x, dtype=None: _mean(x, None, False, dtype),
    aten.cumsum.default: lambda x, dim, dtype=None: jnp.cumsum(x, axis=dim, dtype=_arg_dtype(dtype)),
    aten.amax.default: lambda x, dim=(), keepdim=False: jnp.max(x, axis=_dims(x, dim), keepdims=keepdim),
    aten.amin.default: lambda x, dim=(), keepdim=False: jnp.min(x, axis=_dims(x, dim), keepdims=keepdim),
    aten.any.dim: lambda x, dim, keepdim=False: jnp.any(x, axis=dim, keepdims=keepdim),
    aten.any.default: lambda x: jnp.any(x),
    aten.linalg_vector_norm.default: _vector_norm,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.avg_pool2d.default: _avg_pool2d,
    aten.avg_pool2d_backward.default: _avg_pool2d_backward,
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _log_softmax,
    aten.sort.stable: _sort,
    aten.sort.default: lambda x, dim=-1, descending=False: _sort(x, None, dim, descending),
    aten.searchsorted.Tensor: _searchsorted,
    aten.topk.default: _topk,
    # matmuls
    aten.mm.default: jnp.matmul,
    aten.bmm.default: jnp.matmul,
    aten.addmm.default: lambda bias, a, b, beta=1, alpha=1: beta * bias + alpha * (a @ b),
    aten._scaled_mm.default: _scaled_mm,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    # shapes and indexing
    aten.view.default: jnp.reshape,
    aten.view_copy.default: jnp.reshape,
    aten._unsafe_view.default: jnp.reshape,
    aten.reshape.default: jnp.reshape,
    aten.permute.default: jnp.transpose,
    aten.flip.default: lambda x, dims: jnp.flip(x, axis=tuple(dims)),  # a scanned backward's reversed stacks
    aten.permute_copy.default: jnp.transpose,
    aten.expand.default: _expand,
    aten.repeat.default: jnp.tile,  # torch's repeat tiles (sizes may add leading dims, as tile's)
    aten.expand_copy.default: _expand,
    aten.unsqueeze.default: jnp.expand_dims,
    aten.unsqueeze_copy.default: jnp.expand_dims,
    aten.squeeze.dims: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze_copy.dims: _squeeze,
    aten.cat.default: lambda xs, dim=0: jnp.concatenate(xs, axis=dim),
    aten.slice_copy.Tensor: _slice,
    aten.slice.Tensor: _slice,
    aten.select_copy.int: _select,
    aten.select.int: _select,
    aten.unbind_copy.int: _unbind,
    aten.unbind.int: _unbind,
    aten.split_with_sizes_copy.default: _split_with_sizes,
    aten.split_copy.Tensor: _split,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.index.Tensor: _index,
    aten.slice_scatter.default: _slice_scatter,
    aten.as_strided_copy.default: _as_strided,
    aten.as_strided.default: _as_strided,
    aten.select_scatter.default: _select_scatter,
    aten.constant_pad_nd.default: _constant_pad,
    aten.index_put.default: _index_put,
    aten.index_select.default: lambda x, dim, index: jnp.take(x, index, axis=dim),
    aten.gather.default: _gather,
    aten.scatter_add.default: _scatter_add,
    aten.scatter.src: _scatter,
    aten.scatter.value: _scatter,
    aten.embedding.default: lambda w, idx, *_: jnp.take(w, idx, axis=0),
    # creation
    aten.full.default: _full,
    # empty: its values are never read before being written (zeros are a valid choice of garbage)
    aten.empty.memory_format: lambda size, dtype=None, **_: jnp.zeros(size, _arg_dtype(dtype or torch.float32)),
    aten.zeros.default: lambda size, dtype=None, **_: jnp.zeros(size, _arg_dtype(dtype or torch.float32)),
    aten.full_like.default: _full_like,
    aten.zeros_like.default: lambda x, dtype=None, **_: jnp.zeros(x.shape, _arg_dtype(dtype) or x.dtype),
    aten.ones_like.default: lambda x, dtype=None, **_: jnp.ones(x.shape, _arg_dtype(dtype) or x.dtype),
    aten.arange.start_step: _arange,
    aten.arange.default: lambda end, dtype=None, **kw: _arange(0, end, 1, dtype),
    aten.scalar_tensor.default: _scalar_tensor,
    # attention, and our grouped matmul custom ops
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_flash_cpu_backward,
    torch.ops.titan_tpu.grouped_mm.default: _grouped_mm,
    torch.ops.titan_tpu.grouped_mm_weight_grad.default: _grouped_mm_weight_grad,
    # the optimizer's _foreach ops (functionalised)
    aten._foreach_add.Scalar: _foreach(lambda x, s: x + s),
    aten._foreach_add.List: _foreach(lambda x, y, alpha=1: x + alpha * y),
    aten._foreach_sub.List: _foreach(lambda x, y, alpha=1: x - alpha * y),
    aten._foreach_sub.Scalar: _foreach(lambda x, s: x - s),
    aten._foreach_mul.Scalar: _foreach(jnp.multiply),
    aten._foreach_mul.Tensor: _foreach(jnp.multiply),
    aten._foreach_mul.List: _foreach(jnp.multiply),
    aten._foreach_div.List: _foreach(jnp.true_divide),
    aten._foreach_div.Tensor: _foreach(jnp.true_divide),
    aten._foreach_div.Scalar: _foreach(jnp.true_divide),
    aten._foreach_sqrt.default: _foreach(jnp.sqrt),
    aten._foreach_lerp.Scalar: _foreach(lambda x, end, weight: x + weight * (end - x)),
    aten._foreach_addcmul.Scalar: _foreach(lambda x, a, b, value=1: x + value * a * b),
    aten._foreach_addcdiv.Scalar: _foreach(lambda x, a, b, value=1: x + value * a / b),
    aten._foreach_norm.Scalar: _foreach(lambda x, ord=2, dtype=None: _vector_norm(x, ord, None, False, dtype)),
}


# -- collectives ----------------------------------------------------------------------------------

def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
    """jax.lax.ragged_all_to_all's contract from all-gathers, for XLA:CPU, which has no
    ragged-all-to-all (jax 0.10.2: UNIMPLEMENTED): sender s's rows operand_s[input_offsets_s[r] :
    + send_sizes_s[r]] land in receiver r's output at output_offsets_s[r]; the rest of the output is
    kept. Same values as the TPU's collective; only the parity tests run it (every row travels)."""
    me = jax.lax.axis_index(axes)
    operands = jax.lax.all_gather(operand, axes)  # [senders, N, ...]
    starts, sizes, offsets = (jax.lax.all_gather(a, axes)[:, me] for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for sender in range(operands.shape[0]):
        i = rows - offsets[sender]
        mine = ((i >= 0) & (i < sizes[sender])).reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mine, operands[sender][jnp.clip(starts[sender] + i, 0, operand.shape[0] - 1)], output)
    return output


def _collective_lowerings(group_axes: dict[str, tuple[str, ...]], on_cpu: bool = False) -> dict[object, Callable]:
    """The `_c10d_functional` ops, and ours that are collectives (the module docstring), as jax.lax
    collectives over the mesh axes of each process group. on_cpu: the program runs on XLA:CPU
    (`_ragged_all_to_all_emulated`)."""
    import titan_tpu.parallel.group_rank  # noqa: F401 - registers titan_tpu::group_rank
    import titan_tpu.parallel.pipeline  # noqa: F401 - registers titan_tpu::pp_permute
    from titan_tpu.kernels.jax_traced import RAGGED_ALL_TO_ALL

    def axes(group_name: str):
        if group_name not in group_axes:
            raise JaxLoweringError(f"a collective runs on process group {group_name!r}, which is no axis of the mesh "
                                   f"(known groups: {', '.join(sorted(group_axes)) or 'none'})")
        names = group_axes[group_name]
        return names[0] if len(names) == 1 else names

    def reduce(x, op, group_name):
        op = op.lower()
        if op in ("sum", "avg"):
            total = jax.lax.psum(x, axes(group_name))
            return total / jax.lax.psum(1, axes(group_name)) if op == "avg" else total
        if op == "max":
            return jax.lax.pmax(x, axes(group_name))
        if op == "min":
            return jax.lax.pmin(x, axes(group_name))
        raise JaxLoweringError(f"_c10d_functional reduce op {op!r} has no JAX lowering")

    def reduce_scatter(x, op, group_size, group_name):
        if op.lower() not in ("sum", "avg"):
            raise JaxLoweringError(f"_c10d_functional.reduce_scatter_tensor with {op!r} has no JAX lowering")
        out = jax.lax.psum_scatter(x, axes(group_name), scatter_dimension=0, tiled=True)
        return out / group_size if op.lower() == "avg" else out

    def all_to_all(x, output_split_sizes, input_split_sizes, group_name):
        for sizes in (output_split_sizes, input_split_sizes):
            if sizes is not None and len(set(sizes)) > 1:
                raise JaxLoweringError("_c10d_functional.all_to_all_single with uneven splits has no JAX lowering")
        return jax.lax.all_to_all(x, axes(group_name), split_axis=0, concat_axis=0, tiled=True)

    def pp_permute(x, shift, group_size, group_name):
        # XLA's collective-permute: rank i of the group's axis sends to rank (i + shift) % size.
        pairs = [(i, (i + shift) % group_size) for i in range(group_size)]
        return jax.lax.ppermute(x, axes(group_name), perm=pairs)

    def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
        sizes = [a.astype(jnp.int32) for a in (input_offsets, send_sizes, output_offsets, recv_sizes)]
        if on_cpu:
            return _ragged_all_to_all_emulated(operand, output, *sizes, axes(group_name))
        return jax.lax.ragged_all_to_all(operand, output, *sizes, axis_name=axes(group_name))

    return {
        RAGGED_ALL_TO_ALL.default: ragged_all_to_all,
        torch.ops.titan_tpu.group_rank.default: lambda group_name: jax.lax.axis_index(axes(group_name)),
        torch.ops.titan_tpu.pp_permute.default: pp_permute,
        funcol.all_gather_into_tensor.default:
            lambda x, group_size, group_name: jax.lax.all_gather(x, axes(group_name), axis=0, tiled=True),
        funcol.reduce_scatter_tensor.default: reduce_scatter,
        funcol.all_reduce.default: reduce,
        funcol.all_to_all_single.default: all_to_all,
        funcol.wait_tensor.default: lambda x: x,
    }


# -- the interpreter ------------------------------------------------------------------------------

def _where(node: torch.fx.Node) -> str:
    """Where a node came from, for error messages: the innermost module whose forward made it
    (or whose forward's backward did), as the capture recorded it (graph/capture.py)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        name, cls = list(stack.values())[-1]
        what = "the backward of " if node.meta.get("custom", {}).get("phase") == "backward" else ""
        return f"{what}module {name or 'the model'} ({getattr(cls, '__name__', cls)}), graph node {node.name}"
    return f"graph node {node.name}, outside any module's forward"


def _scope(node: torch.fx.Node) -> str:
    """The name scope of a node's JAX ops: the module whose forward made it, "bwd " before it for
    its backward, "step" outside any module (the loss reduction, clipping, AdamW)."""
    stack = node.meta.get("nn_module_stack")
    name = (list(stack.values())[-1][0] or "model") if stack else "step"
    return f"bwd {name}" if node.meta.get("custom", {}).get("phase") == "backward" else name


def _table(group_axes: dict[str, tuple[str, ...]] | None, on_cpu: bool = False) -> dict[object, Callable]:
    """Every op's JAX form: the ATen table, the collectives over the mesh axes of their groups, and
    the TPU kernels a step captured for JAX holds as ops (kernels/jax_traced.py: each the JAX
    function TorchTPU's jax_op would be handed, its Pallas kernel a Mosaic custom call on TPU)."""
    from titan_tpu.kernels.jax_traced import LOWERED

    return {**LOWERINGS, **_collective_lowerings(group_axes or {}, on_cpu), **LOWERED}


def check_lowerable(gm: torch.fx.GraphModule, group_axes: dict[str, tuple[str, ...]] | None = None) -> None:
    """Raise JaxLoweringError for the first op of `gm` with no JAX lowering (before any tracing)."""
    table = _table(group_axes)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _SCAN:
            check_lowerable(_subgraph(gm, node.args[0]), group_axes)  # the body: the same table
        elif node.op == "call_function" and node.target not in table:
            raise JaxLoweringError(f"operator {node.target} (from {_where(node)}) has no JAX lowering, so neither "
                                   "compile.backend jax nor titan-tpu compile can run this step; torch runs it: "
                                   "--compile.backend inductor (CPU, GPU), tpu (TorchTPU) or --training.mode eager; "
                                   "or add it to LOWERINGS in titan_tpu/graph/jax_lowering.py")


def rank_constants(graphs: list[torch.fx.GraphModule]) -> dict[str, dict[int, list]]:
    """The constants that differ between the ranks' graphs (graphs[r]: global rank r's
    `functional_graph`): node name -> {index of the number among the node's flattened arguments:
    its value on each rank}. tp's vocabulary offset and ep's first local expert are such numbers;
    `to_jax` reads them per device. Graphs that differ otherwise (an op, or a shape: cp's head-tail
    chunks attend to rank-dependent key lengths) have no single SPMD program: JaxLoweringError."""
    from torch.utils._pytree import tree_flatten

    out: dict[str, dict[int, list]] = {}
    node_lists = [list(g.graph.nodes) for g in graphs]
    if len({len(nodes) for nodes in node_lists}) > 1:
        raise JaxLoweringError("the ranks' captured steps have different numbers of operations: no single SPMD "
                               "program runs them all")
    for nodes in zip(*node_lists):
        first = nodes[0]
        vals = [n.meta.get("val") for n in nodes]
        shapes = {tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals}
        if len({n.target for n in nodes}) > 1 or len(shapes) > 1:
            raise JaxLoweringError(f"operation {first.target} (from {_where(first)}) has a different shape or op on "
                                   "different ranks: no single SPMD program runs them all")
        leaves = [tree_flatten((n.args, n.kwargs))[0] for n in nodes]
        for i, values in enumerate(zip(*leaves)):
            if isinstance(values[0], torch.fx.Node):
                continue
            if any(v != values[0] for v in values):
                out.setdefault(first.name, {})[i] = list(values)
    return out


def to_jax(gm: torch.fx.GraphModule, group_axes: dict[str, tuple[str, ...]] | None = None,
           per_rank: dict[str, dict[int, list]] | None = None, axis_sizes: dict[str, int] | None = None, *,
           on_cpu: bool = False) -> Callable:
    """A function of JAX arrays (the graph's flat inputs, one device's values) returning the list of
    its flat outputs. gm: a `functional_graph`. group_axes: process group name -> the mesh axis
    names it spans (empty for a one-device step); the function must then run inside shard_map.
    per_rank (`rank_constants`) with the mesh's axis_sizes: numbers read per device, by its rank
    (row-major over the mesh axes); without it every device uses gm's own (rank 0's) numbers.
    on_cpu: the function will run on XLA:CPU (the parity tests), whose missing ragged-all-to-all is
    emulated (`_ragged_all_to_all_emulated`); False for a TPU program."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    check_lowerable(gm, group_axes)
    table = _table(group_axes, on_cpu)
    nodes = list(gm.graph.nodes)
    per_rank = per_rank or {}

    def device_rank():
        rank = 0
        for name, size in (axis_sizes or {}).items():
            rank = rank * size + jax.lax.axis_index(name)
        return rank

    def run(*inputs):
        env: dict[torch.fx.Node, object] = {}
        placeholders = iter(inputs)
        load = lambda a: torch.fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
        rank = device_rank() if per_rank else None
        for node in nodes:
            if node.op == "placeholder":
                env[node] = jnp.asarray(next(placeholders))
            elif node.op == "call_function" and node.target is _SCAN:
                env[node] = _as_traced(_scan(gm, node, load, group_axes, on_cpu), node.meta.get("val"), node)
            elif node.op == "call_function":
                if node.name in per_rank:  # the node's arguments with its rank-dependent numbers read per device
                    leaves, spec = tree_flatten((node.args, node.kwargs))
                    leaves = [env[a] if isinstance(a, torch.fx.Node) else a for a in leaves]
                    for i, values in per_rank[node.name].items():
                        leaves[i] = jnp.asarray(values)[rank]
                    args, kwargs = tree_unflatten(leaves, spec)
                else:
                    args, kwargs = load(node.args), load(node.kwargs)
                kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory",
                                                                       "memory_format", "non_blocking")}
                try:
                    with jax.named_scope(_scope(node)):  # XLA's op names then say which module (tools/xla_dump.py)
                        value = table[node.target](*args, **kwargs)
                except JaxLoweringError:
                    raise
                except Exception as e:
                    raise JaxLoweringError(f"lowering {node.target} (from {_where(node)}) failed: "
                                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
                env[node] = _as_traced(value, node.meta.get("val"), node)
            elif node.op == "output":
                return list(load(node.args[0]))
            elif node.op == "get_attr" and all(u.target is _SCAN for u in node.users):
                continue  # a scan's body, read by the scan's lowering
            else:
                raise JaxLoweringError(f"graph node {node.name} of kind {node.op} has no JAX lowering")
        raise AssertionError("graph without an output node")

    return run


_SCAN = torch.ops.higher_order.scan


def _subgraph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """The GraphModule a `get_attr` node of `gm` names (a scan's body)."""
    assert node.op == "get_attr", node
    return getattr(gm, node.target)


def _scan(gm: torch.fx.GraphModule, node: torch.fx.Node, load: Callable, group_axes, on_cpu: bool) -> list:
    """torch's scan op (scanned layers, their backward) as `jax.lax.scan`: XLA's while loop over the
    leading dim of the stacked inputs, the body (one layer) lowered once, by this same table.

    The op's arguments: (body, init, xs, additional_inputs); the body takes (*carry, one slice of
    each xs, *additional_inputs) and returns (*next carry, one slice of each stacked output); the op
    returns (*last carry, *stacked outputs), which is what lax.scan returns (a reversed scan reaches
    here as flips of xs and of the outputs, lowered as flips)."""
    body_gm, init, xs, additional = node.args[0], *load(node.args[1:4])
    assert not node.kwargs, node.kwargs
    body = to_jax(_subgraph(gm, body_gm), group_axes, on_cpu=on_cpu)
    n_carry = len(init)

    def step(carry, layer_xs):
        out = body(*carry, *layer_xs, *additional)
        return list(out[:n_carry]), list(out[n_carry:])

    # A scan marked to run in reverse (graph/reverse_scan.py mark_reverse_scans: its flips taken
    # away) is XLA's loop reading and writing row L-1-i at step i, as TorchTPU builds it.
    reverse = marked_reverse(_subgraph(gm, body_gm))
    carry, ys = jax.lax.scan(step, [jnp.asarray(c) for c in init], [jnp.asarray(x) for x in xs], reverse=reverse)
    return [*carry, *ys]


def _as_traced(value, val, node):
    """`value` cast to the dtype the trace recorded (`val`, a fake tensor or a list of them); its shape
    checked against the recorded one (an invariant: a wrong lowering, not a user error)."""
    if isinstance(val, torch.Tensor):
        value = jnp.asarray(value)
        assert tuple(value.shape) == tuple(val.shape), (str(node.target), node.name, value.shape, tuple(val.shape))
        dtype = jax_dtype(val.dtype)
        return value if value.dtype == dtype else value.astype(dtype)
    if isinstance(val, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(value)(_as_traced(v, m, node) for v, m in zip(value, val))
    return value


def shard_step(fn: Callable, mesh: jax.sharding.Mesh, input_ndims: Sequence[int],
               output_ndims: Sequence[int]) -> Callable:
    """`fn` (one device's step, from `to_jax`) over every device of `mesh`, with shard_map.

    Every input and output is given as its per-device values laid end to end (`global_shape`):
    a value of one or more dimensions concatenated along its first, device (i, j, ...) holding the
    row-major (i, j, ...)th block; a scalar stacked, [*mesh.devices.shape]. Uniform for sharded
    parameters, replicated values and per-rank batches alike, exactly the per-device bytes the
    trainer holds (what memory_analysis then reports per chip), and each device's block is its
    tensor with no extra axes: a stacked form ([1, 1, *local]) leaves size-1 axes that XLA's
    layouts can pad (a gathered bf16 [1, vocab, dim] took twice its bytes)."""
    from jax.sharding import PartitionSpec

    axes = tuple(mesh.axis_names)

    def spec(ndim: int) -> PartitionSpec:
        return PartitionSpec(axes) if ndim else PartitionSpec(*axes)

    def local(*inputs):
        outputs = fn(*(x if ndim else x.reshape(()) for x, ndim in zip(inputs, input_ndims)))
        return [y if ndim else jnp.reshape(y, (1,) * len(axes)) for y, ndim in zip(outputs, output_ndims)]

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec(n) for n in input_ndims),
                         out_specs=[spec(n) for n in output_ndims], check_vma=False)


def global_shape(mesh: jax.sharding.Mesh, local_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape `shard_step` takes a value of `local_shape` on every device in."""
    if not local_shape:
        return tuple(mesh.devices.shape)
    return (mesh.devices.size * local_shape[0], *local_shape[1:])
