"""The DPO loop: the pre-training loop (loops/pretrain.py) over preference pairs, with what differs.

The parts are the same `Components` (components/build.py builds the preference loader and the DPO
objective with its reference: components/dpo.py); the step is the same step contract, eager or
captured, with the DPO objective (train/dpo.py). What this loop changes:

* the metrics row carries the objective's terms as TRL logs them (rewards/chosen,
  rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected);
* validation is the DPO loss over the held-out pairs (data.val_fraction of them);
* FLOPs per token count the reference's forward too (a third of a trained token's: MFU stays
  the work done per second over the peak).
"""

from __future__ import annotations

import torch

from titan_tpu.loops.pretrain import Trainer, _moe_metrics
from titan_tpu.train.step import StepResult, all_reduce_sum

__all__ = ["DPOTrainer"]


class DPOTrainer(Trainer):
    @property
    def flops_per_token(self) -> float:
        """The policy's forward and backward (the spec's figure) plus the reference's forward."""
        return self.components.flops_per_token * 4 / 3

    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        row = {name: value for name, value in result.terms.items() if name != "aux_loss"}
        row.update(_moe_metrics(result))  # an MoE model's balancing loss and loads
        return row

    @torch.no_grad()
    def validate(self) -> float:
        """The mean DPO loss over the held-out pairs on all ranks."""
        assert self.val_loader is not None
        totals = torch.zeros(2, device=self.backend.device)  # summed pair losses, pairs
        for batch in self.val_loader.val_batches(self.cfg.validation.steps):
            batch = batch.to(self.backend.device)
            totals[0] += self.step_fn.evaluate(batch)[0]  # the pairs' summed loss (a count of 1)
            totals[1] += batch.shape[0]
        all_reduce_sum(totals)
        return (totals[0] / totals[1].clamp(min=1)).item()
