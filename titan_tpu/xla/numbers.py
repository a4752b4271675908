"""One captured program compiled by XLA, and XLA's numbers of it: memory per kind and the peak,
cost analysis's FLOPs and bytes, the collectives it kept and the Pallas kernels in it, the values
alive at its peak (from its dump: xla/dump.py), the compile's time; watched so that a
compile larger than the machine ends with one line (`host_memory_guard`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["NO_ESTIMATE", "compile_program", "hlo_collectives", "host_memory_guard", "loop_seconds", "pallas_kernels",
           "step_platform", "time_as_run", "xla_dump_env", "xla_numbers"]


PEAK_VALUES = 12  # the largest values alive at XLA's peak kept in the report


# The host memory XLA's compile may leave free before it is stopped: the kernel's OOM killer would
# otherwise end the process (or another one) without a word.
HOST_MEMORY_FLOOR = 1 * 1024**3


@contextlib.contextmanager
def host_memory_guard(floor: int = HOST_MEMORY_FLOOR, interval: float = 0.5):
    """Watch the machine's available memory while XLA compiles; when it falls below `floor`,
    print one line saying how much this process held and how much the machine has, and exit the
    process with status 3 (XLA's compile cannot be interrupted from Python). Linux only: elsewhere
    nothing is watched."""
    import threading

    def meminfo() -> dict[str, int]:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    if not os.path.exists("/proc/meminfo"):
        yield
        return
    done = threading.Event()

    def watch():
        while not done.wait(interval):
            info = meminfo()
            if info["MemAvailable"] < floor:
                held = rss()
                print(f"error: XLA's TPU compile of this step needs more host memory than this machine has: it held "
                      f"{held / 1024**3:.1f} GiB of {info['MemTotal'] / 1024**3:.1f} GiB with "
                      f"{info['MemAvailable'] / 1024**3:.1f} GiB left; compile it on a machine with more memory "
                      "(or a recipe with fewer or smaller programs)", file=sys.stderr, flush=True)
                os._exit(3)

    thread = threading.Thread(target=watch, daemon=True, name="host-memory-guard")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def xla_numbers(memory, cost) -> tuple[dict[str, int], int, dict]:
    """(memory per kind, peak, cost analysis) of a compiled program from XLA's memory stats and cost
    analysis (JAX's or a PJRT executable's): the peak is arguments + outputs - aliased +
    temporaries + generated code, per chip."""
    kinds = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
             "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
             "code": memory.generated_code_size_in_bytes}
    peak = kinds["arguments"] + kinds["outputs"] - kinds["aliased"] + kinds["temporaries"] + kinds["code"]
    return kinds, peak, cost[0] if isinstance(cost, (list, tuple)) else cost


def compile_program(step, devices, *, program: str, dump: Path | None, xla_dump: Path | None,
                    time_estimate: bool = True) -> dict:
    """Lower one captured program to JAX over the devices' mesh and compile it; XLA's numbers.
    xla_dump: where XLA dumps its programs (XLA_FLAGS=--xla_dump_to, set before JAX started), to
    read the optimized HLO and the values alive at the peak from; None reads neither. time_estimate:
    XLA's time for the program as it runs (`time_as_run`, a second compile where it loops); else
    left for a later pass (bench/tpu_compile_table.py --time-only)."""
    import dataclasses

    import jax

    from titan_tpu.graph.jax_program import jax_mesh, lower_step
    from titan_tpu.xla.dump import (
        compile_stages,
        f8_dots,
        matmul_flops,
        optimized_hlo,
        peak_values,
        program_loops,
        tpu_programs,
    )

    mesh = jax_mesh(step, devices)
    cpu_start = time.process_time()
    lowered = lower_step(step, mesh, program)
    lowered_text, lower_s = lowered.text, lowered.lower_seconds
    before = tpu_programs(xla_dump) if xla_dump is not None else set()
    start = time.perf_counter()
    try:
        with host_memory_guard():
            # the dump named per compile too: XLA_FLAGS is read once, when JAX starts its backends
            compiled = lowered.lowered.compile(None if xla_dump is None else {"xla_dump_to": str(xla_dump)})
    except jax.errors.JaxRuntimeError as e:  # XLA refused the program: its own reason, in one line
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ValueError(f"XLA's {step_platform(devices)} compiler rejected the step: {reason[:400]}") from None
    compile_s = time.perf_counter() - start
    # CPU seconds of this process (all threads, XLA's too) for lowering and compile: on a machine
    # shared with other work they say more than the wall time does.
    cpu_s = time.process_time() - cpu_start
    kinds, peak, cost = xla_numbers(compiled.memory_analysis(), compiled.cost_analysis())
    new = sorted(tpu_programs(xla_dump) - before) if xla_dump is not None else []
    at_peak, stages, matmuls, matmuls_as_run, loops = [], {}, None, None, []
    if new:  # XLA dumped the program (XLA_FLAGS=--xla_dump_to): its optimized HLO, what its peak holds
        text, collectives_from = optimized_hlo(new[-1]), "optimized HLO"
        at_peak = [dataclasses.asdict(v) for v in peak_values(new[-1])[:PEAK_VALUES]]
        stages = compile_stages(new[-1])
        matmuls, matmuls_as_run = matmul_flops(new[-1]), matmul_flops(new[-1], as_run=True)
        loops = program_loops(text)
    else:
        # libtpu 0.0.52 cannot print some async collectives it made (a RET_CHECK, logged at length)
        text, collectives_from = lowered_text, "StableHLO, before XLA's passes"
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "step.stablehlo.mlir").write_text(lowered_text)
        if collectives_from == "optimized HLO":
            (dump / "step.optimized.hlo").write_text(text)
    numbers = {
        "memory": kinds,
        "peak": peak, "fingerprint": lowered.fingerprint,
        "flops": cost.get("flops"), "matmul_flops": matmuls, "bytes_accessed": cost.get("bytes accessed"),
        # the TPU compiler's own estimate of the program's time (its cost model; absent on XLA:CPU),
        # a loop body's once, as its FLOPs; and the program's as it runs (`time_as_run`)
        "optimal_seconds": cost.get("optimal_seconds"),
        "matmul_flops_as_run": matmuls_as_run,
        "loop_trips": [loop.trips for loop in loops], "loops": [dataclasses.asdict(loop) for loop in loops],
        "optimal_seconds_as_run": None, "as_run_method": None,
        "lower_seconds": lower_s, "compile_seconds": compile_s, "cpu_seconds": cpu_s,
        "operations": len(re.findall(r"^\s*%\S+ = ", lowered_text, re.M)),
        "f8_dots": f8_dots(text),  # matmuls on float8 operands (fp8 recipes), loop bodies once
        "at_peak": at_peak, "xla_stages": stages, "text": text, "lowered_text": lowered_text,
        "collectives_from": collectives_from}
    if time_estimate:
        numbers.update(time_as_run(step, mesh, program, numbers,
                                   scratch=None if xla_dump is None else xla_dump / "unrolled"))
    return numbers


# What the reports say where XLA's cost model answers with a negative time (seen on v6e, tpu7x and
# multi-slice targets with libtpu 0.0.52): it has no estimate there.
NO_ESTIMATE = "none: XLA's cost model gives a negative time for this target"


def time_as_run(step, mesh, program: str, numbers: dict, *, scratch: Path | None) -> dict:
    """XLA's time estimate for a program as it runs, each loop counted as many times as it runs:
    {"optimal_seconds_as_run", "as_run_method", "optimal_seconds_unrolled_by_2"}, from the program's
    numbers (`compile_program`'s: its estimate, loops and matmul FLOPs) and, where it loops, a second
    compile of it.

    Its cost analysis counts a while loop's body once (a scan of 8 matmuls costs one) and gives no
    time per computation, so the body's time is read off a second compile: the same step with every
    scan running two of its steps per loop trip (graph/jax_lowering.py `scans_unrolled`), whose
    estimate counts each body twice (three times with an odd trip count: jax runs the odd step
    after the loop). With loops i of L_i trips and bodies b_i, the two estimates differ by
    sum (1 + L_i mod 2) b_i and the program runs sum (L_i - 1) b_i more than counted once
    (`loop_seconds`). A loop inside a body that is not a scan of ours (splash attention's loop over
    a micro-batch's rows) stays as it was, counted once per body as XLA counts it, in both forms (and
    in the fully unrolled program's estimate). Where a scan nests another (unrolling doubles both)
    the estimate is instead scaled by the matmul FLOPs as run over counted once, a rougher measure:
    the loop body's share of the time taken as its share of the matmul work. None off a TPU or
    without XLA's dump (whose optimized HLO says what loops the program has)."""
    from titan_tpu.xla.dump import Loop

    optimal_seconds, matmuls, matmuls_as_run = (numbers[k] for k in ("optimal_seconds", "matmul_flops",
                                                                    "matmul_flops_as_run"))
    loops = [Loop(trips=loop["trips"], body_matmul_flops=loop["body_matmul_flops"],
                  inner_trips=tuple(loop["inner_trips"])) for loop in numbers["loops"]]
    if optimal_seconds is None or scratch is None or matmuls is None:  # off a TPU, or no dump to read loops from
        return {"optimal_seconds_as_run": None, "as_run_method": None}
    if optimal_seconds < 0:  # libtpu 0.0.52's cost model on v6e, tpu7x and several slices: no time to scale
        return {"optimal_seconds_as_run": None, "as_run_method": NO_ESTIMATE}
    if not loops:
        return {"optimal_seconds_as_run": optimal_seconds, "as_run_method": "no loops"}
    from titan_tpu.graph.jax_lowering import scans_unrolled
    from titan_tpu.graph.jax_program import lower_step
    from titan_tpu.xla.dump import optimized_hlo, program_loops, tpu_programs

    with scans_unrolled(2):
        lowered = lower_step(step, mesh, program)
    before = tpu_programs(scratch) if scratch.exists() else set()
    with host_memory_guard():
        # dumped beside the program the report reads (`scratch`: a directory inside the caller's dump)
        compiled = lowered.lowered.compile({"xla_dump_to": str(scratch)})
    unrolled = xla_numbers(compiled.memory_analysis(), compiled.cost_analysis())[2].get("optimal_seconds")
    unrolled_loops = program_loops(optimized_hlo(sorted(tpu_programs(scratch) - before)[-1]))
    if {inner for loop in loops for inner in loop.inner_trips} != \
            {inner for loop in unrolled_loops for inner in loop.inner_trips}:
        # a scan inside a scan (unrolled too): no one equation for the bodies; the rougher measure
        return {"optimal_seconds_as_run": optimal_seconds * matmuls_as_run / matmuls if matmuls else None,
                "as_run_method": "matmul share", "optimal_seconds_unrolled_by_2": unrolled}
    return {"optimal_seconds_as_run": loop_seconds(optimal_seconds, unrolled, loops), "as_run_method": "unrolled by 2",
            "optimal_seconds_unrolled_by_2": unrolled}


def loop_seconds(once: float, unrolled_by_2: float, loops: list) -> float:
    """A program's time as it runs (`time_as_run`) from XLA's estimate of it (`once`: each loop's body
    once) and of its form with every scan two steps a trip. One equation for the bodies' times: they
    are split among loops of different trip counts by their matmul FLOPs (the same split whatever
    the trips where they are all equal, as a layer stack's forward and backward loops are)."""
    weights = [loop.body_matmul_flops for loop in loops]
    if not all(weights):
        weights = [1.0] * len(loops)
    unit = (unrolled_by_2 - once) / sum((1 + loop.trips % 2) * w for loop, w in zip(loops, weights))
    return once + unit * sum((loop.trips - 1) * w for loop, w in zip(loops, weights))


def step_platform(devices) -> str:
    """"TPU" or "CPU": whose XLA compiles for these devices."""
    return devices[0].platform.upper()


def xla_dump_env(directory: Path | None) -> Path:
    """Have XLA dump the programs it compiles into `directory` (a new temporary one when None):
    their optimized HLO and buffer assignment, which the report reads (the collectives XLA kept,
    the values alive at its peak). Sets XLA_FLAGS, which XLA reads when JAX starts its backends:
    call before the first compile of the process."""
    directory = Path(directory or tempfile.mkdtemp(prefix="titan_tpu_xla_"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={directory}").strip()
    return directory


def hlo_collectives(hlo_text: str) -> dict[str, int]:
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
    counts = {}
    for kind in kinds:
        # HLO: "= f32[..] all-gather-start(" ; StableHLO: "stablehlo.all_gather", or a custom call
        # ("stablehlo.custom_call @ragged_all_to_all("); all-to-all is not the tail of ragged-all-to-all.
        name = kind.replace('-', '_')
        n = len(re.findall(rf"(?<![\w-]){kind}(?:-start)?\(|stablehlo\.{name}\b|@{name}\(", hlo_text))
        if n:
            counts[kind] = n
    return counts


def pallas_kernels(stablehlo: str) -> dict[str, int]:
    """The Pallas kernels in the program (Mosaic custom calls, ``tpu_custom_call``), each named by
    its kernel name, or by the JAX function that calls it where that name is the generic "kernel"
    (megablox's gmm and tgmm), with how often each is called in the StableHLO (a kernel called from
    a loop counts once)."""
    counts: dict[str, int] = {}
    for function in stablehlo.split("func.func ")[1:]:
        caller = re.sub(r"_\d+$", "", (re.match(r"(?:\w+ )?@([\w.]+)", function) or [None, "?"])[1])
        for name in re.findall(r'custom_call @tpu_custom_call\(.*?kernel_name = "([^"]+)"', function, re.S):
            name = caller if name == "kernel" else name
            counts[name] = counts.get(name, 0) + 1
    return counts
