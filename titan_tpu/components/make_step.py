"""The step function of a run, chosen once from the config: `EagerStep` or the graph trainer's
`GraphStep` (the step contract: train/step.py). The checks of backend combinations that cannot
run live here, beside the choice, not in the trainer's loop.

It sits above graph/ (which imports train/step.py and train/optim.py) with the rest of the run's
assembly (components/): the loops are handed the step and never import graph/ themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from titan_tpu.config import CompileConfig
from titan_tpu.data.batch import Batch
from titan_tpu.train.objective import NextTokenObjective, Objective
from titan_tpu.train.optim import AdamW
from titan_tpu.train.step import EagerStep, StepResult

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.device import Backend
    from titan_tpu.graph.compile_cache import CompileCache

StepFn = Callable[[list[Batch], float], StepResult]


def make_step(cfg: Config, model: torch.nn.Module, optimizer: AdamW, *, backend: Backend, world_size: int,
              dp_size: int, documents: bool, log: Callable[[str], None], objective: Objective | None = None,
              mesh_axes: dict[str, int] | None = None, compile_cache: CompileCache | None = None,
              example_batch: Batch | None = None) -> tuple[StepFn, dict[str, float]]:
    """(the step of training.mode, its capture and compile seconds: {} for eager) for the first
    metrics row. documents: batches carry positions (a document mask). objective: the run's
    (train/objective.py; default next-token). mesh_axes: the mesh's axes as the JAX path lays them
    out (graph/spmd.py mesh_axis_sizes), for compile.backend jax. compile_cache: where the compiler
    keeps its programs (graph/compile_cache.py, set up before the device started); its hits and
    misses are logged with the compile time."""
    t = cfg.training
    objective = objective or NextTokenObjective()
    if t.mode != "graph":
        return EagerStep(model, optimizer, max_norm=t.max_norm, dp_size=dp_size, objective=objective), {}
    if compile_cache is not None:
        log(compile_cache.where())
        compile_cache.watch()
    if backend.jax_platform is not None:
        step, stats = _jax_step(cfg, model, optimizer, backend=backend, dp_size=dp_size, documents=documents,
                                log=log, objective=objective, mesh_axes=mesh_axes or {}, example_batch=example_batch)
        if compile_cache is not None:
            log(f"compile.backend jax: {compile_cache.describe()}")
        return step, stats
    from titan_tpu.graph.compile import GraphStep  # make_fx and the compilers load only for graph mode

    check_graph_backend(cfg, backend=backend, world_size=world_size)
    example_batch = _example_batch(cfg, objective, example_batch, documents=documents, device=backend.device)
    c = cfg.compile
    step = GraphStep(model, optimizer, max_norm=t.max_norm, example_batch=example_batch, backend=c.backend,
                     dp_size=dp_size, split=c.split, prefetch=None if c.prefetch < 0 else c.prefetch,
                     grad_accum_steps=t.grad_accum_steps, objective=objective)
    log(f"graph mode: step captured in {step.capture_seconds:.1f} s, compiled with {c.backend} in "
        f"{step.compile_seconds:.1f} s" + (f"; {compile_cache.describe()}" if compile_cache else ""))
    for name, fingerprint in step.fingerprints().items():  # TorchTPU's programs (graph/torchtpu.py)
        log(f"{c.backend}: program {name} fingerprint {fingerprint} handed to XLA")
    return step, {"capture_s": step.capture_seconds, "compile_s": step.compile_seconds}


def _jax_step(cfg: Config, model: torch.nn.Module, optimizer: AdamW, *, backend: Backend, dp_size: int,
              documents: bool, log: Callable[[str], None], objective: Objective,
              mesh_axes: dict[str, int], example_batch: Batch | None = None) -> tuple[StepFn, dict[str, float]]:
    """compile.backend jax: the step as one program run by JAX's runtime (graph/jax_step.py), and
    one line for each setting it does not apply."""
    from titan_tpu.graph.jax_step import JaxStep  # jax loads only for this backend

    t, c = cfg.training, cfg.compile
    if c.prefetch != CompileConfig.prefetch:
        log(f"note: compile.prefetch = {c.prefetch} orders the collectives of a torch-compiled step; on the JAX path "
            "XLA schedules them")
    if cfg.profiling.enabled:
        log("note: profiling records torch's operators; the JAX path's step is one XLA program, which torch's "
            "profiler does not see (use jax.profiler for it)")
    example_batch = _example_batch(cfg, objective, example_batch, documents=documents, device=backend.device)
    step = JaxStep(model, optimizer, max_norm=t.max_norm, example_batch=example_batch, dp_size=dp_size,
                   grad_accum_steps=t.grad_accum_steps, objective=objective, axis_sizes=mesh_axes,
                   platform=backend.jax_platform, log=log)
    log(f"graph mode: step captured in {step.capture_seconds:.1f} s, lowered and compiled by XLA through JAX "
        f"({backend.jax_platform}) in {step.compile_seconds:.1f} s")
    return step, {"capture_s": step.capture_seconds, "compile_s": step.compile_seconds}


def _example_batch(cfg: Config, objective: Objective, data_example: Batch | None, *, documents: bool,
                   device: torch.device) -> Batch:
    """What the step is captured with: the data's own example (a batch with images) where it has one,
    else the objective's."""
    if data_example is not None:
        return data_example.to(device)
    t = cfg.training
    return objective.example_batch(batch_size=t.batch_size, seq_len=t.seq_len, documents=documents, device=device)


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
