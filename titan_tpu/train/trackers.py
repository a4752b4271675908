"""Experiment trackers: where each metrics row goes besides metrics.jsonl and the console.

    [metrics]
    trackers = ["tensorboard", "wandb"]

tensorboard  event files under <run>/tensorboard (torch's SummaryWriter). A missing tensorboard
             package is a warning, not an error: metrics.jsonl has every row anyway.
wandb        Weights & Biases: the optional extra ``pip install 'titan-tpu[wandb]'``, imported only
             when listed. Online when WANDB_API_KEY is set (or WANDB_MODE=online), offline
             otherwise: the run is written under <run>/wandb/ and can be uploaded later with
             ``wandb sync``. The run id goes into the checkpoint (``state_dict``), so a resumed run
             continues the same W&B run instead of starting a new one. The offline file is flushed
             every 2 s, so a killed run loses at most that much W&B history (metrics.jsonl has it).

A tracker receives only numbers, each step once and in increasing order (MetricsLogger drops the
rows a resumed run replays).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "wandb")


def check_tracker_names(names: list[str]) -> None:
    """metrics.trackers: every name one of TRACKERS (run setup checks it before the run starts)."""
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"metrics.trackers: unknown tracker {name!r}; use some of {', '.join(TRACKERS)}")


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def state_dict(self) -> dict[str, str]: ...  # kept in the checkpoint, handed back on resume

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, writer: Any):
        self._writer = writer

    @classmethod
    def open(cls, log_dir: Path) -> TensorBoardTracker | None:
        try:  # tensorboard is optional: without it we still log to JSONL and the console
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            warnings.warn(f"TensorBoard logging disabled ({e}); pip install tensorboard to enable it", stacklevel=3)
            return None
        return cls(SummaryWriter(log_dir=str(log_dir)))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)

    def state_dict(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        self._writer.close()  # flushes pending events


def wandb_mode() -> str:
    """WANDB_MODE when set; else online with an API key in the environment, offline without."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class WandbTracker:
    def __init__(self, *, run_dir: Path, run_id: str, project: str, name: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError("metrics.trackers lists wandb, which is not installed: pip install 'titan-tpu[wandb]' "
                             "or remove wandb from metrics.trackers") from None
        options = dict(x_disable_stats=True, console="off", silent=True)
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:
            # The offline .wandb file is written every 15 s by default: a killed run would lose that
            # much history. Flushing every 2 s costs a small write.
            options["x_transaction_log_flush_interval"] = 2.0
        settings = wandb.Settings(**options)
        self.run = wandb.init(project=project, name=name, id=run_id or None, resume="allow", dir=str(run_dir),
                              mode=wandb_mode(), config=config, settings=settings)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def state_dict(self) -> dict[str, str]:
        return {"wandb_run_id": self.run.id}

    def close(self) -> None:
        self.run.finish()


def build_trackers(names: list[str], *, run_dir: Path, state: dict[str, str], project: str, name: str,
                   config: dict) -> list[Tracker]:
    """The trackers ``names`` asks for; ``state`` is what their ``state_dict`` left in the checkpoint."""
    trackers: list[Tracker] = []
    for tracker in names:
        if tracker == "tensorboard":
            tb = TensorBoardTracker.open(run_dir / "tensorboard")
            if tb is not None:
                trackers.append(tb)
        elif tracker == "wandb":
            trackers.append(WandbTracker(run_dir=run_dir, run_id=state.get("wandb_run_id", ""), project=project,
                                         name=name, config=config))
        else:
            raise ValueError(f"metrics.trackers: unknown tracker {tracker!r}; use some of {', '.join(TRACKERS)}")
    return trackers
