"""`titan-tpu compile`: XLA's TPU compiler's verdict on our training step, on any CPU machine.

The step one device of the run captures (graph mode: forward, loss, backward, clipping, AdamW,
SimpleFSDP's collectives), built by the code that trains: the run resolved for the slice's devices
on the JAX path (components/resolve.py), rank 0's program assembled on a fake process group of the
run's size and captured as the run's JAX path captures it (components/program.py), lowered to JAX
(graph/jax_lowering.py) inside shard_map over the slice's devices (graph/jax_devices.py), and
compiled with libtpu's compile-only client for the slice's topology
(`jax.experimental.topologies.get_topology_desc`; slice names: plan/topology.py). Printed: XLA's
memory per chip by kind, the peak against the chip's HBM, XLA's FLOPs per chip against our formula
(plan/xla_compare.py), bytes accessed, the collectives XLA kept, and the compile time
(xla/numbers.py). Needs .venv-tpu (jax + libtpu).

Here the command's flow: its arguments (`compile_main`), the step built by the trainer's own
assembly and compiled (`compile_step_for_tpu`), the report printed (`_format`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

__all__ = ["child_error_line", "compile_main", "compile_step_for_tpu", "estimate_time_for_tpu",
           "fingerprints_for_tpu"]

GiB = 1024**3


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
    from titan_tpu.xla.numbers import xla_dump_env

    on_cpu = bool(args.topology and args.topology.startswith("cpu:"))
    _require_jax(libtpu=not on_cpu)
    if on_cpu:
        _force_cpu_devices(args.topology)
    xla_dump = xla_dump_env(Path(args.dump) / "xla" if args.dump else None)
    # A compile-only client takes no device: it may load libtpu beside another process's (libtpu's
    # lockfile refuses that unless told); read when libtpu starts, below.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from titan_tpu.config import build_config
    from titan_tpu.plan.topology import recipe_topology, topology_for
    from titan_tpu.run.setup import prepare_run
    from titan_tpu.tools.hf_shape_dir import ensure

    cfg = build_config(args.config, overrides)
    # A recipe's weightless stand-in of a Transformers-backend model's directory; said on stderr (--json's stdout)
    ensure(cfg.model.hf_config, log=lambda message: print(message, file=sys.stderr))
    cfg = prepare_run(cfg).cfg
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


def _require_jax(*, libtpu: bool = True) -> None:
    import importlib.util

    if importlib.util.find_spec("jax") is None or libtpu and importlib.util.find_spec("libtpu") is None:
        raise ValueError("titan-tpu compile needs JAX and libtpu: `make tpu-check` builds .venv-tpu; "
                         "run .venv-tpu/bin/titan-tpu compile")


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


def _target(cfg, topology_name: str) -> tuple[str, list, object]:
    """(platform, the slice's devices slice by slice, the hardware the run plans on) of a compile
    target: a TPU topology (libtpu's compile-only devices) or cpu:N."""
    from titan_tpu.graph.jax_devices import cpu_devices, slice_major, tpu_topology
    from titan_tpu.plan.hardware import HARDWARE

    platform = "cpu" if topology_name.startswith("cpu:") else "tpu"
    slices = cfg.parallelism.slices
    if slices > 1 and platform == "cpu":
        raise ValueError(f"parallelism.slices = {slices} compiles for TPU slices; --topology cpu:N is one machine: "
                         "give a TPU topology, or set --parallelism.slices 1")
    devices = cpu_devices(topology_name) if platform == "cpu" else \
        slice_major(tpu_topology(topology_name, slices).devices)
    generation = topology_name.split(":")[0].replace("tpu7x", "v7")
    # A CPU target plans on the hardware the config names, as the run on this CPU does.
    return platform, devices, HARDWARE.get(generation) if platform == "tpu" else None


def fingerprints_for_tpu(cfg, topology_name: str) -> dict[str, str]:
    """The fingerprint of each program `compile_step_for_tpu` compiles for the topology, with no
    compile: the step captured and lowered as there (the lowering is cheap next to XLA's compile),
    so a compile report can be re-checked against today's code (tools/recheck.py)."""
    from titan_tpu.components.program import capture_rank
    from titan_tpu.graph.jax_program import jax_mesh, lower_step
    from titan_tpu.run.resolved import Target

    platform, devices, hardware = _target(cfg, topology_name)
    _run, steps, _example = capture_rank(cfg, Target.for_jax(platform, len(devices)), hardware=hardware)
    return {name: lower_step(step, jax_mesh(step, devices), name).fingerprint for name, step in steps.items()}


def compile_step_for_tpu(cfg, topology_name: str, dump: Path | None = None, xla_dump: Path | None = None,
                         time_estimate: bool = True) -> dict:
    """Compile `cfg`'s step for the topology, built by the code that trains (components/program.py:
    the run resolved for the slice's devices, then rank 0's program assembled on a fake world and
    captured); returns the report (see the module docstring). With gradient accumulation its two
    programs (micro-batch and update) are each compiled; the step's peak is the larger of theirs
    (between them only their arguments are alive). xla_dump: the directory XLA_FLAGS=--xla_dump_to
    names (`xla_dump_env`), for the collectives XLA kept and the values alive at its peak; None: both
    from what can be read without it."""
    from titan_tpu.components.program import capture_rank
    from titan_tpu.graph.jax_devices import slices_of_replicas
    from titan_tpu.plan.xla_compare import formula_as_xla_counts
    from titan_tpu.run.resolved import Target
    from titan_tpu.xla.numbers import compile_program, hlo_collectives, pallas_kernels

    platform, devices, hardware = _target(cfg, topology_name)
    slices = cfg.parallelism.slices
    start = time.perf_counter()
    run, steps, example = capture_rank(cfg, Target.for_jax(platform, len(devices)), hardware=hardware)
    capture_s = time.perf_counter() - start
    programs = {name: compile_program(step, devices, program=name, xla_dump=xla_dump, time_estimate=time_estimate,
                                       dump=None if dump is None else dump if len(steps) == 1 else dump / name)
                for name, step in steps.items()}
    first = next(iter(steps.values()))
    peak_name = max(programs, key=lambda name: programs[name]["peak"])
    peak = programs[peak_name]
    hbm = hardware.memory_bytes if hardware is not None else None
    flops_per_token = _formula_flops_per_token(run, images=getattr(example, "images", None))
    runs = {"step": 1, "micro-batch": run.grad_accum_steps, "update": 1}
    flops = sum(runs[name] * (p["flops"] or 0.0) for name, p in programs.items()) if peak["flops"] is not None \
        else None
    tokens_per_chip = run.step_tokens / len(devices)
    report = {
        "topology": topology_name, "platform": platform, "devices": len(devices), "mesh": dict(first.axis_sizes),
        # several slices: `topology` is each one's; the slice of each dp_replicate index (slices_of_replicas)
        **({"slices": slices, "slice_of_dp_replicate": slices_of_replicas(first, devices)} if slices > 1 else {}),
        # what a run of the JAX path on this target logs for each program it hands XLA (graph/fingerprint.py)
        "fingerprints": {name: p["fingerprint"] for name, p in programs.items()},
        "reshard_after_forward": run.reshard_after_forward, "reshard_why": run.reshard.why,
        "documents": run.documents, "grad_accum_steps": run.grad_accum_steps,
        "memory_per_chip_bytes": peak["memory"], "peak_per_chip_bytes": peak["peak"], "peak_program": peak_name,
        "programs": {name: {k: v for k, v in p.items() if k not in ("text", "lowered_text")}
                     for name, p in programs.items()},
        "hbm_per_chip_bytes": hbm, "fits": None if hbm is None else peak["peak"] <= hbm,
        "flops_per_chip": flops,
        # the dots and convolutions of XLA's optimized program (xla/dump.py matmul_flops): what our
        # formula counts; cost analysis's total also counts every elementwise op
        "xla_matmul_flops_per_chip": sum(runs[name] * p["matmul_flops"] for name, p in programs.items())
        if all(p["matmul_flops"] is not None for p in programs.values()) else None,
        "bytes_accessed_per_chip": sum(runs[name] * (p["bytes_accessed"] or 0.0) for name, p in programs.items()),
        # XLA's TPU cost model's time for a step (cost analysis's optimal_seconds, summed as the step
        # runs its programs); like its FLOPs, a scanned layer loop's body counts once. None off a TPU.
        "xla_optimal_seconds_per_step": _per_step(programs, runs, "optimal_seconds"),
        # the same with each loop counted as many times as it runs (xla/numbers.py time_as_run)
        "xla_optimal_seconds_per_step_as_run": _per_step(programs, runs, "optimal_seconds_as_run"),
        "xla_matmul_flops_per_chip_as_run": _per_step(programs, runs, "matmul_flops_as_run"),
        "runs_per_step": {name: runs[name] for name in programs},
        "tokens_per_chip": tokens_per_chip,
        "formula_flops_per_chip": flops_per_token * tokens_per_chip,
        "formula_as_xla_counts_per_chip": formula_as_xla_counts(cfg, run.kernel_notes, tokens_per_chip,
                                                                schedule=run.pipeline, topology=topology_name),
        # XLA's cost analysis counts a while loop's body once, not once per trip (a lax.scan of 8
        # matmuls reports the FLOPs of 1): with scanned layers its FLOPs are the step outside the
        # layers plus one layer's forward and backward.
        "loop_body_counted_once": bool(cfg.model.scan_layers),
        "collectives": hlo_collectives(peak["text"]), "collectives_counted_in": peak["collectives_from"],
        "f8_dots": sum(p["f8_dots"] for p in programs.values()),
        "kernels": run.kernel_notes, "tpu_kernels": pallas_kernels(peak["lowered_text"]), "at_peak": peak["at_peak"],
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


def estimate_time_for_tpu(cfg, topology_name: str, report: dict, xla_dump: Path) -> dict:
    """`report` (`compile_step_for_tpu`'s, compiled with time_estimate False) with XLA's time estimate
    as the step runs added (xla/numbers.py `time_as_run`: a second compile of each looping program
    with two scan steps a trip): the estimate alone, for a pass after the compiles. The step is
    captured and lowered again, and must be the program the report certifies."""
    from titan_tpu.components.program import capture_rank
    from titan_tpu.graph.jax_program import jax_mesh, lower_step
    from titan_tpu.run.resolved import Target
    from titan_tpu.xla.numbers import time_as_run

    platform, devices, hardware = _target(cfg, topology_name)
    _run, steps, _example = capture_rank(cfg, Target.for_jax(platform, len(devices)), hardware=hardware)
    for name, step in steps.items():
        program, mesh = report["programs"][name], jax_mesh(step, devices)
        today = lower_step(step, mesh, name).fingerprint
        if today != program["fingerprint"]:
            raise ValueError(f"the {name} program today ({today}) is not the one the report certifies "
                             f"({program['fingerprint']}): recompile it")
        program.update(time_as_run(step, mesh, name, program, scratch=xla_dump / name))
    report["xla_optimal_seconds_per_step_as_run"] = _per_step(report["programs"], report["runs_per_step"],
                                                              "optimal_seconds_as_run")
    return report


def _per_step(programs: dict, runs: dict, key: str) -> float | None:
    """A per-program number summed as the step runs its programs (the micro-batch program once per
    micro-batch); None where a program lacks it."""
    values = [p.get(key) for p in programs.values()]
    return None if None in values else sum(runs[name] * p[key] for name, p in programs.items())


def _formula_flops_per_token(run, *, images=None) -> float:
    """Our FLOPs per trained token of the step (components/program.py `flops_per_token`, the frozen
    reference's forwards too): a native model's from its args; an HF directory's counted on its model
    built on the meta device (no memory) and converted as the run's is (LoRA's frozen base does no
    weight-gradient work), a vision-language model's `images` as the batch the step was captured
    with holds them (its real tensors: the captured inputs are fake ones, which the meta copy cannot
    take)."""
    from titan_tpu.components.program import flops_per_token
    from titan_tpu.models.converters import enabled_converters
    from titan_tpu.models.lora import freeze_base
    from titan_tpu.parallel.mesh import ParallelDims

    model = None
    if run.spec.kind == "hf":
        model = run.spec.build_on_meta(run.cfg, mesh=None, parallel_dims=ParallelDims(world_size=1), documents=False)
        for converter in enabled_converters(run.cfg):
            converter.convert(model, run.cfg)
        if run.cfg.lora.enabled:
            freeze_base(model)  # what the run's LoRA converter does after initialising the adapters
    return flops_per_token(run, model, images=images)[0]


def _format(report: dict) -> str:
    from titan_tpu.plan.xla_compare import compared_flops

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
             f"  the run's resolution: re-shard after forward {str(report['reshard_after_forward']).lower()} "
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
    as_run, once = report.get("xla_optimal_seconds_per_step_as_run"), report.get("xla_optimal_seconds_per_step")
    if once is not None and once < 0:
        lines.append("  XLA's own time estimate: none (its cost model gives a negative time for this target)")
    elif as_run is not None:
        lines.append(f"  XLA's own time estimate {as_run:.3f} s per step (its cost model's optimal_seconds"
                     + (f"; {once:.3f} s as it counts, each loop's body once, scaled by the program's matmul "
                        "FLOPs as it runs them)" if as_run != once else ")"))
    elif once is not None:
        lines.append(f"  XLA's own time estimate {once:.3f} s per step (its cost model's optimal_seconds; a loop's "
                     "body counted once)")
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
