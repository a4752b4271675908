"""The run's loops, one per kind of training, each driving the parts components/ built:

* loops/pretrain.py `Trainer`: pre-training and SFT (the next-token objective);
* loops/dpo.py `DPOTrainer`: preference pairs against a frozen reference (the DPO objective);
* loops/grpo.py `GRPOTrainer`: online RL: samples of the current policy, scored by a reward, the
  GRPO objective.

`trainer_for(cfg)` picks the loop of training.objective. A new kind of training is a loop here
beside these, with its objective in train/ and its parts in components/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.loops.pretrain import Trainer

__all__ = ["trainer_for"]


def trainer_for(cfg: Config) -> Trainer:
    """The loop of training.objective, its parts built."""
    if cfg.training.objective == "grpo":
        from titan_tpu.loops.grpo import GRPOTrainer

        return GRPOTrainer(cfg)
    if cfg.training.objective == "dpo":
        from titan_tpu.loops.dpo import DPOTrainer

        return DPOTrainer(cfg)
    from titan_tpu.loops.pretrain import Trainer

    return Trainer(cfg)
