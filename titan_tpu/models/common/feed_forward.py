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
