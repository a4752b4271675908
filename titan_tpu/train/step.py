"""The step contract, shared by the eager trainer and the graph trainer::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens, terms, expert_load)

It consumes ``training.grad_accum_steps`` micro-batches (typed batches, data/batch.py; a plain
``(inputs, labels[, positions])`` tuple is read as a `TokenBatch`); afterwards the model parameters
and the optimizer state hold their updated values, or, for a step that keeps them on its device
(the JAX path, graph/jax_step.py), do once `state_to_host()` is called. The rest of the contract
(`StepFunction`): `evaluate(batch)`, a validation batch's totals, and `state_to_host()` /
`state_from_host()`, called before anything reads the model's and optimizer's tensors (a
checkpoint) and after anything writes them (a resume).

What a micro-batch's loss is and how the micro-batches' losses add up is the run's objective
(train/objective.py), written once for this eager step and the captured one (graph/capture.py):
for next-token training, the sum of token cross-entropies over all micro-batches and ranks
divided by the step's token count on all ranks, so k micro-batches of b sequences on each of n
ranks give the same gradient as one batch of n*k*b sequences, and the gradient reduction only has
to sum. The step sums the objective's reported totals over micro-batches and ranks (one
all-reduce), and with auxiliary-loss-free balancing moves the expert biases after the optimizer
update, from the global loads.

This module sits below both loops/pretrain.py and graph/: neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

from titan_tpu.data.batch import IGNORE_INDEX, Batch, as_batch
from titan_tpu.model_contract import TrainableModel, gradient_reducer
from titan_tpu.train.objective import ModelCalls, NextTokenObjective, Objective
from titan_tpu.train.optim import AdamW, clip_grad_norm_
from titan_tpu.train.profiling import OPTIMIZER_REGION
from titan_tpu.train.ranks import all_reduce_sum, model_copies

__all__ = ["IGNORE_INDEX", "EagerStep", "StepFunction", "StepResult", "all_reduce_sum", "batch_loss",
           "evaluate_eagerly", "model_copies"]


@dataclass
class StepResult:
    loss: float  # the objective's loss over the step's micro-batches, on all ranks (next-token: mean per token)
    grad_norm: float  # global gradient norm before clipping
    num_tokens: int  # tokens of the step, on all ranks
    terms: dict[str, float] = field(default_factory=dict)  # the objective's other reported terms (Objective.terms)
    expert_load: torch.Tensor | None = None  # MoE: tokens per expert per layer [L, E], all ranks; else None
    # False: the step's gradients were not applied (replica fault tolerance: a peer died mid-step), the
    # model and optimizer are as before it, and the loop takes the step again.
    committed: bool = True

    @property
    def aux_loss(self) -> float:
        """MoE balancing loss (coefficient applied), mean over micro-batches and ranks; 0 without one."""
        return self.terms.get("aux_loss", 0.0)

    @property
    def mtp_loss(self) -> float | None:
        """Multi-token prediction's cross-entropy (unweighted), as `loss`; None without MTP."""
        return self.terms.get("mtp_loss")


def batch_loss(model: torch.nn.Module, batch: Batch | tuple[Tensor, ...]):
    """The model's `LossOutput` for one token micro-batch (summed cross-entropy, balancing loss, loads)."""
    batch = as_batch(batch)
    return model(batch.inputs_BS, batch.labels_BS, positions_BS=batch.positions_BS)


@torch.no_grad()
def evaluate_eagerly(model: torch.nn.Module, objective: Objective, batch: Batch | tuple[Tensor, ...]) -> Tensor:
    """One validation batch's totals of `objective` with a count of 1 (its summed loss first), the
    model in eval mode and without gradients."""
    was_training = model.training
    model.eval()
    try:
        calls = ModelCalls(policy=model, frozen=objective.frozen_modules())
        return objective.micro_batch(calls, as_batch(batch), count=1, share=0.0).totals
    finally:
        model.train(was_training)


class StepFunction:
    """The step contract besides the step itself (module docstring), with the behaviour of a step
    that updates the model's and the optimizer's own tensors in place (EagerStep, GraphStep)."""

    def __call__(self, micro_batches: list[Batch | tuple[Tensor, ...]], lr: float) -> StepResult:
        raise NotImplementedError

    def evaluate(self, batch: Batch | tuple[Tensor, ...]) -> Tensor:
        """One validation batch's totals of the run's objective with a count of 1 (the summed loss first)."""
        return evaluate_eagerly(self.model, self.objective, batch)

    # lm-eval's log-likelihoods from the step's own program on its device state (evaluation/harness.py
    # `Scorer`: rows -> each position's log-probability of its label, whether it is the most likely);
    # None: the model's logits, as every step that keeps its state in the model has them.
    score: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None

    def state_to_host(self) -> None:
        """Write the newest parameters, optimizer state and updated buffers into the model's and the
        optimizer's tensors (nothing to do when the step updates them in place)."""

    def state_from_host(self) -> None:
        """Take the model's and the optimizer's tensors as the state of the next step (after a resume
        wrote them; nothing to do when the step reads them in place)."""


def update_expert_biases_(model: torch.nn.Module, expert_load: Tensor) -> None:
    """Auxiliary-loss-free balancing, in place: move the model's expert biases by the step's global
    expert loads (a no-op for models without them)."""
    names = model.expert_bias_names() if isinstance(model, TrainableModel) else []
    if not names:
        return
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in model.updated_expert_biases({n: buffers[n] for n in names}, expert_load).items():
            buffers[name].copy_(value)


class EagerStep(StepFunction):
    """The step contract with plain autograd: accumulate, clip, AdamW, all in place.

    The in-place forms of clipping and AdamW run the same arithmetic as the pure functions the
    graph trainer traces, without allocating a second copy of gradients, weights and moments.
    With SimpleFSDP the parameters and gradients are DTensors; the code is the same.

    `grad_sync` (replica fault tolerance, set by the loop: train/replica_ft.py `ReplicaFT.average`)
    averages the gradients across replica groups after backward, before clipping; when it returns
    False (a peer died mid-step) nothing is applied and the result says so (`committed`).
    """

    grad_sync: Callable[[list[Tensor]], bool] | None = None

    def __init__(self, model: torch.nn.Module, optimizer: AdamW, *, max_norm: float, dp_size: int = 1,
                 objective: Objective | None = None):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.dp_size = dp_size
        self.objective = objective or NextTokenObjective()
        self.calls = ModelCalls(policy=model, frozen=self.objective.frozen_modules())
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}  # LoRA: adapters only
        self.reducer = gradient_reducer(model)  # sums its own layout needs (model contract), before grad_sync

    def __call__(self, micro_batches: list[Batch | tuple[Tensor, ...]], lr: float) -> StepResult:
        batches = [as_batch(b) for b in micro_batches]
        count = self.objective.step_count(batches, self.dp_size)
        share = 1.0 / (len(batches) * self.dp_size)  # a mean term's weight per micro-batch
        totals = None
        for batch in batches:
            loss = self.objective.micro_batch(self.calls, batch, count=count, share=share)
            loss.objective.backward()
            totals = loss.totals if totals is None else totals + loss.totals
        # A parameter the loss does not reach (a module of the model unused by this forward) gets a
        # zero gradient, as in the captured step, rather than no entry.
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.params.items()}
        if self.reducer is not None:  # e.g. the weights every pipeline stage holds: each stage's part summed
            self.reducer.sum_(grads)
        if self.grad_sync is not None and not self.grad_sync(list(grads.values())):
            for p in self.params.values():
                p.grad = None
            return StepResult(loss=float("nan"), grad_norm=float("nan"), num_tokens=0, committed=False)
        with record_function(OPTIMIZER_REGION):  # a region of its own in profiles (train/profiling.py)
            grad_norm = clip_grad_norm_(grads, self.max_norm)
            self.optimizer.step(grads, lr=lr)
        for p in self.params.values():
            p.grad = None
        # Each rank holds its share of the global terms and its own loads: one sum over ranks.
        totals = all_reduce_sum(totals)
        copies = model_copies(self.dp_size)
        totals = totals / copies if copies > 1 else totals
        report = self.objective.report(totals)
        if report.expert_load is not None:
            update_expert_biases_(self.model, report.expert_load)
        values = dict(report.values)
        return StepResult(loss=values.pop("loss"), grad_norm=grad_norm.item(),
                          num_tokens=self.objective.step_tokens(batches, count, self.dp_size), terms=values,
                          expert_load=report.expert_load)
