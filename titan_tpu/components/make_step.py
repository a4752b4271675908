"""The step function of a run, chosen once from the config: `EagerStep` or the graph trainer's
`GraphStep` (the step contract: train/step.py). The checks of backend combinations that cannot
run live here, beside the choice, not in the trainer's loop.

It sits above graph/ (which imports train/step.py and train/optim.py) with the rest of the run's
assembly (components/): the loops are handed the step and never import graph/ themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from titan_tpu.data.batch import Batch
from titan_tpu.train.objective import NextTokenObjective, Objective
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep, StepResult

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.device import Backend

StepFn = Callable[[list[Batch], float], StepResult]


def make_step(cfg: Config, model: torch.nn.Module, optimizer: AdamW, *, backend: Backend, world_size: int,
              dp_size: int, documents: bool, log: Callable[[str], None],
              objective: Objective | None = None) -> tuple[StepFn, dict[str, float]]:
    """(the step of training.mode, its capture and compile seconds: {} for eager) for the first
    metrics row. documents: batches carry positions (a document mask). objective: the run's
    (train/objective.py; default next-token)."""
    t = cfg.training
    objective = objective or NextTokenObjective()
    if t.mode != "graph":
        return EagerStep(model, optimizer, max_norm=t.max_norm, dp_size=dp_size, objective=objective), {}
    from titan_tpu.graph.compile import GraphStep  # make_fx and the compilers load only for graph mode

    check_graph_backend(cfg, backend=backend, world_size=world_size)
    example_batch = objective.example_batch(batch_size=t.batch_size, seq_len=t.seq_len, documents=documents,
                                            device=backend.device)
    c = cfg.compile
    step = GraphStep(model, optimizer, max_norm=t.max_norm, example_batch=example_batch, backend=c.backend,
                     dp_size=dp_size, split=c.split, prefetch=None if c.prefetch < 0 else c.prefetch,
                     grad_accum_steps=t.grad_accum_steps, objective=objective)
    log(f"graph mode: step captured in {step.capture_seconds:.1f} s, compiled with {c.backend} in "
        f"{step.compile_seconds:.1f} s")
    return step, {"capture_s": step.capture_seconds, "compile_s": step.compile_seconds}


def check_graph_backend(cfg: Config, *, backend: Backend, world_size: int) -> None:
    """Combinations of compile backend, device and ranks known to fail at run time."""
    if (cfg.compile.backend == "inductor" and backend.name == "cpu" and world_size > 1
            and cfg.compile.split != "collectives"):
        # Seen in testing: one Inductor program with many gloo collectives in flight at once
        # corrupted the process heap in about one run in four; cut after every collective, 20 runs
        # in 20 were clean (docs/architecture.md, "Known problem").
        raise ValueError("graph mode with compile.backend inductor on several CPU processes needs "
                         "--compile.split collectives (one program corrupted the heap in testing), "
                         "or use --compile.backend aot_eager")
