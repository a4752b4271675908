"""`titan-tpu plan --search --certify K`: plan, compile, certify, before a TPU is rented.

The search (plan/search.py) ranks the configurations that fit by the planner's predicted tokens/s.
Certifying compiles the top K of them with XLA's TPU compiler for the slice, exactly as
`titan-tpu compile` does (the trainer's program: its re-shard decision, kernels, scan,
checkpointing, accumulation), and keeps the planner's speed order among those XLA accepts and
fits by its own numbers: the configuration a user takes to a TPU has been compiled for that TPU
and fits by the compiler's peak, not only by our model of it. A candidate XLA rejects (its error)
or whose XLA peak is over the device's HBM is dropped, with the reason.

Each candidate compiles in a subprocess (`titan-tpu compile ... --json`): one fake process group
per capture, and a compiler that aborts on a program takes down its own process only. Needs JAX
and libtpu in this environment (.venv-tpu; `make tpu-check` builds it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from titan_tpu.plan.search import Candidate, SearchResult

__all__ = ["Certified", "certified_json", "certify", "format_certified"]

GiB = 1024**3


@dataclass
class Certified:
    candidate: Candidate
    rank: int  # the search's rank (1 = the planner's best)
    report: dict | None = None  # `titan-tpu compile --json` of the candidate
    reason: str = ""  # why XLA did not certify it ("" when it compiled and fits)

    @property
    def fits(self) -> bool:
        return self.report is not None and not self.reason


def _compile(config: str, overrides: list[str], *, timeout: float) -> tuple[dict | None, str]:
    """(report, "") or (None, XLA's or the capture's reason, one line)."""
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
           "TPU_SKIP_MDS_QUERY": "1"}
    command = [sys.executable, "-m", "titan_tpu.cli", "compile", "--config", config, "--json", *overrides]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"the compile ran past {timeout:.0f} s"
    lines = done.stdout.strip()
    report = None
    if lines.startswith("{"):
        report = json.loads(lines[:lines.rindex("}") + 1])
    if done.returncode == 0 and report is not None:
        return report, ""
    from titan_tpu.tools.compile_cmd import child_error_line

    return report, child_error_line(done.stderr)[:300]


def certify(result: SearchResult, config: str, overrides: list[str], *, top: int, timeout: float = 3600,
            log=print) -> list[Certified]:
    """The search's top `top` fitting candidates compiled for the slice; certified first (the
    planner's speed order), then the rest with their reasons."""
    import importlib.util

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("libtpu") is None:
        raise ValueError("--certify compiles with XLA's TPU compiler: run it from .venv-tpu (make tpu-check builds "
                         "it): .venv-tpu/bin/titan-tpu plan --search --certify K ...")
    if top < 1:
        raise ValueError(f"--certify {top}: give how many of the search's best to compile (1 or more)")
    from titan_tpu.plan.setting import TPU_NAMES
    from titan_tpu.plan.topology import topology_for_chips

    if result.hardware.name not in TPU_NAMES:
        raise ValueError(f"--certify compiles for a TPU slice; the search planned {result.hardware.name}: give a TPU "
                         "recipe or --hardware (e.g. v5p-8)")
    chips = result.devices // result.hardware.devices_per_chip
    slice_args = ["--topology", topology_for_chips(result.hardware.name, chips)]
    out = []
    for rank, candidate in enumerate(result.fitting[:top], start=1):
        log(f"certify: compiling candidate {rank} of {min(top, len(result.fitting))}: {candidate.describe()}")
        report, reason = _compile(config, [*overrides, *candidate.changes, *slice_args], timeout=timeout)
        if report is not None and not reason and report.get("fits") is False:
            reason = (f"XLA's peak {report['peak_per_chip_bytes'] / GiB:.1f} GiB per chip is over the "
                      f"{report['hbm_per_chip_bytes'] / GiB:.0f} GiB of HBM")
        out.append(Certified(candidate=candidate, rank=rank, report=report, reason=reason))
    return sorted(out, key=lambda c: (not c.fits, c.rank))


def format_certified(certified: list[Certified]) -> str:
    if not certified:
        return "certify: no candidate fits by the planner, nothing to compile"
    lines = ["certified by XLA's TPU compiler (compile-only, per chip), in the planner's speed order:"]
    for c in certified:
        plan = c.candidate.plan
        xla = (f"XLA peak {c.report['peak_per_chip_bytes'] / GiB:.1f} GiB" if c.report else "no XLA peak")
        verdict = "CERTIFIED" if c.fits else f"rejected: {c.reason}"
        lines.append(f"  #{c.rank} {c.candidate.describe()}: planner {plan.peak_bytes / GiB:.1f} GiB, {xla}, "
                     f"{plan.tokens_per_s:,.0f} tokens/s predicted: {verdict}")
        if c.candidate.changes:
            lines.append(f"      overrides: {' '.join(c.candidate.changes)}")
    best = next((c for c in certified if c.fits), None)
    if best is None:
        lines.append("none of them is certified: widen --certify, or see the reasons above")
    elif best.rank != 1:
        lines.append(f"XLA changes the choice: the planner's #1 is not certified; take #{best.rank}")
    else:
        lines.append("XLA keeps the planner's choice: #1 is certified")
    peaks = [c for c in certified if c.report]
    by_xla = [c.rank for c in sorted(peaks, key=lambda c: c.report["peak_per_chip_bytes"])]
    by_plan = [c.rank for c in sorted(peaks, key=lambda c: c.candidate.plan.peak_bytes)]
    if len(peaks) > 1:
        lines.append(f"memory order by XLA's peak: {by_xla}; by the planner's: {by_plan}"
                     + (" (the same)" if by_xla == by_plan else " (they differ)"))
    return "\n".join(lines)


def certified_json(result: SearchResult, certified: list[Certified], *, top: int) -> str:
    """The search's JSON (plan/search.py search_json) with each compiled candidate's verdict."""
    from titan_tpu.plan.search import search_json

    out = json.loads(search_json(result, top=top))
    out["certified"] = [{"search_rank": c.rank, "overrides": c.candidate.changes, "certified": c.fits,
                         "reason": c.reason, "plan_peak_bytes": c.candidate.plan.peak_bytes,
                         "xla_peak_bytes": c.report["peak_per_chip_bytes"] if c.report else None,
                         "tokens_per_s": c.candidate.plan.tokens_per_s} for c in certified]
    return json.dumps(out, indent=2)
