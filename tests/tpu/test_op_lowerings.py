"""Single ops of graph/jax_ops.py against torch's own: the ones a vision tower brings (patch
convolutions and their backward, layer norm, GELU, pooling) and the shapes SimpleFSDP's padding
makes (a negative pad cuts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_tpu.graph.jax_ops import LOWERINGS

aten = torch.ops.aten


def _close(ours, theirs: torch.Tensor, tol: float = 1e-5) -> None:
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape, kernel, stride, padding, groups", [
    ((2, 3, 2, 8, 8), (4, 3, 2, 4, 4), [2, 4, 4], [0, 0, 0], 1),  # Qwen2.5-VL's Conv3d patch embedding
    ((2, 3, 12, 12), (6, 3, 4, 4), [4], [0], 1),  # SigLIP / CLIP's Conv2d, one stride for both dims
    ((2, 4, 9, 9), (4, 2, 3, 3), [1, 2], [1, 0], 2),
])
def test_convolution_and_its_backward(shape, kernel, stride, padding, groups):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=gen), torch.randn(kernel, generator=gen)
    b = torch.randn(kernel[0], generator=gen)
    dims = len(shape) - 2
    args = (stride, padding, [1] * dims, False, [0] * dims, groups)
    out = aten.convolution.default(x, w, b, *args)
    _close(LOWERINGS[aten.convolution.default](x.numpy(), w.numpy(), b.numpy(), *args), out)
    grad = torch.randn(out.shape, generator=gen)
    theirs = aten.convolution_backward.default(grad, x, w, [kernel[0]], *args, [True, True, True])
    ours = LOWERINGS[aten.convolution_backward.default](grad.numpy(), x.numpy(), w.numpy(), [kernel[0]], *args,
                                                        [True, True, True])
    for mine, reference in zip(ours, theirs):
        _close(mine, reference, 1e-4)


def test_layer_norm_gelu_erf_pooling_repeat_sort_and_cutting_pad():
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 5, 8, generator=gen), torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    for ours, theirs in zip(LOWERINGS[aten.native_layer_norm.default](x.numpy(), [8], w.numpy(), b.numpy(), 1e-6),
                            aten.native_layer_norm.default(x, [8], w, b, 1e-6)):
        _close(ours, theirs)
    for approximate in ("none", "tanh"):
        _close(LOWERINGS[aten.gelu.default](x.numpy(), approximate), aten.gelu.default(x, approximate=approximate))
    _close(LOWERINGS[aten.erf.default](x.numpy()), torch.erf(x))
    image = torch.randn(2, 4, 8, 8, generator=gen)
    _close(LOWERINGS[aten.avg_pool2d.default](image.numpy(), [2, 2], [2, 2]),
           aten.avg_pool2d.default(image, [2, 2], [2, 2]))
    _close(LOWERINGS[aten.repeat.default](x.numpy(), [2, 1, 1, 3]), x.repeat(2, 1, 1, 3))
    values, indices = LOWERINGS[aten.sort.default](x.numpy(), 1, True)
    _close(values, torch.sort(x, 1, descending=True).values)
    _close(LOWERINGS[aten.constant_pad_nd.default](x.numpy(), [0, -3, 1, 0]),
           aten.constant_pad_nd.default(x, [0, -3, 1, 0]))


def test_expm1_of_orpos_log_odds():
    """ORPO's log(1 - p) for p near 1 (train/orpo.py) through expm1: torch's values, small inputs too."""
    x = torch.tensor([-1e-7, -1e-3, -0.5, -3.0, -20.0])
    _close(LOWERINGS[aten.expm1.default](x.numpy()), torch.expm1(x), 1e-7)
