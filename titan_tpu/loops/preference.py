"""The loop of the preference kinds (DPO, ORPO): the shared loop (loops/base.py) over preference
pairs, with what differs:

* the metrics row carries the objective's terms as TRL logs them (rewards/chosen,
  rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, and the
  objective's own), with an MoE model's balancing loss and loads;
* validation is the objective's loss per pair over the held-out pairs (data.val_fraction of them).

The FLOPs per token of MFU count a frozen reference's forward too (components/build.py, from the
kind's record).
"""

from __future__ import annotations

import torch

from titan_tpu.loops.base import Loop
from titan_tpu.loops.metrics_row import moe_metrics
from titan_tpu.train.step import StepResult, all_reduce_sum

__all__ = ["PreferenceLoop"]


class PreferenceLoop(Loop):
    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        row = {name: value for name, value in result.terms.items() if name != "aux_loss"}
        row.update(moe_metrics(result))  # an MoE model's balancing loss and loads
        return row

    @torch.no_grad()
    def validate(self) -> float:
        """The mean loss per pair over the held-out pairs on all ranks."""
        parts = self.components
        assert parts.val_loader is not None
        totals = torch.zeros(2, device=parts.backend.device)  # summed pair losses, pairs
        for batch in parts.val_loader.val_batches(self.cfg.validation.steps):
            batch = batch.to(parts.backend.device)
            totals[0] += parts.step_fn.evaluate(batch)[0]  # the pairs' summed loss (a count of 1)
            totals[1] += batch.shape[0]
        all_reduce_sum(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()
