"""`titan-tpu compile`: XLA's TPU compiler's verdict on our training step, on any CPU machine.

The step one device of the run captures (graph mode: forward, loss, backward, clipping, AdamW,
SimpleFSDP's collectives), captured on this one process under a fake process group
(tools/device_step.py), lowered to JAX (graph/jax_lowering.py) inside shard_map over the slice's
devices, and compiled with libtpu's compile-only client for the slice's topology
(`jax.experimental.topologies.get_topology_desc`). Printed: XLA's memory per chip by kind, the
peak against the chip's HBM, XLA's FLOPs per chip against our formula, bytes accessed, the
collectives XLA kept, and the compile time. Needs .venv-tpu (jax + libtpu).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["compile_main", "recipe_topology", "topology_for", "topology_for_chips", "xla_beside_plan"]

GiB = 1024**3
KNOWN_TOPOLOGIES = ("v5p:2x2x1", "v5p:2x2x2", "v5p:4x4x4", "v5p:8x16x16", "v5e:2x2", "v6e:4x4", "v6e:16x16",
                    "tpu7x:2x2x1")


def topology_for(hardware: str) -> str:
    """A slice name as Google writes it (v5p-8: 4 chips) -> a topology name (v5p:2x2x1)."""
    from titan_tpu.plan.hardware import resolve_hardware

    hw, chips = resolve_hardware(hardware, measure=False)
    if chips is None:
        raise ValueError(f"--hardware {hardware}: give a TPU slice with its size (e.g. v5p-8), or --topology "
                         "(e.g. v5p:2x2x1)")
    return topology_for_chips(hw.name, chips)


def topology_for_chips(generation: str, chips: int) -> str:
    """The topology of `chips` chips of a TPU generation: spread over 3 torus axes for
    v4/v5p/tpu7x, 2 for v5e/v6e, each axis doubled in turn."""
    generation = {"v7": "tpu7x"}.get(generation, generation)
    if chips & (chips - 1):
        raise ValueError(f"a {generation} slice of {chips} chips: give a chip count that is a power of two, "
                         "or --topology (e.g. v5p:2x2x1)")
    dims = [1, 1, 1] if generation in ("v4", "v5p", "tpu7x") else [1, 1]
    for i in range(int(math.log2(chips))):
        dims[i % len(dims)] *= 2
    # Ascending with the unused axes last, as libtpu names them (v5p:2x2x1, v5p:2x2x4).
    dims = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]
    return f"{generation}:{'x'.join(str(d) for d in dims)}"


def _require_jax(*, libtpu: bool = True) -> None:
    import importlib.util

    if importlib.util.find_spec("jax") is None or libtpu and importlib.util.find_spec("libtpu") is None:
        raise ValueError("titan-tpu compile needs JAX and libtpu: `make tpu-check` builds .venv-tpu; "
                         "run .venv-tpu/bin/titan-tpu compile")


def _topology(name: str, slices: int = 1):
    """libtpu's compile-only description of `slices` slices of topology `name` (one slice: no
    num_slices, as before multi-slice)."""
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            **({"num_slices": slices} if slices > 1 else {}))
    except Exception as e:  # noqa: BLE001 - libtpu raises its own error types
        if "lockfile" in str(e):
            raise ValueError("libtpu is in use by another process on this machine (/tmp/libtpu_lockfile); set "
                             "ALLOW_MULTIPLE_LIBTPU_LOAD=1 (a compile-only client takes no device) or wait") from e
        raise ValueError(f"unknown TPU topology {name!r} ({type(e).__name__}); known ones include "
                         f"{', '.join(KNOWN_TOPOLOGIES)}") from e


def _force_cpu_devices(target: str) -> None:
    """XLA_FLAGS for the N host devices of a target "cpu:N", before JAX starts its CPU client (and
    only that client: libtpu is not asked for a TPU)."""
    count = target.split(":", 1)[1]
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--topology {target}: a CPU target is cpu:N with N devices, e.g. cpu:8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def cpu_devices(target: str) -> list:
    """The N XLA host devices of a target "cpu:N" (the program the JAX path runs on a CPU):
    XLA_FLAGS must have made them before JAX started (`compile_main` does)."""
    import jax

    count = int(target.split(":", 1)[1])
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise ValueError(f"--topology {target}: JAX has {len(devices)} CPU devices in this process; start it with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (titan-tpu compile sets it)")
    return devices[:count]


def _collectives(hlo_text: str) -> dict[str, int]:
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


def capture_for_jax(cfg, platform: str = "tpu", **capture_args):
    """(rank's DeviceStep captured as the JAX path captures it on `platform`, cfg as captured, what
    each op ran as; graph/jax_program.py): a kernel that cannot take the shapes (splash's blocks of
    128, gmm's tiles) is replaced by the op's CPU pick, traced as ATen ops, and the op's entry says
    which and why."""
    import dataclasses

    from titan_tpu.graph.jax_program import capture_context, jax_kernels
    from titan_tpu.kernels import OPS
    from titan_tpu.kernels.registry import KernelShapeError
    from titan_tpu.tools.device_step import capture_device_step

    cfg, used = jax_kernels(cfg, platform)
    while True:
        try:
            with capture_context(platform):
                return capture_device_step(cfg, **capture_args), cfg, used
        except KernelShapeError as e:
            replaced = {}
            for field, op in OPS.items():
                if getattr(cfg.kernels, field) == e.kernel:
                    replaced[field] = op.resolve("auto", "cpu").name
                    used[field] = f"{replaced[field]} (in place of {e.kernel}: {str(e).split(';')[0]})"
            if not replaced:
                raise
            cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, **replaced))


def trainer_documents(cfg) -> bool:
    """Whether the trainer's batches carry document positions: data.document_mask, or chat data
    (always packed with document masks; data/build.py uses_document_mask), read from the config
    alone (no data is opened)."""
    return bool(cfg.data.document_mask or cfg.data.format == "chat"
                or any(getattr(source, "format", "text") == "chat" for source in cfg.data.sources))


def compile_step_for_tpu(cfg, topology_name: str, dump: Path | None = None, xla_dump: Path | None = None) -> dict:
    """Compile `cfg`'s step for the topology, as the trainer would run it there; returns the report
    (see the module docstring). As the trainer: parallelism.reshard_after_forward auto decided by
    the planner for that slice (planner.reshard_decision), document masking where its data has
    it, and with gradient accumulation its two programs (micro-batch and update), each compiled;
    the step's peak is the larger of theirs (between them only their arguments are alive).
    xla_dump: the directory XLA_FLAGS=--xla_dump_to names (`xla_dump_env`), for the collectives
    XLA kept and the values alive at its peak; None: both from what can be read without it."""
    from titan_tpu.models.spec import model_spec
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.plan.planner import reshard_decision

    platform = "cpu" if topology_name.startswith("cpu:") else "tpu"
    slices = cfg.parallelism.slices
    if slices > 1 and platform == "cpu":
        raise ValueError(f"parallelism.slices = {slices} compiles for TPU slices; --topology cpu:N is one machine: "
                         "give a TPU topology, or set --parallelism.slices 1")
    devices = cpu_devices(topology_name) if platform == "cpu" else slice_major(_topology(topology_name, slices).devices)
    generation = topology_name.split(":")[0].replace("tpu7x", "v7")
    # A CPU target plans on the hardware the config names, as the run on this CPU does.
    hardware = HARDWARE.get(generation) if platform == "tpu" else None
    t = cfg.training
    reshard, why = reshard_decision(cfg, world_size=len(devices), hardware=hardware)
    documents = trainer_documents(cfg)
    start = time.perf_counter()
    captured, cfg, kernels_used = capture_for_jax(cfg, platform, world_size=len(devices), batch_size=t.batch_size,
                                                  seq_len=t.seq_len, reshard_after_forward=reshard,
                                                  documents=documents, grad_accum_steps=t.grad_accum_steps)
    capture_s = time.perf_counter() - start
    steps = {"step": captured} if not isinstance(captured, tuple) else dict(zip(("micro-batch", "update"), captured))
    programs = {name: _compile_program(step, devices, program=name, xla_dump=xla_dump,
                                       dump=None if dump is None else dump if len(steps) == 1 else dump / name)
                for name, step in steps.items()}
    first = next(iter(steps.values()))
    peak_name = max(programs, key=lambda name: programs[name]["peak"])
    peak = programs[peak_name]
    hbm = hardware.memory_bytes if hardware is not None else None
    flops_per_token, _ = model_spec(cfg.model).flops_per_token(None, t.seq_len)  # native specs read only the args
    if t.objective == "dpo":
        flops_per_token *= 4 / 3  # the frozen reference's forward too (loops/dpo.py)
    runs = {"step": 1, "micro-batch": t.grad_accum_steps, "update": 1}
    flops = sum(runs[name] * (p["flops"] or 0.0) for name, p in programs.items()) if peak["flops"] is not None \
        else None
    tokens_per_chip = _step_tokens(first.captured) * t.grad_accum_steps / len(devices)
    report = {
        "topology": topology_name, "platform": platform, "devices": len(devices), "mesh": dict(first.axis_sizes),
        # several slices: `topology` is each one's; the slice of each dp_replicate index (slices_of_replicas)
        **({"slices": slices, "slice_of_dp_replicate": slices_of_replicas(first, devices)} if slices > 1 else {}),
        # what a run of the JAX path on this target logs for each program it hands XLA (graph/fingerprint.py)
        "fingerprints": {name: p["fingerprint"] for name, p in programs.items()},
        "reshard_after_forward": reshard, "reshard_why": why, "documents": documents,
        "grad_accum_steps": t.grad_accum_steps,
        "memory_per_chip_bytes": peak["memory"], "peak_per_chip_bytes": peak["peak"], "peak_program": peak_name,
        "programs": {name: {k: v for k, v in p.items() if k not in ("text", "lowered_text")}
                     for name, p in programs.items()},
        "hbm_per_chip_bytes": hbm, "fits": None if hbm is None else peak["peak"] <= hbm,
        "flops_per_chip": flops,
        # the dots and convolutions of XLA's optimized program (tools/xla_dump.py matmul_flops): what our
        # formula counts; cost analysis's total also counts every elementwise op
        "xla_matmul_flops_per_chip": sum(runs[name] * p["matmul_flops"] for name, p in programs.items())
        if all(p["matmul_flops"] is not None for p in programs.values()) else None,
        "bytes_accessed_per_chip": sum(runs[name] * (p["bytes_accessed"] or 0.0) for name, p in programs.items()),
        "tokens_per_chip": tokens_per_chip,
        "formula_flops_per_chip": flops_per_token * tokens_per_chip,
        "formula_as_xla_counts_per_chip": formula_as_xla_counts(cfg, kernels_used, tokens_per_chip,
                                                                topology=topology_name),
        # XLA's cost analysis counts a while loop's body once, not once per trip (a lax.scan of 8
        # matmuls reports the FLOPs of 1): with scanned layers its FLOPs are the step outside the
        # layers plus one layer's forward and backward.
        "loop_body_counted_once": bool(cfg.model.scan_layers),
        "collectives": _collectives(peak["text"]), "collectives_counted_in": peak["collectives_from"],
        "f8_dots": sum(p["f8_dots"] for p in programs.values()),
        "kernels": kernels_used, "tpu_kernels": _tpu_kernels(peak["lowered_text"]), "at_peak": peak["at_peak"],
        "capture_seconds": capture_s, "lower_seconds": sum(p["lower_seconds"] for p in programs.values()),
        "compile_seconds": sum(p["compile_seconds"] for p in programs.values()),
        "lower_compile_cpu_seconds": sum(p["cpu_seconds"] for p in programs.values()),
        "load_average": os.getloadavg()[0],
        "operations": sum(p["operations"] for p in programs.values()),
        # XLA's compile split into its HLO passes and the TPU code generation after them (from its dump)
        "xla_stage_seconds": {stage: sum(p["xla_stages"].get(stage, 0.0) for p in programs.values())
                              for stage in ("hlo_passes", "codegen")
                              if any(p["xla_stages"] for p in programs.values())},
    }
    return report


def slice_major(devices) -> list:
    """The devices of a multi-slice topology slice by slice (each slice's in libtpu's order), so that
    rank r on device r puts the outermost mesh axis, dp_replicate, across the slices and the rest
    inside each (parallel/fabric_terms.py): what MaxText's hybrid mesh does with dcn_data_parallelism.
    One slice's devices (no slice_index) stay as they are."""
    order = {id(d): i for i, d in enumerate(devices)}
    return sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, order[id(d)]))


def slices_of_replicas(step, devices) -> list[int]:
    """The slice each dp_replicate index of the step's JAX mesh lies in (graph/jax_program.py
    jax_mesh over `devices`); a one-line error where one index spans two slices, which would send
    the inner axes' collectives over the data-center network."""
    import numpy as np

    from titan_tpu.graph.jax_program import jax_mesh

    mesh = jax_mesh(step, devices)
    names = list(mesh.axis_names)
    grid = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0)(mesh.devices)
    grid = np.moveaxis(grid, names.index("dp_replicate"), 0) if "dp_replicate" in names else grid[None]
    out = []
    for i, block in enumerate(grid):
        spanned = sorted(map(int, set(block.flat)))
        if len(spanned) != 1:
            raise ValueError(f"dp_replicate index {i} spans slices {spanned}: the mesh must put only dp_replicate "
                             "across slices; set parallelism.dp_replicate to a multiple of parallelism.slices")
        out.append(int(block.flat[0]))
    return out


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


def child_error_line(stderr: str) -> str:
    """The one-line reason a `titan-tpu compile` child process failed: its "error: ..." line (the
    command's refusals, XLA's rejection, the host-memory guard), else its last line that is not
    libtpu's start-up logging."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    ours = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
    # libtpu's own abort: a glog fatal line, "F1204 20:55:12.25 ... file.cc:123] Check failed: ..."
    aborted = [f"libtpu aborted the compile: {line.split('] ', 1)[-1]}" for line in lines
               if re.match(r"F\d{4} ", line)]
    rest = [line for line in lines if not line.startswith(("E0000", "W0000", "I0000", "WARNING", "==="))]
    return (ours or aborted or rest or ["(no output)"])[-1][:400]


def _compile_program(step, devices, *, program: str, dump: Path | None, xla_dump: Path | None) -> dict:
    """Lower one captured program to JAX over the devices' mesh and compile it; XLA's numbers.
    xla_dump: where XLA dumps its programs (XLA_FLAGS=--xla_dump_to, set before JAX started), to
    read the optimized HLO and the values alive at the peak from; None reads neither."""
    import dataclasses

    import jax

    from titan_tpu.graph.jax_program import jax_mesh, lower_step
    from titan_tpu.tools.xla_dump import compile_stages, f8_dots, matmul_flops, optimized_hlo, peak_values, tpu_programs

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
    at_peak, stages, matmuls = [], {}, None
    if new:  # XLA dumped the program (XLA_FLAGS=--xla_dump_to): its optimized HLO, what its peak holds
        text, collectives_from = optimized_hlo(new[-1]), "optimized HLO"
        at_peak = [dataclasses.asdict(v) for v in peak_values(new[-1])[:PEAK_VALUES]]
        stages = compile_stages(new[-1])
        matmuls = matmul_flops(new[-1])
    else:
        # libtpu 0.0.52 cannot print some async collectives it made (a RET_CHECK, logged at length)
        text, collectives_from = lowered_text, "StableHLO, before XLA's passes"
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / "step.stablehlo.mlir").write_text(lowered_text)
        if collectives_from == "optimized HLO":
            (dump / "step.optimized.hlo").write_text(text)
    return {"memory": kinds,
            "peak": peak, "fingerprint": lowered.fingerprint,
            "flops": cost.get("flops"), "matmul_flops": matmuls, "bytes_accessed": cost.get("bytes accessed"),
            "lower_seconds": lower_s, "compile_seconds": compile_s, "cpu_seconds": cpu_s,
            "operations": len(re.findall(r"^\s*%\S+ = ", lowered_text, re.M)),
            "f8_dots": f8_dots(text),  # matmuls on float8 operands (fp8 recipes), loop bodies once
            "at_peak": at_peak, "xla_stages": stages, "text": text, "lowered_text": lowered_text,
            "collectives_from": collectives_from}


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


def _tpu_kernels(stablehlo: str) -> dict[str, int]:
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


def _format(report: dict) -> str:
    kinds = report["memory_per_chip_bytes"]
    slices = f"{report['slices']} x " if report.get("slices", 1) > 1 else ""
    lines = [f"compiled for {slices}{report['topology']} ({report['devices']} devices, mesh "
             f"{report['mesh'] or 'one device'}) in {report['compile_seconds']:.1f} s "
             f"(capture {report['capture_seconds']:.1f} s, lowering {report['lower_seconds']:.1f} s, "
             f"{report['operations']:,} StableHLO operations"
             + "".join(f"; XLA's {name.replace('_', ' ')} {seconds:.1f} s"
                       for name, seconds in report.get("xla_stage_seconds", {}).items())
             + "); numbers are XLA's, per chip:"
             + (f"\n  dp_replicate across the slices over DCN: its indices in slices {report['slice_of_dp_replicate']}"
                if slices else ""),
             "  fingerprint " + ", ".join(f"{name} {fp}" for name, fp in report["fingerprints"].items())
             + " (what a run of --compile.backend jax on these devices logs for each program it hands XLA)"
             + ("" if report.get("compile_backend") in (None, "jax") else
                f"; this config runs compile.backend {report['compile_backend']}, another program (TorchTPU's "
                "lowering beside ours: bench/torchtpu_lowering.py)"),
             f"  as the trainer runs it: re-shard after forward {str(report['reshard_after_forward']).lower()} "
             f"({report['reshard_why']}), documents {'masked' if report['documents'] else 'not masked'}"
             + (f", {report['grad_accum_steps']} micro-batches: programs micro-batch and update, the peak is the "
                f"{report['peak_program']}'s" if len(report["programs"]) > 1 else ""),
             "  memory: " + ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in kinds.items())]
    peak, hbm = report["peak_per_chip_bytes"], report["hbm_per_chip_bytes"]
    verdict = "" if hbm is None else f" of {hbm / GiB:.0f} GiB HBM: {'fits' if report['fits'] else 'does NOT fit'}"
    lines.append(f"  peak {peak / GiB:.3f} GiB (arguments + outputs - aliased + temporaries + code){verdict}")
    flops = report["flops_per_chip"]
    lines.append(f"  FLOPs per step {flops:.3e} by XLA's cost analysis" if flops is not None
                 else "  FLOPs: not reported")
    if report["formula_flops_per_chip"]:
        lines[-1] += f" (our formula {report['formula_flops_per_chip']:.3e})"
    matmuls = report.get("xla_matmul_flops_per_chip")
    if matmuls:
        lines.append(f"  of them in the dots and convolutions of XLA's optimized program {matmuls:.3e} (the rest, "
                     f"{1 - matmuls / flops:.1%}, elementwise work)")
    if report.get("formula_as_xla_counts_per_chip"):
        counted = report["formula_as_xla_counts_per_chip"]
        lines.append(f"  our formula counted as XLA counts (scanned loop bodies once, no work inside the Pallas "
                     f"kernels, checkpointing's rerun): {counted:.3e}"
                     + (f" ({counted / compared_flops(report):.3f}x XLA's {'matmuls' if matmuls else 'FLOPs'})"
                        if flops else ""))
    if report.get("loop_body_counted_once"):
        lines.append("  (scanned layers: XLA counts each while loop's body once, so its FLOPs are the step outside "
                     "the layers plus one layer's forward and backward)")
    if report["bytes_accessed_per_chip"] is not None:
        lines.append(f"  bytes accessed {report['bytes_accessed_per_chip'] / GiB:.3f} GiB")
    lines.append("  kernels: " + ", ".join(f"{op} {name}" for op, name in report["kernels"].items()))
    lines.append("  Pallas kernels in the program (Mosaic custom calls): "
                 + (", ".join(report["tpu_kernels"]) or "none"))
    if report.get("f8_dots"):
        lines.append(f"  fp8 matmuls (dots on float8 operands, a loop body's once): {report['f8_dots']}")
    lines.append("  collectives: " + (", ".join(f"{k} {v}" for k, v in report["collectives"].items()) or "none")
                 + f" (in the {report['collectives_counted_in']}; one per loop body)")
    if report.get("at_peak"):
        lines.append("  the largest values alive at XLA's peak (what made them: our module, or step):")
        lines += [f"    {v['bytes'] / GiB:7.3f} GiB  {v['shape']:28s} {v['origin'] or v['name']}"
                  for v in report["at_peak"][:8]]
    return "\n".join(lines)


def compile_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="titan-tpu compile",
        description="Compile the training step of a config with XLA's TPU compiler for a TPU slice, on this CPU "
                    "(no TPU needed; needs .venv-tpu): XLA's per-chip memory, FLOPs and collectives. "
                    "Config overrides as for train.")
    parser.add_argument("--config", required=True, help="TOML recipe, e.g. configs/llama3_8b_tpu.toml")
    parser.add_argument("--hardware", help="a TPU slice as Google names it, e.g. v5p-8 (4 chips)")
    parser.add_argument("--topology", help="a libtpu topology name, e.g. v5p:2x2x1 (default: the slice the "
                        "recipe's job.description names, or v5p:2x2x1); cpu:N for N XLA host devices (the program "
                        "--compile.backend jax runs on this CPU). With --parallelism.slices N (or a recipe's), the "
                        "topology (or --hardware) names one slice and N of them are compiled, as MaxText's "
                        "compile_topology with compile_topology_num_slices")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dump", help="directory for the StableHLO, the optimized HLO and XLA's own dump (DIR/xla: "
                        "buffer assignment, live ranges)")
    args, overrides = parser.parse_known_args(argv)
    on_cpu = bool(args.topology and args.topology.startswith("cpu:"))
    _require_jax(libtpu=not on_cpu)
    if on_cpu:
        _force_cpu_devices(args.topology)
    xla_dump = xla_dump_env(Path(args.dump) / "xla" if args.dump else None)
    # A compile-only client takes no device: it may load libtpu beside another process's (libtpu's
    # lockfile refuses that unless told); read when libtpu starts, below.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from titan_tpu.config import build_config
    from titan_tpu.run_setup import prepare_run

    cfg = prepare_run(build_config(args.config, overrides)).cfg
    topology = args.topology or (topology_for(args.hardware) if args.hardware else recipe_topology(cfg))
    try:
        report = compile_step_for_tpu(cfg, topology, Path(args.dump) if args.dump else None, xla_dump=xla_dump)
    finally:
        if not args.dump:
            shutil.rmtree(xla_dump, ignore_errors=True)
    report["config"] = " ".join([args.config, *overrides])
    report["compile_backend"] = cfg.compile.backend  # the runtime a run of this config hands its step to
    print(json.dumps(report, indent=2) if args.json else _format(report))
    if report["fits"] is False:
        kinds = report["memory_per_chip_bytes"]
        raise ValueError(f"{args.config} does not fit {topology}: XLA's peak {report['peak_per_chip_bytes'] / GiB:.2f} "
                         f"GiB per chip > {report['hbm_per_chip_bytes'] / GiB:.0f} GiB HBM (temporaries "
                         f"{kinds['temporaries'] / GiB:.2f} GiB, arguments {kinds['arguments'] / GiB:.2f} GiB); "
                         "lower training.batch_size or seq_len, add activation checkpointing, or use a larger slice")
    return 0


def compared_flops(report: dict) -> float | None:
    """The XLA count our formula is compared with: the matmul FLOPs of XLA's optimized program where
    the report has them (our formula counts matmuls only; under expert parallelism XLA's cost
    analysis adds much elementwise work on the dispatch buffers), else its cost analysis's total."""
    return report.get("xla_matmul_flops_per_chip") or report["flops_per_chip"]


def xla_beside_plan(plan, path: str, compiled=None) -> tuple[str, dict]:
    """(lines for `titan-tpu plan --xla PATH`, the comparison as a dict): XLA's per-chip numbers
    from a saved `titan-tpu compile --json` report beside the plan's. The report must be of the
    same number of chips; its config is named in it, so a report of another recipe is visible.
    compiled: the plan of the compiled program (planner `as_compiled`), whose peak is the one
    compared with XLA's; default: `plan`'s."""
    try:
        report = json.loads(Path(path).read_text())
        xla_peak, xla_flops = report["peak_per_chip_bytes"], compared_flops(report)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--xla {path}: not a report of `titan-tpu compile --json` ({type(e).__name__}: {e}); "
                         "save one with titan-tpu compile --config ... --json > xla.json") from e
    if report["devices"] != plan.devices:
        raise ValueError(f"--xla {path}: compiled for {report['devices']} chips ({report['topology']}), the plan is "
                         f"for {plan.devices}; compile the same slice (--hardware) or plan its size")
    compiled = compiled or plan
    plan_flops = plan.flops["executed_per_step_per_device"]
    # XLA counts a scanned loop's body once and no work inside a Pallas kernel: the comparison is
    # with our formula counted the same way (the report's), where the report has it.
    counted = report.get("formula_as_xla_counts_per_chip")
    compared = counted if counted else plan_flops
    beside = {"config": report.get("config"), "topology": report["topology"], "xla_peak_bytes": xla_peak,
              "plan_peak_bytes": plan.peak_bytes, "plan_peak_as_compiled_bytes": compiled.peak_bytes,
              "peak_ratio": compiled.peak_bytes / xla_peak,
              "xla_flops": xla_flops, "plan_flops": plan_flops, "formula_as_xla_counts": counted,
              "flops_ratio": compared / xla_flops if xla_flops else None,
              "xla_memory_bytes": report["memory_per_chip_bytes"]}
    kinds = report["memory_per_chip_bytes"]
    made = f", {report['date']}" if report.get("date") else ""
    lines = [f"XLA's TPU compiler (compile-only, {report['topology']}{made}, from {path}"
             f"{', config ' + report['config'] if report.get('config') else ''}), per chip beside the plan:",
             f"  peak {xla_peak / 1e9:.3f} GB (arguments {kinds['arguments'] / 1e9:.3f}, temporaries "
             f"{kinds['temporaries'] / 1e9:.3f}, code {kinds['code'] / 1e9:.3f}); plan of the compiled program "
             f"{compiled.peak_bytes / 1e9:.3f} GB ({beside['peak_ratio']:.2f}x XLA's; as a TPU runs it "
             f"{plan.peak_bytes / 1e9:.3f} GB)"]
    if xla_flops and counted:
        counted_in = ("in the dots and convolutions of its program" if report.get("xla_matmul_flops_per_chip")
                      else "by its cost analysis")
        lines.append(f"  FLOPs per step {xla_flops / 1e12:,.3f} TFLOP {counted_in} (scanned loop bodies once, no "
                     f"work inside the Pallas kernels); our formula counted so {counted / 1e12:,.3f} TFLOP "
                     f"({beside['flops_ratio']:.3f}x XLA's); the plan's whole step {plan_flops / 1e12:,.3f} TFLOP")
    elif xla_flops:
        lines.append(f"  FLOPs per step {xla_flops / 1e12:,.3f} TFLOP; plan executed {plan_flops / 1e12:,.3f} TFLOP "
                     f"({beside['flops_ratio']:.3f}x XLA's)"
                     + ("; XLA counted the scanned layers' loop bodies once, so these differ by about the "
                        "layer count" if report.get("loop_body_counted_once") else ""))
    return "\n".join(lines), beside


def recipe_topology(cfg) -> str:
    """The slice a TPU recipe's job.description names ("TPU v5p-128: 64 chips"; with
    parallelism.slices, one of them: "TPU 2 x v5p-128: 128 chips" is v5p:4x4x4); v5p:2x2x1 for any
    other recipe (a debug recipe compiled for the smallest v5p slice)."""
    if cfg.training.device != "tpu":
        return "v5p:2x2x1"
    from titan_tpu.plan.setting import default_hardware

    hardware, chips = default_hardware(cfg, measure=False)
    return topology_for_chips(hardware.name, chips // cfg.parallelism.slices)


def formula_as_xla_counts(cfg, kernels_used: dict, tokens_per_chip: float, *, topology: str) -> float | None:
    """Our FLOP formula counted as XLA's cost analysis counts the compiled step (models/registry.py
    flops_per_token_as_xla_counts): a scanned stack's loop body once, nothing inside the Mosaic
    custom calls (splash attention, megablox's gmm and tgmm), full checkpointing's rerun of the
    forward, DPO's reference forward, and on tpu7x the logits of tokamax's plain-XLA loss computed
    twice (XLA rematerializes them there). topology: the slice compiled for, e.g. "v5p:2x2x1".
    None for a model without native args (an HF directory)."""
    from titan_tpu.models.registry import flops_per_token_as_xla_counts
    from titan_tpu.models.spec import model_spec

    args = getattr(model_spec(cfg.model), "args", None)
    if args is None:
        return None
    attention = kernels_used.get("attention", "").split()[0] if kernels_used.get("attention") else ""
    mode = "kernel" if attention.startswith("splash") else "full" if attention in ("sdpa", "reference") else "causal"
    per_token = flops_per_token_as_xla_counts(
        args, cfg.training.seq_len, layers_counted=1 if cfg.model.scan_layers else args.n_layers + args.mtp_num_layers,
        recompute=cfg.activation_checkpoint.mode == "full", attention=mode,
        experts_in_kernel=kernels_used.get("grouped_mm", "").startswith("gmm"), frozen_base=cfg.lora.enabled,
        reference_forward=cfg.training.objective == "dpo",
        logits_recomputed=topology.startswith("tpu7x") and kernels_used.get("loss", "").startswith("tokamax"))
    return per_token * tokens_per_chip


def _step_tokens(captured) -> int:
    """Tokens of one step on all devices: this device's trained rows (a DPO pair is two) times their
    length, times the data-parallel ranks."""
    from titan_tpu.data.batch import PreferenceBatch, unflatten

    batch = unflatten(captured.layout.unflatten_inputs(captured.example_inputs)["batch"], captured.batch_spec)
    rows = [batch.chosen, batch.rejected] if isinstance(batch, PreferenceBatch) else [batch]
    return sum(row.labels_BS.numel() for row in rows) * captured.dp_size
