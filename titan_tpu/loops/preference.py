"""The loop of the preference kinds (DPO, ORPO): the shared loop (loops/base.py) over preference
pairs, whose metrics row carries the objective's terms as TRL logs them (rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, and the
objective's own), with an MoE model's balancing loss.

Validation is the objective's loss over the held-out pairs (data.val_fraction of them), defined as
its step loss is; the FLOPs per token of MFU count a frozen reference's forward too
(components/build.py, from the kind's record).
"""

from __future__ import annotations

from titan_tpu.loops.base import Loop
from titan_tpu.loops.metrics_row import moe_metrics
from titan_tpu.train.step import StepResult

__all__ = ["PreferenceLoop"]


class PreferenceLoop(Loop):
    # the two a reader follows (are the pairs ranked right, by how much) and ORPO's SFT term; the
    # chosen/rejected rewards and log-probabilities stay in metrics.jsonl and the trackers
    console_keys = ("rewards/accuracies", "rewards/margins", "nll_loss")

    def objective_metrics(self, result: StepResult) -> dict[str, float]:
        row = {name: value for name, value in result.terms.items() if name != "aux_loss"}
        row.update(moe_metrics(result))  # an MoE model's balancing loss
        return row
