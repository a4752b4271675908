"""SwiGLU feed-forward block."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: w1 is the gate, w3 the up projection, w2 the down projection
    (TorchTitan/Meta names; HF calls them gate_proj, up_proj, down_proj)."""

    def __init__(self, *, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))


def feed_forward_saved_per_token(hidden_dim: int, *, partitioned: bool = False) -> int:
    """Compute-dtype elements `FeedForward.forward` keeps per token without activation
    checkpointing (its input is counted by the block): w1's and w3's outputs, silu's output and
    the product w2 reads. partitioned: a min-cut partitioner (scan's own autograd in graph mode)
    keeps three of the four and recomputes the fourth with one pointwise op."""
    return (3 if partitioned else 4) * hidden_dim


def feed_forward_matmul_outputs_per_token(*, dim: int, hidden_dim: int) -> int:
    """Outputs of w1, w3 and w2 per token: what selective checkpointing keeps of the layer."""
    return 2 * hidden_dim + dim
