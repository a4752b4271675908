"""XLA's TPU compiler against the planner, per TPU recipe: the rows of docs/tpu.md's table.

For each recipe (default: every configs/*_tpu.toml), on the slice its `job.description` names,
`titan-tpu compile`'s core (tools/compile_cmd.py) compiles the captured step for that topology
with libtpu's compile-only client on this CPU, and the planner (plan/planner.py) plans the same
config. The step is captured on fake tensors (no weights, no optimizer state: tools/device_step.py)
and compiled from shapes alone, so real sizes need little memory here. Printed per recipe: the
capture + compile time here and this process's peak resident memory, XLA's per-chip peak
(arguments + outputs - aliased + temporaries + code), the planner's peak, XLA's FLOPs per chip,
our FLOP formula's (model FLOPs) and the planner's executed FLOPs per chip (the model FLOPs plus
recomputed forwards), with the ratios. All XLA numbers are the compiler's own (compile-only, no
TPU run). Needs .venv-tpu (jax + libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py                 # every TPU recipe
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py configs/llama3_8b_tpu.toml
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py configs/llama3_405b_tpu.toml \
        --topology v5p:4x4x4 --override=--parallelism.dp_shard=64   # a smaller slice than the recipe's

Each recipe runs in its own process, one at a time (a fake process group per capture; a recipe
that fails or runs past --timeout does not stop the others).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

GiB = 1024**3
# A compile-only libtpu client takes no device: let it load beside another process's (libtpu's
# lockfile otherwise refuses); keep torch-tpu from looking for a TPU.
ENV = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1"}


def one(recipe: str, overrides: list[str], topology: str | None) -> dict:
    import resource
    import time

    from titan_tpu.config import build_config
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.plan.planner import default_hardware, plan_config
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu, topology_for_chips

    cfg = build_config(recipe, overrides)
    hardware, chips = default_hardware(cfg, measure=False)
    if topology is not None:  # a smaller slice than the recipe names: the planner plans that one
        hardware = HARDWARE[topology.split(":")[0].replace("tpu7x", "v7")]
        chips = 1
        for d in topology.split(":")[1].split("x"):
            chips *= int(d)
    topology = topology or topology_for_chips(hardware.name, chips)
    start = time.perf_counter()
    report = compile_step_for_tpu(cfg, topology)
    report["total_seconds"] = time.perf_counter() - start
    report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plan = plan_config(cfg, hardware, chips=chips, measure=False)
    report["plan_peak_bytes"] = plan.peak_bytes
    report["plan_flops_per_chip"] = plan.flops["executed_per_step_per_device"]
    report["plan_memory"] = {k: v for k, v in plan.memory.items() if isinstance(v, (int, float))}
    return report


HEADER = ("| recipe | slice compiled | capture + compile here (peak memory here) | XLA peak per chip | planner peak "
          "| XLA FLOPs per chip (as XLA counts) | our formula counted so | planner executed FLOPs (whole step) |"
          "\n|---|---|---|---|---|---|---|---|")


def refreshed(report: dict) -> dict:
    """A saved report with today's planner beside it (its peak and executed FLOPs planned again:
    the planner may have changed since the compile) and our formula counted as XLA counts, computed
    from its config and kernels where the compile predates that field (tools/compile_cmd.py)."""
    from titan_tpu.config import build_config
    from titan_tpu.models.spec import model_spec
    from titan_tpu.plan.hardware import HARDWARE
    from titan_tpu.plan.planner import plan_config
    from titan_tpu.tools.compile_cmd import _formula_as_xla_counts

    recipe, *overrides = report["config"].split()
    cfg = build_config(recipe, [o.removeprefix("--override=") for o in overrides])
    plan = plan_config(cfg, HARDWARE[report["topology"].split(":")[0].replace("tpu7x", "v7")],
                       chips=report["devices"], measure=False)
    report = {**report, "plan_peak_bytes": plan.peak_bytes,
              "plan_flops_per_chip": plan.flops["executed_per_step_per_device"]}
    if report.get("formula_as_xla_counts_per_chip") is None:
        per_token, _ = model_spec(cfg.model).flops_per_token(None, cfg.training.seq_len)
        tokens_per_chip = report["formula_flops_per_chip"] / per_token
        report["formula_as_xla_counts_per_chip"] = _formula_as_xla_counts(cfg, report["kernels"], tokens_per_chip)
    return report


def row(recipe: str, r: dict) -> str:
    xla_peak, plan_peak = r["peak_per_chip_bytes"], r["plan_peak_bytes"]
    xla_flops, plan_flops, counted = r["flops_per_chip"], r["plan_flops_per_chip"], r["formula_as_xla_counts_per_chip"]
    once = " (loop bodies once)" if r.get("loop_body_counted_once") else ""
    rss = f" ({r['max_rss_bytes'] / GiB:.1f} GiB)" if r.get("max_rss_bytes") else ""
    return (f"| {recipe} | {r['topology']} ({r['devices']} chips) | {r['capture_seconds']:.0f} + "
            f"{r['compile_seconds']:.0f} s{rss} | {xla_peak / GiB:.1f} GiB | "
            f"{plan_peak / GiB:.1f} GiB ({plan_peak / xla_peak:.2f}x) | {xla_flops:.3e}{once} | "
            f"{counted:.3e} ({counted / xla_flops:.3f}x) | {plan_flops:.3e} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="TOML recipes (default: configs/*_tpu.toml)")
    parser.add_argument("--override", action="append", default=[], help="a config override for every recipe")
    parser.add_argument("--topology", help="compile every recipe for this slice instead of the one it names "
                        "(give the matching --override=--parallelism.dp_shard=N)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per recipe (default 3600)")
    parser.add_argument("--json-dir", help="also write each recipe's report there (plan --xla reads them)")
    parser.add_argument("--from-json", metavar="DIR", help="print the table of the reports --json-dir wrote, "
                        "compiling nothing")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.from_json:
        print(HEADER)
        for path in sorted(glob.glob(os.path.join(args.from_json, "*.json"))):
            with open(path) as f:
                report = json.load(f)
            print(row(report["config"].split()[0], refreshed(report)))
        return
    if args.one:
        print(json.dumps(one(args.recipes[0], args.override, args.topology)))
        return
    print(HEADER)
    for recipe in args.recipes or sorted(glob.glob("configs/*_tpu.toml")):
        command = [sys.executable, __file__, recipe, "--one", *(f"--override={o}" for o in args.override),
                   *(["--topology", args.topology] if args.topology else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"| {recipe} | stopped after {args.timeout:.0f} s |||||||", flush=True)
            continue
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "Error:" in line] or done.stderr.splitlines()
            print(f"| {recipe} | failed: {(errors or ['(no output)'])[-1].strip()[:300]} |||||||", flush=True)
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        if args.json_dir:
            os.makedirs(args.json_dir, exist_ok=True)
            name = os.path.basename(recipe).removesuffix(".toml")
            with open(os.path.join(args.json_dir, f"{name}.json"), "w") as f:
                json.dump({**report, "config": " ".join([recipe, *args.override])}, f, indent=2)
        print(row(recipe, report), flush=True)


if __name__ == "__main__":
    main()
