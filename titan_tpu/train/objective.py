"""The objective of a run: the loss terms one micro-batch makes and how they add up to a step's.

Written once, used by both implementations of the step contract: `EagerStep` (train/step.py)
runs `micro_batch` under autograd, the captured step (graph/capture.py) traces the same call. An
objective answers:

* `step_count(micro_batches, dp_size)`: the step's denominator on all ranks (trained tokens for
  next-token training, preference pairs for DPO), computed before the micro-batches run, so that
  every micro-batch's share is final and accumulation equals one large batch;
* `micro_batch(calls, batch, count=, share=)`: what the backward differentiates (this
  micro-batch's share of the step's objective) and this micro-batch's `totals`, a 1-D tensor of
  its shares of the reported terms (`terms`, in order) followed by its statistics (the expert
  loads of an MoE model). The step sums `totals` over micro-batches and ranks, so a term is
  reported as a share: a sum divided by the step's count, or a mean term times `share` = 1 /
  (micro-batches x data-parallel ranks);
* `report(totals)`: the summed totals as the step's named terms (`loss` first) and statistics;
* `validation_sums(batch, totals)` and `validation_loss(sums)`: a held-out batch's share of the
  validation loss (from its totals with a count of 1), summed by the loop over batches and ranks,
  and the loss from those sums, defined as the step's loss is.

`calls` (`ModelCalls`) is how an objective reaches the models: `calls.policy(...)` is the trained
model's forward, `calls.frozen[name](...)` that of a frozen module the objective holds
(`frozen_modules`: DPO's reference copy). The eager step calls the modules; the captured step
calls them through `functional_call` with the graph's input tensors, so the objective's code
is the same in both.

A new loss term is a change to the model (which returns it) and to its objective (which weighs
and reports it); a new objective (DPO here, GRPO next) is one class beside these, and its batch
kind a class of data/batch.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from titan_tpu.data.batch import Batch, TokenBatch
from titan_tpu.train.ranks import sum_over_data_parallel

__all__ = ["MicroBatchLoss", "ModelCalls", "NextTokenObjective", "Objective", "StepTerms", "terms_then_loads"]


@dataclass
class ModelCalls:
    """The forwards an objective may call: the trained model's, and those of its frozen modules."""

    policy: Callable
    frozen: dict[str, Callable] = field(default_factory=dict)


@dataclass
class MicroBatchLoss:
    objective: Tensor  # 0-dim: what the backward differentiates, this micro-batch's share of the step's
    totals: Tensor  # 1-D: shares of the reported terms (Objective.terms order), then the statistics


@dataclass
class StepTerms:
    """A step's summed totals, named."""

    values: dict[str, float]  # Objective.terms -> value ("loss" first); a term the model did not make is absent
    expert_load: Tensor | None  # MoE: tokens per expert per layer [L, E] on all ranks; else None


def terms_then_loads(terms: tuple[str, ...], totals: Tensor, load_shape: torch.Size) -> StepTerms:
    """`totals` laid out as `terms` in order, then the expert loads (`load_shape`, [L, E]; none for
    a dense model), named."""
    load = totals[len(terms):].view(load_shape)
    return StepTerms(dict(zip(terms, totals[:len(terms)].tolist())), load if load.numel() else None)


class Objective(Protocol):
    name: str
    terms: tuple[str, ...]  # the reported terms, "loss" first: the first entries of `totals`

    def frozen_modules(self) -> dict[str, nn.Module]:
        """Modules the objective reads besides the trained model (held frozen: graph inputs, no gradients)."""
        ...

    def step_count(self, micro_batches: list[Batch], dp_size: int) -> int:
        ...

    def step_tokens(self, micro_batches: list[Batch], count: int, dp_size: int) -> int:
        """Tokens the step's forward reads on all ranks (the throughput in the metrics)."""
        ...

    def micro_batch(self, calls: ModelCalls, batch: Batch, *, count: int | Tensor, share: float) -> MicroBatchLoss:
        ...

    def expert_load(self, totals: Tensor) -> Tensor:
        """The statistics part of `totals` as expert loads [L, E] ([0, 0] for a dense model)."""
        ...

    def report(self, totals: Tensor) -> StepTerms:
        ...

    def example_batch(self, *, batch_size: int, seq_len: int, documents: bool, device: torch.device) -> Batch:
        """A batch of the shape every step will take (what the captured step is traced with)."""
        ...

    def validation_sums(self, batch: Batch, totals: Tensor) -> Tensor:
        """What one validation batch adds to the validation loss, from its totals (a count of 1): a
        1-D tensor the loop sums over the held-out batches and the ranks."""
        ...

    def validation_loss(self, sums: Tensor) -> Tensor:
        """The validation loss from the summed `validation_sums`, as the step's loss is defined."""
        ...


class NextTokenObjective:
    """Pre-training and SFT: the summed token cross-entropy of the step's micro-batches over its
    trained-token count, plus an MoE model's balancing loss (coefficient applied, averaged over
    micro-batches and ranks) and a multi-token-prediction model's loss (its summed cross-entropy
    over the same count, trained with the model's weight, reported unweighted). Reported: loss,
    aux_loss, mtp_loss; statistics: the expert loads, summed."""

    name = "next_token"
    terms = ("loss", "aux_loss", "mtp_loss")

    def __init__(self):
        self.load_shape: torch.Size | None = None  # the expert loads' shape, known once a forward ran (or was traced)
        self.has_mtp = False  # whether the model returned a multi-token-prediction loss, known likewise

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {}

    def step_count(self, micro_batches: list[Batch], dp_size: int) -> int:
        """Labels the loss trains on (not IGNORE_INDEX) in the step's micro-batches on all
        data-parallel ranks: the mean is over trained tokens whatever their share per micro-batch
        or rank. At least 1: a step whose rows train nothing (possible with chat rows) gives loss 0."""
        counts = torch.stack([b.trained_tokens() for b in micro_batches]).sum()
        return max(int(sum_over_data_parallel(counts, dp_size).item()), 1)

    def step_tokens(self, micro_batches: list[Batch], count: int, dp_size: int) -> int:
        return count  # the trained tokens, as the loss counts them

    def micro_batch(self, calls: ModelCalls, batch: TokenBatch, *, count: int | Tensor,
                    share: float) -> MicroBatchLoss:
        # Images only where the batch has them: a text model's forward takes no such argument.
        images = {} if batch.images is None else {"images": batch.images}
        out = calls.policy(batch.inputs_BS, batch.labels_BS, positions_BS=batch.positions_BS, **images)
        # count may be a graph input, not a traced constant: chat data trains a varying count.
        ce = out.ce_sum / count
        aux = out.aux_loss * share
        mtp = None if out.mtp_ce_sum is None else out.mtp_ce_sum / count
        objective = ce + aux if mtp is None else ce + aux + out.mtp_weight * mtp
        self.load_shape, self.has_mtp = out.expert_load.shape, mtp is not None
        mtp = torch.zeros_like(ce) if mtp is None else mtp
        totals = torch.cat([ce.detach().view(1), aux.detach().view(1), mtp.detach().view(1),
                            out.expert_load.flatten()])
        return MicroBatchLoss(objective, totals)

    def expert_load(self, totals: Tensor) -> Tensor:
        return totals[len(self.terms):].view(self.load_shape)

    def report(self, totals: Tensor) -> StepTerms:
        values = {"loss": totals[0].item(), "aux_loss": totals[1].item()}
        if self.has_mtp:
            values["mtp_loss"] = totals[2].item()
        load = self.expert_load(totals)
        return StepTerms(values, load if load.numel() else None)

    def example_batch(self, *, batch_size: int, seq_len: int, documents: bool, device: torch.device) -> TokenBatch:
        example = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        return TokenBatch(example, example.clone(), example.clone() if documents else None)

    def validation_sums(self, batch: TokenBatch, totals: Tensor) -> Tensor:
        """The summed cross-entropy and the trained tokens."""
        return torch.stack([totals[0], batch.trained_tokens().to(totals.dtype)])

    def validation_loss(self, sums: Tensor) -> Tensor:
        """The mean cross-entropy per trained token."""
        return sums[0] / sums[1]
