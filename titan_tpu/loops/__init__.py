"""The run's loops, and the one direction a run is assembled in:

    command line -> RunSetup (run/setup.py: the config checked once, the model spec resolved) ->
    Components (components/build.py: the run resolved for its world, run/resolved.py, then the
    parts built from it and the kind's record, kinds/) -> the kind's loop (here), which drives them.

The loops, each a `Loop` (loops/base.py) beside the others:

* loops/pretrain.py `PretrainLoop`: pre-training and SFT (the next-token objective);
* loops/preference.py `PreferenceLoop`: preference pairs (DPO, ORPO);
* loops/grpo.py `GRPOLoop`: online RL: samples of the current policy, scored by a reward, the GRPO
  objective.

A kind's record names its loop (kinds/record.py `TrainingKind.loop`); a new kind whose metrics or
step differ adds its loop here, one line in `LOOPS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.components.build import Components
from titan_tpu.kinds import kind_of
from titan_tpu.loops.base import Loop
from titan_tpu.loops.grpo import GRPOLoop
from titan_tpu.loops.preference import PreferenceLoop
from titan_tpu.loops.pretrain import PretrainLoop
from titan_tpu.run.setup import prepare_run

if TYPE_CHECKING:
    from collections.abc import Callable

    from titan_tpu.config import Config

__all__ = ["LOOPS", "Loop", "assemble"]

LOOPS: dict[str, type[Loop]] = {"pretrain": PretrainLoop, "preference": PreferenceLoop, "grpo": GRPOLoop}


def assemble(cfg: Config, *, log: Callable[[str], None] | None = None) -> Loop:
    """The run of `cfg`, assembled in order: its setup, its parts, its kind's loop over them."""
    setup = prepare_run(cfg)
    kind = kind_of(cfg)
    return LOOPS[kind.loop](Components(setup, kind, log=log))
