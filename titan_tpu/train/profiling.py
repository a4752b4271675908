"""The profiler switch: ``[profiling] enabled = true`` traces a few steps of a real run.

Steps ``start_step`` .. ``start_step + active_steps - 1`` run under torch.profiler. Afterwards:

- every rank writes ``trace_dir/rank<r>.json.gz``, a Chrome trace that Perfetto (ui.perfetto.dev)
  and chrome://tracing open as they are;
- every rank writes ``trace_dir/summary_rank<r>.json``, and rank 0 prints, the table of where the
  step went by category (``category`` below): self time per op, on the device where there is one
  (CUDA kernels) and on the host otherwise, averaged per profiled step;
- with ``memory_snapshot = true`` on CUDA, ``trace_dir/memory_rank<r>.pickle``: the caching
  allocator's history over the profiled steps (torch.cuda.memory._record_memory_history), for
  pytorch.org/memory_viz.

The trainer labels two regions with ``record_function`` so that they can be told apart from the
ops inside them: ``titan/data`` (waiting for the next batches) and ``titan/optimizer`` (clipping and
the AdamW update of the eager step; the graph step's update is inside its compiled program and
counts as the ops it is made of).

TPU: torch_tpu 0.2.0 lists only ``torch.tpu.profiler.TpuProfilerConfig`` and no function that
starts a device trace with it, so on TPU the trace holds host activity only (docs/observability.md).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

DATA_REGION = "titan/data"
OPTIMIZER_REGION = "titan/optimizer"

_COLLECTIVE = ("all_gather", "allgather", "reduce_scatter", "all_reduce", "allreduce", "all_to_all", "broadcast",
               "c10d", "gloo", "nccl", "record_param_comms")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_addmm_activation", "grouped_mm", "gemm")
_ATTENTION = ("scaled_dot_product", "flash", "attention", "sdpa", "fmha")
_ROUTING = ("sort", "topk", "index", "gather", "scatter", "cumsum")
# Where a step can go, in the order the table prints them.
CATEGORIES = ("matmul", "attention", "elementwise", "MoE routing/indexing", "collectives", "waiting", "optimizer")


def category(name: str, regions: frozenset[str] = frozenset()) -> str:
    """The category of an op named ``name`` running inside the labelled ``regions``.

    waiting: the data region, and collective waits (wait_tensor, Work.wait) and device syncs;
    collectives: launches of all-gather, reduce-scatter, all-reduce (their host copies included);
    optimizer: whatever else runs inside the optimizer region; matmul / attention / MoE routing by
    op name; elementwise: everything else (pointwise ops, reductions, copies, Python overhead).
    """
    lowered = name.lower()
    if DATA_REGION in regions or name == DATA_REGION or "wait" in lowered or "synchronize" in lowered:
        return "waiting"
    if any(word in lowered for word in _COLLECTIVE):
        return "collectives"
    if OPTIMIZER_REGION in regions or name == OPTIMIZER_REGION:
        return "optimizer"
    if any(word in lowered for word in _MATMUL):
        return "matmul"
    if any(word in lowered for word in _ATTENTION):
        return "attention"
    if any(word in lowered for word in _ROUTING):
        return "MoE routing/indexing"
    return "elementwise"


def _regions(event) -> frozenset[str]:
    names, parent = set(), event.cpu_parent
    while parent is not None:
        if parent.name in (DATA_REGION, OPTIMIZER_REGION):
            names.add(parent.name)
        parent = parent.cpu_parent
    return frozenset(names)


def time_by_category(events, *, steps: int, device: bool) -> dict[str, float]:
    """Milliseconds per step in each category, from a profile's FunctionEvents (self times, so
    that nothing is counted twice): device time when ``device``, else host time."""
    totals: dict[str, float] = collections.defaultdict(float)
    for event in events:
        us = event.self_device_time_total if device else event.self_cpu_time_total
        if us > 0:
            totals[category(event.name, _regions(event))] += us / 1e3 / steps
    return {name: totals[name] for name in CATEGORIES if totals.get(name)}


def format_table(by_category: dict[str, float], *, title: str) -> str:
    total = sum(by_category.values()) or 1.0
    lines = [title]
    for name, ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:22s} {ms:10.2f} ms {ms / total:7.1%}")
    return "\n".join(lines)


class StepProfiler:
    """Starts torch.profiler before step ``start_step`` and stops it after ``active_steps`` steps."""

    def __init__(self, *, start_step: int, active_steps: int, trace_dir: Path, rank: int, device_type: str,
                 memory_snapshot: bool = False, log=print):
        if memory_snapshot and device_type != "cuda":
            raise ValueError(f"profiling.memory_snapshot records the CUDA allocator; this run is on {device_type}: "
                             "set profiling.memory_snapshot false")
        self.start_step, self.stop_step = start_step, start_step + active_steps - 1
        self.trace_dir, self.rank, self.device_type = Path(trace_dir), rank, device_type
        self.memory_snapshot = memory_snapshot
        self._log = log
        self._prof = None
        self._steps = 0
        self.summary: dict[str, float] | None = None

    def before_step(self, step: int) -> None:
        if step != self.start_step:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device_type == "cuda" else [])
        if self.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(activities=activities)
        self._prof.start()

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._steps += 1
        if step >= self.stop_step:
            self.close()

    def close(self) -> None:
        """Stop and write everything; a run that ends inside the window keeps what it profiled."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        prof.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        trace = self.trace_dir / f"rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(trace))
        if self.memory_snapshot:
            torch.cuda.memory._dump_snapshot(str(self.trace_dir / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        steps = max(self._steps, 1)
        self.summary = time_by_category(prof.events(), steps=steps, device=self.device_type == "cuda")
        (self.trace_dir / f"summary_rank{self.rank}.json").write_text(
            json.dumps({"steps": steps, "ms_per_step": self.summary}, indent=1) + "\n")
        if self.rank == 0:
            where = "device" if self.device_type == "cuda" else "host"
            self._log(format_table(self.summary, title=f"profile of steps {self.start_step}-"
                                                       f"{self.start_step + steps - 1}, rank 0, self {where} time "
                                                       f"per step (traces: {self.trace_dir})"))
