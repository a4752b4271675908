"""Training metrics to the console, a JSONL file and the experiment trackers (train/trackers.py).

`MetricsLogger.log(step, metrics)` takes a flat dict of numbers (and values for the file only,
below). Any keys are accepted; these are
formatted specially on the console (in this order), the rest are printed as "key value":

    loss, val_loss         "loss 6.8123"
    lr                     "lr 3.0e-04"
    grad_norm              "gnorm 1.234"
    tokens_per_s         "12,345 tok/s"
    tflops                 "0.076 TFLOP/s"     (achieved model TFLOP/s per device)
    mfu                    "MFU 6.1%"          (already a percentage: 6.1 means 6.1 %; None: "MFU n/a
                                               (peak unreliable)", the run beat the peak)
    memory_gb              "mem 1.23 GB"       (max_memory_gb, if present, is added as "(max 1.50)")
    data_s                 "data 1.2 ms"       (seconds a step waited for its batches)
    goodput                "goodput 93.1%"     (productive share of the run's wall time, across restarts)
    kl                     "kl 5.5e-04"        (GRPO)
    reward                 "reward 0.0104"     (reward_std, if present, is added as "(std 0.0252)")
    sampling_s, training_s "sample 0.15 s", "train 0.13 s"  (GRPO's split of a step)

``console_keys`` names the other keys the console shows (as "key value"); None shows them all. A
kind with many terms (GRPO logs TRL's dozen) keeps its line readable that way, and every key still
goes to metrics.jsonl and the trackers.

Keys under ``moe/`` (an MoE model's per-layer routing, loops/routing.py: three per layer, too many
for one line) go to metrics.jsonl and the trackers, never the console, whatever ``console_keys``
says; expert_load_max/min and the routing warning are the console's view of them. A value that is
not a number (the ``expert_load`` dict of per-expert loads, for the report's heat map) goes to
metrics.jsonl only: trackers take numbers, and the console prints one line. `time` (the wall
clock, for the report) goes to metrics.jsonl only. With ``total_steps`` the line
starts with a progress bar and, from the second row of a process on, an ETA: the remaining steps at
this process's average wall time per step so far (validation and checkpoints included).

metrics.jsonl gets one JSON object per call, {"step": step, **metrics}, flushed immediately so a
killed run keeps every row written so far. JSON has no NaN or Infinity, and Python's json module
would write them as bare tokens most readers reject, so non-finite floats are stored as null; the
console and TensorBoard still show the real value (a diverged loss stays visible).

A resumed run (``resumed_step > 0``) logs no step twice and none backwards: the steps between its
checkpoint and the crash already have rows (the first attempt's; a deterministic run recomputes the
same values), so every row up to the last step already in metrics.jsonl is dropped, from the file
and from every tracker alike. Each process start appends one line to events.jsonl (the step it
started from, the time), which is how the report counts restarts.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from titan_tpu.train.trackers import TensorBoardTracker, Tracker

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
    "mtp_loss": lambda v: f"mtp {v:.4f}",
    "expert_load_max": lambda v: f"expert load max/mean {v:.2f}",
    "expert_load_min": lambda v: f"min/mean {v:.2f}",
    "data_s": lambda v: f"data {v * 1e3:.1f} ms",
    "goodput": lambda v: f"goodput {v:.1f}%",
    "kl": lambda v: f"kl {v:.1e}",
    "reward": lambda v: f"reward {v:.4g}",
    "sampling_s": lambda v: f"sample {v:.2f} s",
    "training_s": lambda v: f"train {v:.2f} s",
}
_SHOWN_WITH = {"max_memory_gb": "memory_gb", "reward_std": "reward"}  # key -> the key whose text carries it
_FILE_ONLY = {"time", "step_s"}  # in metrics.jsonl for the report, not on the console
_NOT_ON_CONSOLE = ("moe/",)  # prefixes of keys for the file and the trackers only (module docstring)
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


def _last_step(path: Path) -> int:
    """The largest step in a metrics.jsonl (0 if there is none); a torn last line is ignored."""
    last = 0
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _fmt_generic(key: str, value) -> str:
    if isinstance(value, bool) or isinstance(value, int):
        return f"{key} {value}"
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


class MetricsLogger:
    """Writes each step's metrics to output_dir/metrics.jsonl, the trackers and the console."""

    def __init__(
        self,
        *,
        output_dir: str | Path,
        tensorboard: bool = True,
        console: bool = True,
        total_steps: int | None = None,
        trackers: Sequence[Tracker] = (),
        resumed_step: int = 0,
        console_keys: Collection[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self.console_keys = None if console_keys is None else frozenset(console_keys)
        self.total_steps = total_steps
        self._clock = clock
        self._first: tuple[int, float] | None = None  # (step, clock) of this process's first row
        path = self.output_dir / "metrics.jsonl"
        # Steps up to here were logged before a restart: a resumed run does not log them again.
        self.logged_through = _last_step(path) if resumed_step > 0 else 0
        # Append: a resumed run continues the same file.
        self._jsonl = open(path, "a", encoding="utf-8")
        with open(self.output_dir / "events.jsonl", "a", encoding="utf-8") as events:
            events.write(json.dumps({"event": "start", "step": int(resumed_step), "time": time.time()}) + "\n")
        self.trackers = list(trackers)
        if tensorboard:
            tb = TensorBoardTracker.open(self.output_dir / "tensorboard")
            if tb is not None:
                self.trackers.append(tb)

    def log(self, step: int, metrics: dict[str, float | int]) -> None:
        values = {k: _to_number(v) for k, v in metrics.items()}
        if step <= self.logged_through:
            if self.console:
                print(f"{self.format_line(step, values)} (replayed after the restart; logged before it)", flush=True)
            return
        row = {"step": int(step), **{k: _json_safe(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        scalars = {k: v for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "time"}
        for tracker in self.trackers:
            tracker.log(int(step), scalars)
        if self.console:
            print(self.format_line(step, values), file=sys.stdout, flush=True)

    def state_dict(self) -> dict:
        """What the trackers need to continue after a resume (the W&B run id), for the checkpoint."""
        state = {}
        for tracker in self.trackers:
            state.update(tracker.state_dict())
        return state

    def eta(self, step: int) -> str:
        """Time left at this process's average wall time per step so far; "" until it is known."""
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        if not self.total_steps or step <= first_step or step >= self.total_steps:
            return ""
        seconds = (self.total_steps - step) * (now - first_time) / (step - first_step)
        return f"ETA {format_duration(seconds)}"

    def format_line(self, step: int, metrics: dict) -> str:
        """The console progress line, e.g. "step   10/200 [##....] loss 6.8123 | lr 3.0e-04"."""
        if self.total_steps:
            width = len(str(self.total_steps))
            filled = min(_BAR_WIDTH, round(_BAR_WIDTH * step / self.total_steps))
            head = f"step {step:>{width}}/{self.total_steps} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}]"
            eta = self.eta(step) if "loss" in metrics else ""
            head += f" {eta}" if eta else ""
        else:
            head = f"step {step}"

        parts = []
        for key, fmt in _CONSOLE_FORMATS.items():
            if key not in metrics:
                continue
            value = metrics[key]
            if key == "mfu" and value is None:  # device.py Backend.mfu: the peak is below the run's rate
                parts.append("MFU n/a (peak unreliable)")
                continue
            text = fmt(value) if isinstance(value, (int, float)) else f"{key} {value}"
            if key == "memory_gb" and isinstance(metrics.get("max_memory_gb"), (int, float)):
                text += f" (max {metrics['max_memory_gb']:.2f})"
            if key == "reward" and isinstance(metrics.get("reward_std"), (int, float)):
                text += f" (std {metrics['reward_std']:.4g})"
            parts.append(text)
        for key, value in metrics.items():
            if key in _CONSOLE_FORMATS or key in _FILE_ONLY or _SHOWN_WITH.get(key) in metrics:
                continue
            if key.startswith(_NOT_ON_CONSOLE) or isinstance(value, (dict, list)):
                continue
            if self.console_keys is None or key in self.console_keys:
                parts.append(_fmt_generic(key, value))
        return f"{head} {' | '.join(parts)}" if parts else head

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()  # flushes pending events
        self.trackers = []
        if not self._jsonl.closed:
            self._jsonl.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
