"""Multi-token prediction (DeepSeek-V3): extra layers that each predict one token further ahead.

Depth k (1..D) at position i combines the previous depth's hidden state h_i (depth 1: the main
model's final hidden state, after its norm) with the embedding of token t_{i+k}, runs one
transformer block and predicts t_{i+k+1} through the shared output projection::

    x_i = eh_proj([enorm(embed(t_{i+k})); hnorm(h_i)])      # concatenated on the model dim
    h_i = block(x_i)                                        # a block of the model's own kind
    loss_k = cross_entropy(output(norm(h_i)), t_{i+k+1})

The embedding and the output projection are the main model's (shared, as in DeepSeek-V3's
report); the concatenation order (embedding first) is the published checkpoint's, as inference
engines read it. The training objective is main + weight * mean over depths of loss_k, every
loss_k summed over its targets and divided by the step's trained-token count like the main loss
(the last k positions of a sequence, or of a packed document, have no target at depth k).

Tokens come from the micro-batch itself: t_{i+k} is inputs[i+k] (the labels' last entry for the
one position past the window) and the target t_{i+k+1} is labels[i+k], so chat masks and the
loader's labels carry over; a target whose path crosses a document start is ignored.
"""

import torch
from torch import nn

from titan_tpu.models.common.norms import RMSNorm

__all__ = ["MTPLayer", "mtp_tokens"]

IGNORE_INDEX = -100  # as train/step.py's, which models must not import


class MTPLayer(nn.Module):
    """One depth: the two input norms, the projection of their concatenation, the block, and the
    norm before the shared output projection (DeepSeek's `shared_head.norm`)."""

    def __init__(self, dim: int, *, eps: float, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(dim, eps=eps)
        self.hnorm = RMSNorm(dim, eps=eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps=eps)

    def block_input(self, h_BSD: torch.Tensor, embedded_BSD: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embedding of the token k ahead); hnorm(previous depth's hidden state)])."""
        return self.eh_proj(torch.cat([self.enorm(embedded_BSD), self.hnorm(h_BSD)], dim=-1))

    @torch.no_grad()
    def init_weights(self, *, std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def mtp_tokens(inputs_BS: torch.Tensor, labels_BS: torch.Tensor, positions_BS: torch.Tensor | None, *,
               depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens t_{i+depth} [B, S], targets t_{i+depth+1} [B, S]) of one MTP depth.

    Tokens: inputs shifted left by `depth`, extended by the labels' last column (the token after
    the window), then zeros where the window ends (their targets are ignored). Targets: labels
    shifted left by `depth`, IGNORE_INDEX past the window and where a packed document starts at
    any of positions i+1..i+depth (positions_BS restart at 0 there), so no target is predicted
    across a document boundary."""
    B, S = inputs_BS.shape
    window_BS = torch.cat([inputs_BS, labels_BS[:, -1:].clamp(min=0)], dim=1)  # t_0 .. t_S
    tokens_BS = torch.cat([window_BS[:, depth:], window_BS.new_zeros(B, max(depth - 1, 0))], dim=1)[:, :S]
    targets_BS = torch.cat([labels_BS[:, depth:], labels_BS.new_full((B, min(depth, S)), IGNORE_INDEX)], dim=1)
    if positions_BS is not None:
        starts_BS = positions_BS == 0
        crossed_BS = torch.zeros_like(starts_BS)
        for j in range(1, depth + 1):  # a document starts at i + j
            crossed_BS = crossed_BS | torch.cat([starts_BS[:, j:], starts_BS.new_zeros(B, min(j, S))], dim=1)
        targets_BS = torch.where(crossed_BS, torch.full_like(targets_BS, IGNORE_INDEX), targets_BS)
    return tokens_BS, targets_BS
