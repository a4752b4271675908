"""Direct preference optimisation (Rafailov et al., 2023) as an objective (train/objective.py).

A micro-batch is a `PreferenceBatch`: B prompts, each with a chosen and a rejected completion,
labels on the completion tokens only. The policy (the trained model) and the reference (frozen)
each score both completions as the summed log-probability of their tokens, in one forward of the
2B rows; with the log-ratios r_c = log pi(chosen) - log ref(chosen), r_r likewise,

    sigmoid:  loss = -log sigmoid(beta * (r_c - r_r))
    hinge:    loss = max(0, 1 - beta * (r_c - r_r))

averaged over the step's pairs on all ranks (so accumulation and data parallelism equal one large
batch), plus an MoE model's balancing loss as in next-token training. These are TRL's DPOTrainer
formulas (loss types "sigmoid" and "hinge", reverse-KL), and its metrics: rewards/chosen =
beta * r_c and rewards/rejected = beta * r_r (means over pairs), rewards/margins (their
difference), rewards/accuracies (the share of pairs whose chosen reward is the larger), and
logps/chosen, logps/rejected (the policy's summed log-probabilities).

The reference is a frozen module the objective holds (`frozen_modules`: a copy of the starting
weights, graph inputs in the captured step) or, with `reference=None`, the policy itself with its
LoRA adapters off (models/lora.py `adapters_disabled`): the base model, with no second copy.
Its forward runs without gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from titan_tpu.data.batch import Batch, PreferenceBatch, TokenBatch
from titan_tpu.train.objective import MicroBatchLoss, ModelCalls, StepTerms, terms_then_loads

__all__ = ["DPOObjective", "LOSS_TYPES"]

LOSS_TYPES = ("sigmoid", "hinge")


class DPOObjective:
    name = "dpo"
    terms = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected", "aux_loss")

    def __init__(self, *, beta: float, loss_type: str = "sigmoid", reference: nn.Module | None = None):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"dpo.loss_type = {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
        self.beta, self.loss_type, self.reference = beta, loss_type, reference
        self.load_shape: torch.Size | None = None  # the expert loads' shape, known once a forward ran

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {} if self.reference is None else {"reference": self.reference}

    def step_count(self, micro_batches: list[Batch], dp_size: int) -> int:
        """Pairs in the step on all data-parallel ranks (every rank's micro-batches hold the same count)."""
        return sum(b.shape[0] for b in micro_batches) * dp_size

    def step_tokens(self, micro_batches: list[Batch], count: int, dp_size: int) -> int:
        """Both sides of every pair, whole rows (padding included: the forward reads them)."""
        return 2 * count * micro_batches[0].shape[1]

    def _reference_logps(self, calls: ModelCalls, tokens_BS: Tensor, labels_BS: Tensor) -> Tensor:
        with torch.no_grad():
            if self.reference is None:  # the policy's base model: its adapters skipped
                from titan_tpu.models.lora import adapters_disabled

                with adapters_disabled():
                    return -calls.policy(tokens_BS, labels_BS, per_sequence=True).ce_sum
            return -calls.frozen["reference"](tokens_BS, labels_BS, per_sequence=True).ce_sum

    def losses(self, margin_B: Tensor) -> Tensor:
        """Each pair's loss from its margin r_c - r_r."""
        if self.loss_type == "hinge":
            return torch.relu(1 - self.beta * margin_B)
        return -F.logsigmoid(self.beta * margin_B)

    def micro_batch(self, calls: ModelCalls, batch: PreferenceBatch, *, count: int | Tensor,
                    share: float) -> MicroBatchLoss:
        B = batch.shape[0]
        # Chosen rows then rejected rows: one forward of the policy (and of the reference) for both.
        tokens_BS = torch.cat([batch.chosen.inputs_BS, batch.rejected.inputs_BS])
        labels_BS = torch.cat([batch.chosen.labels_BS, batch.rejected.labels_BS])
        out = calls.policy(tokens_BS, labels_BS, per_sequence=True)
        logps_B = -out.ce_sum
        ref_B = self._reference_logps(calls, tokens_BS, labels_BS)
        chosen_ratio_B, rejected_ratio_B = logps_B[:B] - ref_B[:B], logps_B[B:] - ref_B[B:]
        loss = self.losses(chosen_ratio_B - rejected_ratio_B).sum() / count
        aux = out.aux_loss * share
        chosen_B, rejected_B = self.beta * chosen_ratio_B.detach(), self.beta * rejected_ratio_B.detach()
        shares = torch.stack([chosen_B.sum(), rejected_B.sum(), (chosen_B > rejected_B).float().sum(),
                              (chosen_B - rejected_B).sum(), logps_B[:B].detach().sum(),
                              logps_B[B:].detach().sum()]) / count
        self.load_shape = out.expert_load.shape
        totals = torch.cat([loss.detach().view(1), shares, aux.detach().view(1), out.expert_load.flatten()])
        return MicroBatchLoss(loss + aux, totals)

    def expert_load(self, totals: Tensor) -> Tensor:
        return totals[len(self.terms):].view(self.load_shape)

    def report(self, totals: Tensor) -> StepTerms:
        return terms_then_loads(self.terms, totals, self.load_shape)

    def validation_sums(self, batch: PreferenceBatch, totals: Tensor) -> Tensor:
        """The pairs' summed loss and their number."""
        return torch.stack([totals[0], torch.tensor(float(batch.shape[0]), device=totals.device)])

    def validation_loss(self, sums: Tensor) -> Tensor:
        """The mean loss per pair."""
        return sums[0] / sums[1].clamp(min=1)

    def example_batch(self, *, batch_size: int, seq_len: int, documents: bool, device: torch.device) -> PreferenceBatch:
        def rows() -> TokenBatch:
            return TokenBatch(torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),
                              torch.zeros(batch_size, seq_len, dtype=torch.long, device=device))

        return PreferenceBatch(rows(), rows())
