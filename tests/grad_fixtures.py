"""Comparing two computations' fp32 gradients with tolerances that hold on every machine, also for
a gradient whose exact value is 0.

A linear layer's bias gradient is the sum over the batch's tokens of the layer's output gradient:
sum_n dy_n. Computed in fp32, in two orders (packed rows or one conversation a row, our model or
transformers'), each sum is off by at most (n - 1) * eps/2 * sum_n |dy_n| (the bound of recursive
summation, Higham, Accuracy and Stability of Numerical Algorithms, 4.2), so the two differ by up to
n * eps * sum_n |dy_n|. That is the floor of a bias's comparison: a tolerance relative to the
gradient alone fails where the exact gradient is 0 and the computed one is rounding noise, as a key
projection's bias is (the softmax over keys ignores a shift common to them all), and an absolute
floor (1e-9) is the noise's size on one CPU and not on another (1.16e-9 was seen). Every other
comparison stays relative to the tensor's own largest entry.
"""

from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps


class BiasTerms:
    """Records, during the backward passes of the model's forwards inside the `with`, per linear bias
    (by parameter name) the sum over tokens of |the layer's output gradient| and the token count."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.abs_sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}

    def __enter__(self) -> BiasTerms:
        self._handles = [module.register_forward_hook(self._forward(f"{name}.bias"))
                         for name, module in self.model.named_modules()
                         if isinstance(module, torch.nn.Linear) and module.bias is not None]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _forward(self, key: str):
        def hook(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda grad: self._add(key, grad))
        return hook

    def _add(self, key: str, grad_ND: torch.Tensor) -> None:
        grad_ND = grad_ND.detach().reshape(-1, grad_ND.shape[-1]).abs()
        self.abs_sums[key] = self.abs_sums.get(key, 0) + grad_ND.sum(0)
        self.tokens[key] = self.tokens.get(key, 0) + grad_ND.shape[0]

    def floor(self, key: str) -> torch.Tensor | float:
        """Per entry, how far two fp32 orders of the bias's sum can be apart (module docstring); 0 for
        a parameter that is not a linear bias."""
        if key not in self.abs_sums:
            return 0.0
        return self.tokens[key] * EPS * self.abs_sums[key]


def assert_gradients_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], terms: BiasTerms,
                           *, rtol: float = 1e-5) -> None:
    """got[k] equals expected[k] within rtol of expected[k]'s largest entry, or within the rounding
    bound of its sum where k is a linear bias (`terms` recorded the backward that gave `expected`)."""
    assert got.keys() == expected.keys(), set(got) ^ set(expected)
    for key, grad in got.items():
        want = expected[key]
        tolerance = torch.clamp(torch.as_tensor(terms.floor(key)), min=rtol * want.abs().max().item())
        off = (grad - want).abs() - tolerance
        assert (off <= 0).all(), (f"{key}: {int((off > 0).sum())} of {off.numel()} entries off; the worst by "
                                  f"{off.max().item():.3g} past its tolerance, |expected| max {want.abs().max():.3g}")
