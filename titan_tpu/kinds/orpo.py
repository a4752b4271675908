"""Odds ratio preference optimisation (ORPO): preference pairs without a reference model (train/orpo.py
`ORPOObjective`), the chosen rows' NLL plus the odds-ratio term; data parallelism alone, driven by the
preference loop. A micro-batch holds the pairs' two rows and, when the NLL covers the prompt (TRL's),
the chosen rows a second time with the prompt's labels."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.data.batch import PreferenceBatch
from titan_tpu.kinds.preference import PREFERENCE_COLUMNS, PREFERENCE_ROWS, preference_data
from titan_tpu.kinds.record import DATA_PARALLEL_ONLY, TrainingKind
from titan_tpu.train.orpo import ORPOObjective

if TYPE_CHECKING:
    from torch import nn

    from titan_tpu.config import Config

__all__ = ["ORPO"]


def orpo_objective(cfg: Config, reference: nn.Module | None) -> ORPOObjective:
    return ORPOObjective(beta=cfg.orpo.beta, nll_includes_prompt=cfg.orpo.nll_includes_prompt)


def rows_per_pair(cfg: Config) -> int:
    """Chosen and rejected, and the chosen again for the prompt's NLL (TRL's) when it is counted."""
    return 3 if cfg.orpo.nll_includes_prompt else 2


ORPO = TrainingKind(
    name="orpo", section="orpo", data_formats=("preference",), rows=PREFERENCE_ROWS, columns=PREFERENCE_COLUMNS,
    batch=PreferenceBatch, data=preference_data, objective=orpo_objective, loop="preference",
    rows_per_sample=rows_per_pair, axes=DATA_PARALLEL_ONLY, ignores_labels=True)
