"""The step function of a run, chosen once from its resolution: `EagerStep`, the graph trainer's
`GraphStep`, or on the JAX path `JaxStep` over the programs `titan-tpu compile` certifies (the step
contract: train/step.py). The checks of backend combinations that cannot run live here, beside the
choice, not in the trainer's loop.

It sits above graph/ (which imports train/step.py and train/optim.py) with the rest of the run's
assembly (components/): the loops are handed the step and never import graph/ themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from titan_tpu.components.program import Program, capture_programs
from titan_tpu.components.world import Place
from titan_tpu.config import CompileConfig
from titan_tpu.data.batch import Batch
from titan_tpu.run.resolved import ResolvedRun
from titan_tpu.train.step import EagerStep, StepResult

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.device import Backend
    from titan_tpu.graph.compile_cache import CompileCache

StepFn = Callable[[list[Batch], float], StepResult]


def make_step(run: ResolvedRun, program: Program, place: Place, *, backend: Backend, log: Callable[[str], None],
              compile_cache: CompileCache | None = None) -> tuple[StepFn, dict[str, float]]:
    """(the step of training.mode over `program`, its capture and compile seconds: {} for eager) for
    the first metrics row. compile_cache: where the compiler keeps its programs
    (graph/compile_cache.py, set up before the device started); its hits and misses are logged with
    the compile time."""
    cfg, t = run.cfg, run.cfg.training
    dp_size = run.batch_split(place.rank).dp_size
    if t.mode != "graph":
        return EagerStep(program.model, program.optimizer, max_norm=t.max_norm, dp_size=dp_size,
                         objective=program.objective), {}
    if compile_cache is not None:
        log(compile_cache.where())
        compile_cache.watch()
    if run.target.jax_platform is not None:
        step, stats = _jax_step(run, program, place, log=log)
        if compile_cache is not None:
            log(f"compile.backend jax: {compile_cache.describe()}")
        return step, stats
    from titan_tpu.graph.compile import GraphStep  # make_fx and the compilers load only for graph mode

    check_graph_backend(cfg, backend=backend, world_size=run.world_size)
    c = cfg.compile
    step = GraphStep(program.model, program.optimizer, max_norm=t.max_norm, example_batch=program.example_batch,
                     backend=c.backend, dp_size=dp_size, split=c.split, prefetch=None if c.prefetch < 0 else c.prefetch,
                     grad_accum_steps=run.grad_accum_steps, objective=program.objective)
    log(f"graph mode: step captured in {step.capture_seconds:.1f} s, compiled with {c.backend} in "
        f"{step.compile_seconds:.1f} s" + (f"; {compile_cache.describe()}" if compile_cache else ""))
    for name, fingerprint in step.fingerprints().items():  # TorchTPU's programs (graph/torchtpu.py)
        log(f"{c.backend}: program {name} fingerprint {fingerprint} handed to XLA")
    return step, {"capture_s": step.capture_seconds, "compile_s": step.compile_seconds}


def _jax_step(run: ResolvedRun, program: Program, place: Place, *, log: Callable[[str], None]
              ) -> tuple[StepFn, dict[str, float]]:
    """compile.backend jax: the programs `titan-tpu compile` certifies (components/program.py
    `capture_programs`) run by JAX's runtime (graph/jax_step.py), and one line for each setting it
    does not apply."""
    from titan_tpu.graph.jax_step import JaxStep  # jax loads only for this backend

    cfg, c = run.cfg, run.cfg.compile
    if c.prefetch != CompileConfig.prefetch:
        log(f"note: compile.prefetch = {c.prefetch} orders the collectives of a torch-compiled step; on the JAX path "
            "XLA schedules them")
    if cfg.profiling.enabled:
        log("note: profiling records torch's operators; the JAX path's step is one XLA program, which torch's "
            "profiler does not see (use jax.profiler for it)")
    steps = capture_programs(run, program, place)
    step = JaxStep(program.model, program.optimizer, steps, example_batch=program.example_batch,
                   grad_accum_steps=run.grad_accum_steps, platform=run.target.jax_platform, log=log)
    log(f"graph mode: step captured in {step.capture_seconds:.1f} s, lowered and compiled by XLA through JAX "
        f"({run.target.jax_platform}) in {step.compile_seconds:.1f} s")
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
