"""What the planner answers for one run: a `Plan` (plan/planner.py makes it, plan/text.py prints it,
`titan-tpu plan --json` writes it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

__all__ = ["Plan"]


@dataclass
class Plan:
    model: str
    hardware: dict
    devices: int
    mesh: dict
    batch: dict
    params: dict
    memory: dict  # bytes per device, by term
    peak_bytes: float
    peak_phase: str
    capacity_bytes: float
    fits: bool
    flops: dict
    communication: list
    time: dict
    tokens_per_s: float | None  # None where nothing grounds a step time (`speed_basis`)
    mfu: float | None  # percent, model FLOPs over peak, as the trainer logs it; None as tokens_per_s
    speed_basis: str | None = None  # what the step time rests on; None: no basis (eager mode on a TPU)
    advice: list = field(default_factory=list)
    checkpoint: dict = field(default_factory=dict)  # `checkpoint_time`: save times and the grace budget
    pipeline: dict = field(default_factory=dict)  # pipeline stages: the schedule and bubble; {} without

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)
