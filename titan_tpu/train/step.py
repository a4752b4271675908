"""The step contract, shared by the eager trainer and the graph trainer::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens)

It consumes ``training.grad_accum_steps`` micro-batches; afterwards the model parameters and the
optimizer state hold their updated values. A micro-batch is ``(inputs_BS, labels_BS)`` or, with
document masking, ``(inputs_BS, labels_BS, positions_BS)`` (positions restart at 0 where a packed
document starts; see data/loader.py).

The loss of a step is the sum of token cross-entropies over all its micro-batches and ranks,
divided by the step's token count on all ranks, so k micro-batches of b sequences on each of n
ranks give the same gradient as one batch of n*k*b sequences, and the gradient reduction only
has to sum. The model computes the summed cross-entropy itself (``model(inputs, labels)``),
through the loss kernel, so the logits need never be whole.

This module sits below both train/trainer.py and graph/: neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_tpu.train.optim import AdamW, clip_grad_norm_

__all__ = ["EagerStep", "StepResult", "all_reduce_sum", "batch_loss_sum", "split_batch"]


@dataclass
class StepResult:
    loss: float  # mean cross-entropy per token over the step's micro-batches, on all ranks
    grad_norm: float  # global gradient norm before clipping
    num_tokens: int  # tokens of the step, on all ranks


def split_batch(batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(inputs_BS, labels_BS, positions_BS or None) from a 2- or 3-tuple micro-batch."""
    if len(batch) not in (2, 3):
        raise ValueError(f"a micro-batch is (inputs, labels) or (inputs, labels, positions), got {len(batch)} tensors")
    inputs, labels, *rest = batch
    return inputs, labels, (rest[0] if rest else None)


def batch_loss_sum(model: torch.nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    """Summed next-token cross-entropy of one micro-batch (0-dim fp32)."""
    inputs, labels, positions = split_batch(batch)
    return model(inputs, labels, positions_BS=positions)


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over all ranks in place (a no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


class EagerStep:
    """The step contract with plain autograd: accumulate, clip, AdamW, all in place.

    The in-place forms of clipping and AdamW run the same arithmetic as the pure functions the
    graph trainer traces, without allocating a second copy of gradients, weights and moments.
    With SimpleFSDP the parameters and gradients are DTensors; the code is the same.
    """

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, *, max_norm: float, dp_size: int = 1):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.dp_size = dp_size
        self.params = dict(model.named_parameters())

    def __call__(self, micro_batches: list[tuple[Tensor, ...]], lr: float) -> StepResult:
        # Every rank has the same batch shape, so the step's token count is known up front.
        num_tokens = sum(split_batch(b)[1].numel() for b in micro_batches) * self.dp_size
        loss_sum = torch.zeros((), device=micro_batches[0][0].device)
        for batch in micro_batches:
            loss = batch_loss_sum(self.model, batch) / num_tokens
            loss.backward()
            loss_sum += loss.detach()
        grads = {name: p.grad for name, p in self.params.items()}
        grad_norm = clip_grad_norm_(grads, self.max_norm)
        self.optimizer.step(grads, lr=lr)
        for p in self.params.values():
            p.grad = None
        all_reduce_sum(loss_sum)  # each rank holds its share of the global mean
        return StepResult(loss=loss_sum.item(), grad_norm=grad_norm.item(), num_tokens=num_tokens)
