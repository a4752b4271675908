"""Direct preference optimisation (docs/dpo.md): preference pairs scored against a frozen reference
policy (train/dpo.py `DPOObjective`), data parallelism alone, driven by the preference loop.

The reference (dpo.reference):

* "initial", without LoRA: a second model built exactly as the trained one (same spec, seed,
  sharding) and given the same starting weights (checkpoint.initial_load_path, or the HF
  directory's own, or the seeded init), frozen: a run resumed from a checkpoint rebuilds it
  from the same start, so a checkpoint holds no copy of it;
* "initial", with LoRA: no second model: the trained model with its adapters off is the base
  model (train/dpo.py, models/lora.py `adapters_disabled`);
* a path (a training checkpoint or an HF directory): a frozen model of the same architecture
  loaded from it.

Its forward runs over the same rows as the policy's, once per trained forward and backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.data.batch import PreferenceBatch
from titan_tpu.kinds.preference import PREFERENCE_COLUMNS, PREFERENCE_ROWS, preference_data, two_rows
from titan_tpu.kinds.record import DATA_PARALLEL_ONLY, TrainingKind
from titan_tpu.train.dpo import DPOObjective

if TYPE_CHECKING:
    from torch import nn

    from titan_tpu.config import Config

__all__ = ["DPO"]


def dpo_objective(cfg: Config, reference: nn.Module | None) -> DPOObjective:
    return DPOObjective(beta=cfg.dpo.beta, loss_type=cfg.dpo.loss_type, reference=reference)


DPO = TrainingKind(
    name="dpo", section="dpo", data_formats=("preference",), rows=PREFERENCE_ROWS, columns=PREFERENCE_COLUMNS,
    batch=PreferenceBatch, data=preference_data, objective=dpo_objective, loop="preference",
    rows_per_sample=two_rows, reference=lambda cfg: cfg.dpo.reference, reference_role="dpo: reference policy",
    reference_forwards=lambda cfg: 1.0, axes=DATA_PARALLEL_ONLY, ignores_labels=True)
