"""A loop's metrics rows: the steps since the last row (tokens, seconds, data waits) and the row made
of them: loss, learning rate, gradient norm, throughput, MFU, the objective's terms, an MoE model's
routing (loops/routing.py, for every kind: the routing is the model's, not the objective's), the
data mixture's shares, memory, and the capture and compile seconds with the first row.

Throughput counts only time spent in training steps (each ends in a host sync when its loss is
read), not validation or checkpointing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from titan_tpu.train.step import StepResult

__all__ = ["MetricsWindow", "next_token_metrics", "moe_metrics"]


@dataclass
class MetricsWindow:
    """The training steps since the last metrics row."""

    data_start: float  # the loop's data-wait seconds when the window opened
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, result: StepResult, seconds: float) -> None:
        self.tokens += result.num_tokens
        self.seconds += seconds
        self.steps += 1


def metrics_row(loop, result: StepResult, window: MetricsWindow) -> dict:
    """The row of the step `result` closes `window` with; `loop` gives the run's parts and its
    objective's terms (`objective_metrics`)."""
    parts = loop.components
    backend, dtype = parts.backend, parts.compute_dtype
    tokens_per_s = window.tokens / window.seconds  # all ranks together
    flops_per_device = tokens_per_s * parts.flops_per_token / parts.world_size
    # Rank 0 alone may measure the CPU peak again (device.py Backend.mfu); None: unreliable.
    mfu, note = backend.mfu(flops_per_device, dtype) if parts.is_main else (None, "")
    if note:
        loop.log(note)
    row = {"loss": result.loss, "lr": loop.lr(loop.step), "grad_norm": result.grad_norm,
           "tokens_per_s": tokens_per_s, "tflops": flops_per_device / 1e12, "mfu": mfu,
           "data_s": (loop.data_seconds - window.data_start) / window.steps,
           "step_s": window.seconds / window.steps, "time": time.time()}
    row.update(loop.objective_metrics(result))
    routing, warnings = loop.routing.row(loop.step, result.expert_load)
    row.update(routing)
    for line in warnings:
        loop.log(line)
    row.update(parts.train_loader.metrics())  # mixtures: token share and epochs per source
    row.update(backend.memory_stats())
    return row


def next_token_metrics(result: StepResult) -> dict[str, float]:
    """The next-token objective's terms in a metrics row: the MoE balancing loss (MoE models), the
    multi-token-prediction loss, unweighted (MTP models)."""
    row = moe_metrics(result)
    if result.mtp_loss is not None:
        row["mtp_loss"] = result.mtp_loss
    return row


def moe_metrics(result: StepResult) -> dict[str, float]:
    """The MoE balancing loss (coefficient applied); {} for dense models. How evenly the experts
    were loaded is the model's, in every kind's row (`metrics_row`, loops/routing.py)."""
    if result.expert_load is None:
        return {}
    return {"aux_loss": result.aux_loss}
