"""Every TPU recipe compiled by XLA's TPU compiler, as the trainer would run it; the reports the
recipe table (docs/tpu_recipes.md) is generated from.

For each recipe (default: every configs/*_tpu.toml), on the slice its `job.description` names,
`titan-tpu compile`'s core (tools/compile_cmd.py) captures the step as the trainer builds it there
(re-shard decision, documents, accumulation, kernels, scan, checkpointing, dispatch) and compiles
it with libtpu's compile-only client on this CPU. Each recipe runs in its own process, one at a
time (a fake process group per capture; a recipe that fails or runs past --timeout does not stop
the others), and its report is written to --reports (default bench/results/xla/<recipe>.json) with
where it was made: the date, this CPU, the libtpu and JAX versions, the commit, and a hash of the
recipe file (tests/test_tpu_recipes.py fails when a recipe changed after its compile). A recipe of
a Transformers-backend model names a weightless stand-in of its directory as model.hf_config
(tools/hf_shape_dir.py), written here when missing. Printed per
recipe: the time of each stage here (capture, lowering, XLA's compile) and this process's peak
memory, XLA's per-chip peak beside the planner's, the FLOPs beside our formula's. All XLA numbers
are the compiler's own (compile-only, no TPU ran). Needs .venv-tpu (jax + libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py              # every TPU recipe
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py configs/llama3_8b_tpu.toml
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py --heldout  # the planner's held-out set
    .venv/bin/python -m titan_tpu.tools.recipe_table                              # docs/tpu_recipes.md

The table is rendered from the reports and today's planner by titan_tpu/tools/recipe_table.py
(no JAX needed), which the suite checks for staleness.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

from titan_tpu.tools.recheck import ENV  # what a compile-only libtpu client needs of its environment

GiB = 1024**3


def one(recipe: str, overrides: list[str], topology: str | None, dumps: str | None, time_estimate: bool = True,
        report_path: str | None = None) -> dict:
    import resource
    import shutil
    import time

    from titan_tpu.tools.compile_cmd import compile_step_for_tpu
    from titan_tpu.tools.recheck import recipe_target
    from titan_tpu.tools.recipe_table import provenance
    from titan_tpu.xla.numbers import xla_dump_env

    # Before JAX starts: the report reads XLA's dump (kept in dumps/<recipe> when asked, for a look at
    # what XLA holds at its peak: titan_tpu.xla.dump.py).
    kept = os.path.join(dumps, os.path.basename(recipe).removesuffix(".toml")) if dumps else None
    xla_dump = xla_dump_env(kept)
    cfg, named = recipe_target(recipe, overrides)  # the slice the recipe names (one of its parallelism.slices)
    topology = topology or named
    start = time.perf_counter()
    if report_path:  # --time-only: the report's time estimate alone, its program checked
        from titan_tpu.tools.compile_cmd import estimate_time_for_tpu

        with open(report_path) as f:
            report = json.load(f)
        try:
            report = estimate_time_for_tpu(cfg, topology, report, xla_dump)
        finally:
            shutil.rmtree(xla_dump, ignore_errors=True)
        report["time_estimate_seconds"] = time.perf_counter() - start
        return report
    try:
        report = compile_step_for_tpu(cfg, topology, xla_dump=xla_dump, time_estimate=time_estimate)
    finally:
        if not kept:
            shutil.rmtree(xla_dump, ignore_errors=True)
    report["total_seconds"] = time.perf_counter() - start
    report["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["config"] = " ".join([recipe, *overrides])
    report.update(provenance(recipe))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="TOML recipes (default: configs/*_tpu.toml)")
    parser.add_argument("--override", action="append", default=[], help="a config override for every recipe")
    parser.add_argument("--topology", help="compile every recipe for this slice instead of the one it names "
                        "(give the matching --override=--parallelism.dp_shard=N); reports are then not written "
                        "to the recipe table's directory unless --reports names it")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per recipe (default 3600)")
    parser.add_argument("--reports", help="directory for the reports (default bench/results/xla; with --topology "
                        "or --override, none unless given)")
    parser.add_argument("--dumps", help="keep XLA's dump of each recipe in DIR/<recipe> (buffer assignment, live "
                        "ranges: python -m titan_tpu.xla.dump DIR/<recipe> prints its peak's values)")
    parser.add_argument("--heldout", action="store_true", help="compile the planner's held-out set "
                        "(bench/planner_heldout.toml; recipes then names its rows) into bench/results/xla_heldout")
    parser.add_argument("--no-time-estimate", action="store_true", help="skip XLA's time estimate as the step "
                        "runs (a second compile of each looping program); add it later with --time-only")
    parser.add_argument("--time-only", action="store_true", help="add XLA's time estimate to the saved reports "
                        "that lack it, their programs checked against today's")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--report", help=argparse.SUPPRESS)  # the child process of --time-only: the saved report
    args = parser.parse_args()
    if args.one:
        try:
            print(json.dumps(one(args.recipes[0], args.override, args.topology, args.dumps,
                                 time_estimate=not args.no_time_estimate, report_path=args.report)))
        except ValueError as e:  # a refusal or XLA's rejection: one line for the parent
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    from titan_tpu.tools.compile_cmd import child_error_line
    from titan_tpu.tools.recipe_table import HELDOUT_REPORTS, REPORTS, heldout_rows, provenance, stage_line

    if args.heldout:  # the planner's held-out set: (name, recipe, its overrides) per row
        jobs = [(row["name"], row["recipe"], [*row["overrides"], *args.override]) for row in heldout_rows()
                if not args.recipes or row["name"] in args.recipes]
        reports = args.reports or str(HELDOUT_REPORTS)
    else:
        jobs = [(os.path.basename(recipe).removesuffix(".toml"), recipe, args.override)
                for recipe in args.recipes or sorted(glob.glob("configs/*_tpu.toml"))]
        reports = args.reports or (None if args.topology or args.override else str(REPORTS))
    for name, recipe, overrides in jobs:
        saved = os.path.join(reports or "", f"{name}.json")
        if args.time_only:
            if not reports or not os.path.exists(saved):
                continue
            with open(saved) as f:
                kept = json.load(f)
            if "error" in kept or all(program.get("as_run_method") for program in kept["programs"].values()):
                continue  # failed, or estimated (or found to have no estimate) already
        command = [sys.executable, __file__, recipe, "--one", *(f"--override={o}" for o in overrides),
                   *(["--no-time-estimate"] if args.no_time_estimate else []),
                   *(["--report", saved] if args.time_only else []),
                   *(["--topology", args.topology] if args.topology else []),
                   *(["--dumps", os.path.abspath(args.dumps)] if args.dumps else [])]
        try:
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ENV},
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            done = None
        if args.time_only and (done is None or done.returncode != 0):  # the report stays as it was
            reason = f"stopped after {args.timeout:.0f} s" if done is None else child_error_line(done.stderr)
            print(f"{name}: time estimate failed: {reason}", flush=True)
            continue
        if done is None or done.returncode != 0:
            reason = f"stopped after {args.timeout:.0f} s" if done is None else child_error_line(done.stderr)
            print(f"{name}: failed: {reason}", flush=True)
            # the table says why it has no numbers
            report = {"error": reason, "config": " ".join([recipe, *overrides]), **provenance(recipe)}
        else:
            report = json.loads(done.stdout.strip().splitlines()[-1])
        if reports:
            os.makedirs(reports, exist_ok=True)
            with open(os.path.join(reports, f"{name}.json"), "w") as f:
                json.dump(report, f, indent=1)
        if args.time_only:
            seconds = report["xla_optimal_seconds_per_step_as_run"]
            estimate = "none (a negative time from XLA's cost model)" if seconds is None else f"{seconds:.3f} s"
            print(f"{name}: XLA's estimate as run {estimate} ({report['time_estimate_seconds']:.0f} s here)",
                  flush=True)
        elif "error" not in report:
            print(stage_line(name, report), flush=True)


if __name__ == "__main__":
    main()
