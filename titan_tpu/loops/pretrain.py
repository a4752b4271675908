"""The pre-training and SFT loop: next-token prediction (train/objective.py `NextTokenObjective`).

What it adds to the shared loop (loops/base.py): validation as the mean cross-entropy per trained
token over the held-out batches, and a metrics row with an MoE model's balancing loss and expert
loads and an MTP model's multi-token-prediction loss.
"""

from __future__ import annotations

import torch

from titan_tpu.data.batch import as_batch
from titan_tpu.loops.base import Loop
from titan_tpu.loops.metrics_row import next_token_metrics
from titan_tpu.train.step import IGNORE_INDEX, StepResult, all_reduce_sum

__all__ = ["PretrainLoop"]


class PretrainLoop(Loop):
    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        return next_token_metrics(result)

    @torch.no_grad()
    def validate(self) -> float:
        """The mean cross-entropy per trained token over the held-out batches on all ranks."""
        parts = self.components
        assert parts.val_loader is not None
        # fp32, not fp64: TPUs have no fast fp64, and a few batches' sums fit fp32 well enough.
        totals = torch.zeros(2, device=parts.backend.device)  # loss sum, tokens
        for batch in parts.val_loader.val_batches(self.cfg.validation.steps):
            batch = as_batch(batch).to(parts.backend.device)
            totals[0] += parts.step_fn.evaluate(batch)[0]  # the summed cross-entropy (a count of 1)
            totals[1] += (batch.labels_BS != IGNORE_INDEX).sum()
        all_reduce_sum(totals)
        return (totals[0] / totals[1]).item()
