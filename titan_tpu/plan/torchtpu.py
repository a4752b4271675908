"""A plan's step as TorchTPU runs it: the two ways torch-tpu 0.2.0 can run a captured step.

* one_program: as the trainer calls TorchTPU (graph/torchtpu.py): every node SPMD-safe, so the
  collectives stay in the one program XLA schedules (an all-gather can run behind the matmuls
  before it), and the parameters and both AdamW moments donated, so the update writes them in
  place.
* split: torch-tpu 0.2.0's Dynamo backend as it is: a program for each collective and one for
  each piece between two. A collective starts when the program before it has ended and the next
  program when it has ended, so no collective is hidden behind compute; nothing is donated, so the
  update writes fresh parameters and moments beside the old ones.

Both are read off a plan of the step in graph mode (planner.py `plan_run`), whose terms already
hold what differs: its step time with and without overlap (`time`), its collectives (`communication`),
and its optimizer moment with the out-of-place update a graph step traces (`optimizer_temporary`:
the sqrt(v) temporary and the fresh parameters and moments, train/optim.py update_buffers).
Donated, the update holds none of them beside the parameters and moments (as the program
`titan-tpu compile` certifies, planner `as_compiled`). Not modelled: each program's dispatch time
(split: twice the collectives), and the values a split holds between programs beyond what one
program holds at the same moment.

TorchTPU's one program has been compiled on a CPU with stand-ins for its collectives, and the
split's programs too (bench/torchtpu_lowering.py); neither has run on a TPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_tpu.plan.result import Plan

__all__ = ["RUNTIMES", "TorchTpuStep", "torchtpu_lines", "torchtpu_step"]

RUNTIMES = ("one_program", "split")


@dataclass(frozen=True)
class TorchTpuStep:
    """The plan's step as `runtime` runs it. programs: XLA programs run per step (one per
    micro-batch program and the update under gradient accumulation; split: and two per collective,
    at most, as two collectives with nothing between them have no piece between them). phases:
    bytes per device at each moment of the step (the plan's `memory["phases"]` keys)."""

    runtime: str
    programs: int
    collectives: int
    donated: bool
    overlap: bool
    phases: dict
    peak_bytes: float
    peak_phase: str
    fits: bool
    step_s: float | None
    tokens_per_s: float | None
    mfu: float | None


def torchtpu_step(plan: Plan, runtime: str) -> TorchTpuStep:
    """`plan` (graph mode, not `as_compiled`) as TorchTPU's `runtime` runs it (module docstring)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"TorchTPU runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    if plan.batch["mode"] != "graph":
        raise ValueError("TorchTPU's runtimes run a captured step: plan it with --training.mode graph")
    if plan.batch.get("as_compiled"):
        raise ValueError("plan the step a TPU runs (not as_compiled) to read TorchTPU's runtimes off it")
    donated = runtime == "one_program"
    phases = dict(plan.memory["phases"])
    if donated:
        phases["optimizer"] -= plan.memory["optimizer_temporary"]  # updated in place, each in one fusion
    peak_phase = max(phases, key=phases.get)
    collectives = sum(c["calls"] for c in plan.communication)
    runs = plan.batch["grad_accum_steps"] + 1 if plan.batch["grad_accum_steps"] > 1 else 1
    programs = runs if donated else runs + 2 * collectives
    step_s, tokens_per_s, mfu = None, None, None
    if plan.speed_basis is not None:
        step_s = plan.time["step_s_overlap" if donated else "step_s_no_overlap"]
        scale = plan.time["step_s"] / step_s
        tokens_per_s, mfu = plan.tokens_per_s * scale, plan.mfu * scale
    return TorchTpuStep(runtime=runtime, programs=programs, collectives=collectives, donated=donated,
                        overlap=donated, phases=phases, peak_bytes=phases[peak_phase], peak_phase=peak_phase,
                        fits=phases[peak_phase] <= plan.capacity_bytes, step_s=step_s, tokens_per_s=tokens_per_s,
                        mfu=mfu)


def torchtpu_lines(plan: Plan) -> tuple[str, dict]:
    """What `titan-tpu plan --torchtpu` prints below the plan, one line per runtime, and the same as
    {runtime: TorchTpuStep as a dict} for --json."""
    steps = {runtime: torchtpu_step(plan, runtime) for runtime in RUNTIMES}
    names = {"one_program": "one program (the trainer's call: collectives inside, parameters and moments donated)",
             "split": "split (torch-tpu's Dynamo backend as it is: a program per collective and per piece "
                      "between, nothing donated)"}
    lines = ["TorchTPU runs the step:"]
    for runtime, step in steps.items():
        speed = ("no step time (no speed basis)" if step.step_s is None else
                 f"{step.step_s:.4g} s/step {'overlapped' if step.overlap else 'without overlap'}, "
                 f"{step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1f}%")
        programs = f"{step.programs:,} program{'s' if step.programs > 1 else ''} per step"
        peak = f"peak {step.peak_bytes / 1e9:.3f} GB at {step.peak_phase} ({'fits' if step.fits else 'DOES NOT FIT'})"
        lines.append(f"  {names[runtime]}: {programs}; {peak}; {speed}")
    return "\n".join(lines), {runtime: asdict(step) for runtime, step in steps.items()}
