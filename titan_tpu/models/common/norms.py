"""RMSNorm with fp32 statistics."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension, with a learned scale.

    Normalisation runs in fp32 and the result is cast back to the input dtype, so bf16
    activations keep an accurate mean of squares. Uses torch's fused ``F.rms_norm``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


def rms_norm_saved_per_row(dim: int, *, partitioned: bool = False) -> tuple[int, int]:
    """What an `RMSNorm` forward keeps for its backward, per normalised row, as (elements of the
    input dtype, fp32 elements): its input and input * rstd (F.rms_norm decomposes into ops that
    save both), and the one rstd value. Its output is kept by whoever consumes it.
    partitioned: what a min-cut partitioner keeps instead (scan's own autograd in graph mode,
    models/common/scan.py): the input and rstd; input * rstd is recomputed in the backward."""
    return (dim if partitioned else 2 * dim), 1
