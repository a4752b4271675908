"""How the next token is chosen from a step's logits: greedy, or sampled with a temperature and
the top-k / top-p (nucleus) filters, in the order transformers applies them (temperature, top-k,
top-p), from a seeded generator so that a seed gives the same tokens every run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (the most likely token; top_k and top_p do not apply)."""

    temperature: float = 0.0
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the most likely tokens whose probabilities sum to top_p; 1 keeps all

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature = {self.temperature} must be >= 0 (0: greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k!r} must be an integer >= 0 (0: no top-k filter)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1] (1: no nucleus filter)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits_BV: Tensor, sampling: Sampling) -> Tensor:
    """fp32 logits over the temperature, -inf outside the top-k and outside the top-p nucleus.

    The nucleus keeps a token when the probability of the tokens more likely than it is below
    top_p, so the most likely token always stays (transformers' rule, written from the top)."""
    x_BV = logits_BV.float() / sampling.temperature
    if 0 < sampling.top_k < x_BV.shape[-1]:
        kth_B1 = x_BV.topk(sampling.top_k, dim=-1).values[:, -1:]
        x_BV = x_BV.masked_fill(x_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1:
        sorted_BV, order_BV = x_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        drop_sorted_BV = probs_BV.cumsum(dim=-1) - probs_BV >= sampling.top_p
        drop_BV = torch.empty_like(drop_sorted_BV).scatter_(-1, order_BV, drop_sorted_BV)  # back to vocab order
        x_BV = x_BV.masked_fill(drop_BV, float("-inf"))
    return x_BV


def next_tokens(logits_BV: Tensor, sampling: Sampling, generator: torch.Generator | None) -> Tensor:
    """One token per row [B] (int64): the argmax when greedy, else a draw from the filtered
    distribution with `generator`."""
    if sampling.greedy:
        return logits_BV.argmax(dim=-1)
    probs_BV = filtered_logits(logits_BV, sampling).softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
