"""The pre-training and SFT loop: next-token prediction (train/objective.py `NextTokenObjective`).

What it adds to the shared loop (loops/base.py): a metrics row with an MoE model's balancing loss
and an MTP model's multi-token-prediction loss (the expert loads are every kind's: loops/routing.py).
Validation is the objective's: the mean cross-entropy per trained token over the held-out batches.
"""

from __future__ import annotations

from titan_tpu.loops.base import Loop
from titan_tpu.loops.metrics_row import next_token_metrics
from titan_tpu.train.step import StepResult

__all__ = ["PretrainLoop"]


class PretrainLoop(Loop):
    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        return next_token_metrics(result)
