"""Training metrics to the console, a JSONL file and TensorBoard.

`MetricsLogger.log(step, metrics)` takes a flat dict of numbers. Any keys are accepted; these are
formatted specially on the console (in this order), the rest are printed as "key value":

    loss, val_loss         "loss 6.8123"
    lr                     "lr 3.0e-04"
    grad_norm              "gnorm 1.234"
    tokens_per_s         "12,345 tok/s"
    tflops                 "0.076 TFLOP/s"     (achieved model TFLOP/s per device)
    mfu                    "MFU 6.1%"          (already a percentage: 6.1 means 6.1 %)
    memory_gb              "mem 1.23 GB"       (max_memory_gb, if present, is added as "(max 1.50)")

metrics.jsonl gets one JSON object per call, {"step": step, **metrics}, flushed immediately so a
killed run keeps every row written so far. JSON has no NaN or Infinity, and Python's json module
would write them as bare tokens most readers reject, so non-finite floats are stored as null; the
console and TensorBoard still show the real value (a diverged loss stays visible).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

# Console formatting of the known keys: key -> function(value) -> text.
_CONSOLE_FORMATS = {
    "loss": lambda v: f"loss {v:.4f}",
    "val_loss": lambda v: f"val_loss {v:.4f}",
    "lr": lambda v: f"lr {v:.1e}",
    "grad_norm": lambda v: f"gnorm {v:.3f}",
    "tokens_per_s": lambda v: f"{v:,.0f} tok/s",
    "tflops": lambda v: f"{v:.3f} TFLOP/s",
    "mfu": lambda v: f"MFU {v:.1f}%",
    "memory_gb": lambda v: f"mem {v:.2f} GB",
    "aux_loss": lambda v: f"aux {v:.4f}",
    "expert_load_max": lambda v: f"expert load max/mean {v:.2f}",
    "expert_load_min": lambda v: f"min/mean {v:.2f}",
}
_BAR_WIDTH = 20


def _to_number(value):
    """Plain Python number from ints, floats, numpy or 0-dim torch values; others unchanged."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def _json_safe(value):
    """nan / +-inf become None (null), so every metrics.jsonl line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt_generic(key: str, value) -> str:
    if isinstance(value, bool) or isinstance(value, int):
        return f"{key} {value}"
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


class MetricsLogger:
    """Writes each step's metrics to output_dir/metrics.jsonl, TensorBoard and the console."""

    def __init__(
        self,
        *,
        output_dir: str | Path,
        tensorboard: bool = True,
        console: bool = True,
        total_steps: int | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.total_steps = total_steps
        # Append: a resumed run continues the same file.
        self._jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._tb = self._open_tensorboard() if tensorboard else None

    def _open_tensorboard(self):
        try:  # tensorboard is optional: without it we still log to JSONL and the console
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            warnings.warn(f"TensorBoard logging disabled ({e}); pip install tensorboard to enable it", stacklevel=3)
            return None
        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        values = {k: _to_number(v) for k, v in metrics.items()}
        row = {"step": int(step), **{k: _json_safe(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()

        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=int(step))

        if self.console:
            print(self.format_line(step, values), file=sys.stdout, flush=True)

    def format_line(self, step: int, metrics: dict) -> str:
        """The console progress line, e.g. "step   10/200 [##....] loss 6.8123 | lr 3.0e-04"."""
        if self.total_steps:
            width = len(str(self.total_steps))
            filled = min(_BAR_WIDTH, round(_BAR_WIDTH * step / self.total_steps))
            head = f"step {step:>{width}}/{self.total_steps} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}]"
        else:
            head = f"step {step}"

        parts = []
        for key, fmt in _CONSOLE_FORMATS.items():
            if key not in metrics:
                continue
            value = metrics[key]
            text = fmt(value) if isinstance(value, (int, float)) else f"{key} {value}"
            if key == "memory_gb" and isinstance(metrics.get("max_memory_gb"), (int, float)):
                text += f" (max {metrics['max_memory_gb']:.2f})"
            parts.append(text)
        for key, value in metrics.items():
            shown_with_memory = key == "max_memory_gb" and "memory_gb" in metrics
            if key not in _CONSOLE_FORMATS and not shown_with_memory:
                parts.append(_fmt_generic(key, value))
        return f"{head} {' | '.join(parts)}" if parts else head

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()  # flushes pending events
            self._tb = None
        if not self._jsonl.closed:
            self._jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
