"""The step contract, shared by the eager trainer and the graph trainer::

    step_fn(micro_batches, lr) -> StepResult(loss, grad_norm, num_tokens)

It consumes ``training.grad_accum_steps`` micro-batches; afterwards the model parameters and the
optimizer state hold their updated values. A micro-batch is ``(inputs_BS, labels_BS)`` or, with
document masking, ``(inputs_BS, labels_BS, positions_BS)`` (positions restart at 0 where a packed
document starts; see data/loader.py).

The loss of a step is the sum of token cross-entropies over all its micro-batches and ranks,
divided by the step's token count on all ranks, so k micro-batches of b sequences on each of n
ranks give the same gradient as one batch of n*k*b sequences, and the gradient reduction only
has to sum. The model computes the summed cross-entropy itself (``model(inputs, labels)`` returns
a `LossOutput`), through the loss kernel, so the logits need never be whole. A mixture-of-experts
model adds its balancing loss (coefficient applied), averaged over the micro-batches and ranks,
and reports its expert loads, which are summed over them; with auxiliary-loss-free balancing the
expert biases move after the optimizer update, from the global loads. A model with multi-token
prediction returns its summed cross-entropy beside the main one: it is divided by the same token
count and trained with the model's weight (models/common/mtp.py), and reported on its own.

This module sits below both train/trainer.py and graph/: neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import record_function

from titan_tpu.model_contract import TrainableModel
from titan_tpu.train.optim import AdamW, clip_grad_norm_
from titan_tpu.train.profiling import OPTIMIZER_REGION

__all__ = ["IGNORE_INDEX", "EagerStep", "StepResult", "all_reduce_sum", "batch_loss", "model_copies", "split_batch"]

IGNORE_INDEX = -100  # a label the loss skips (chat data: every token that is not the assistant's)


@dataclass
class StepResult:
    loss: float  # mean cross-entropy per token over the step's micro-batches, on all ranks
    grad_norm: float  # global gradient norm before clipping
    num_tokens: int  # tokens of the step, on all ranks
    aux_loss: float = 0.0  # MoE balancing loss (coefficient applied), mean over micro-batches and ranks
    expert_load: torch.Tensor | None = None  # MoE: tokens per expert per layer [L, E], all ranks; else None
    mtp_loss: float | None = None  # multi-token prediction's cross-entropy (unweighted), as `loss`; else None


def split_batch(batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(inputs_BS, labels_BS, positions_BS or None) from a 2- or 3-tuple micro-batch."""
    if len(batch) not in (2, 3):
        raise ValueError(f"a micro-batch is (inputs, labels) or (inputs, labels, positions), got {len(batch)} tensors")
    inputs, labels, *rest = batch
    return inputs, labels, (rest[0] if rest else None)


def batch_loss(model: torch.nn.Module, batch: tuple[Tensor, ...]):
    """The model's `LossOutput` for one micro-batch (summed cross-entropy, balancing loss, loads)."""
    inputs, labels, positions = split_batch(batch)
    return model(inputs, labels, positions_BS=positions)


def mtp_share(out, num_tokens) -> Tensor | None:
    """A micro-batch's share of the step's multi-token-prediction loss (unweighted; None without MTP)."""
    return None if out.mtp_ce_sum is None else out.mtp_ce_sum / num_tokens


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


def all_reduce_sum(t: Tensor) -> Tensor:
    """Sum over all ranks in place (a no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def model_copies(dp_size: int) -> int:
    """Ranks that hold the same data-parallel rank's batch (tensor- and context-parallel ranks):
    each computes the whole loss of that batch (context parallelism sums its ranks' shares inside
    the model, parallel/context_parallel.py), so a sum over all ranks counts it this many times."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return max(1, world // dp_size)


def trained_tokens(micro_batches: list[tuple[Tensor, ...]], dp_size: int) -> int:
    """Labels the loss trains on (not IGNORE_INDEX) in the step's micro-batches on all data-parallel
    ranks: the loss denominator, so the mean is over trained tokens whatever their share per
    micro-batch or rank. One scalar all-reduce over the ranks (the count differs between them); the
    tensor- and context-parallel ranks of one data-parallel rank hold the same batch, so the world's
    sum counts each batch model_copies times."""
    counts = torch.stack([(split_batch(b)[1] != IGNORE_INDEX).sum() for b in micro_batches]).sum()
    if dp_size > 1:
        counts = all_reduce_sum(counts) // model_copies(dp_size)
    # At least 1: a step whose rows train nothing (possible with chat rows) gives loss 0, not NaN.
    return max(int(counts.item()), 1)


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
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}  # LoRA: adapters only

    def __call__(self, micro_batches: list[tuple[Tensor, ...]], lr: float) -> StepResult:
        num_tokens = trained_tokens(micro_batches, self.dp_size)
        aux_share = 1.0 / (len(micro_batches) * self.dp_size)  # the balancing loss is averaged
        loss_sum = aux_sum = load = mtp_sum = None
        for batch in micro_batches:
            out = batch_loss(self.model, batch)
            ce = out.ce_sum / num_tokens
            aux = out.aux_loss * aux_share
            mtp = mtp_share(out, num_tokens)
            (ce + aux if mtp is None else ce + aux + out.mtp_weight * mtp).backward()
            if mtp is not None:
                mtp_sum = mtp.detach() if mtp_sum is None else mtp_sum + mtp.detach()
            loss_sum = ce.detach() if loss_sum is None else loss_sum + ce.detach()
            aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
            load = out.expert_load if load is None else load + out.expert_load
        # A parameter the loss does not reach (a module of the model unused by this forward) gets a
        # zero gradient, as in the captured step, rather than no entry.
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.params.items()}
        with record_function(OPTIMIZER_REGION):  # a region of its own in profiles (train/profiling.py)
            grad_norm = clip_grad_norm_(grads, self.max_norm)
            self.optimizer.step(grads, lr=lr)
        for p in self.params.values():
            p.grad = None
        # Each rank holds its share of the global means and its own loads: one sum over ranks.
        mtp_total = torch.zeros_like(loss_sum) if mtp_sum is None else mtp_sum
        totals = all_reduce_sum(torch.cat([loss_sum.view(1), aux_sum.view(1), mtp_total.view(1), load.flatten()]))
        copies = model_copies(self.dp_size)
        totals = totals / copies if copies > 1 else totals
        expert_load = totals[3:].view(load.shape) if load.numel() else None
        if expert_load is not None:
            update_expert_biases_(self.model, expert_load)
        return StepResult(loss=totals[0].item(), grad_norm=grad_norm.item(), num_tokens=num_tokens,
                          aux_loss=totals[1].item(), expert_load=expert_load,
                          mtp_loss=None if mtp_sum is None else totals[2].item())
