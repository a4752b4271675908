"""XLA's TPU compiler against the planner, per TPU recipe: the rows of docs/tpu.md's table.

For each recipe (default: every configs/*_tpu.toml), on the slice its `job.description` names,
`titan-tpu compile`'s core (tools/compile_cmd.py) compiles the captured step for that topology
with libtpu's compile-only client on this CPU, and the planner (plan/planner.py) plans the same
config. Printed per recipe: the compile time here, XLA's per-chip peak (arguments + outputs -
aliased + temporaries + code), the planner's peak, XLA's FLOPs per chip and the planner's
executed FLOPs per chip (the model FLOPs plus recomputed forwards), with the ratios. Needs
.venv-tpu (jax + libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py configs/llama3_8b_tpu.toml
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py configs/llama3_8b_tpu.toml \
        --override=--model.n_layers=2      # a shallower model where the full one compiles too long here

Each recipe runs in its own process (a fake process group per capture; a recipe that fails does
not stop the others).
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


def one(recipe: str, overrides: list[str]) -> dict:
    import time

    from titan_tpu.config import build_config
    from titan_tpu.plan.planner import default_hardware, plan_config
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu, topology_for_chips

    cfg = build_config(recipe, overrides)
    hardware, chips = default_hardware(cfg, measure=False)
    topology = topology_for_chips(hardware.name, chips)
    start = time.perf_counter()
    report = compile_step_for_tpu(cfg, topology)
    report["total_seconds"] = time.perf_counter() - start
    with plan_config(cfg, hardware, chips=chips, measure=False) as plan:
        report["plan_peak_bytes"] = plan.peak_bytes
        report["plan_flops_per_chip"] = plan.flops["executed_per_step_per_device"]
    return report


def row(recipe: str, r: dict) -> str:
    xla_peak, plan_peak = r["peak_per_chip_bytes"], r["plan_peak_bytes"]
    xla_flops, plan_flops = r["flops_per_chip"], r["plan_flops_per_chip"]
    return (f"| {recipe} | {r['topology']} | {r['total_seconds']:.0f} s | {xla_peak / GiB:.1f} GiB | "
            f"{plan_peak / GiB:.1f} GiB ({plan_peak / xla_peak:.2f}x) | {xla_flops:.3e} | "
            f"{plan_flops:.3e} ({plan_flops / xla_flops:.3f}x) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="TOML recipes (default: configs/*_tpu.toml)")
    parser.add_argument("--override", action="append", default=[], help="a config override for every recipe")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.recipes[0], args.override)))
        return
    print("| recipe | topology | compile here | XLA peak/chip | planner peak | XLA FLOPs/chip | planner FLOPs/chip |")
    print("|---|---|---|---|---|---|---|")
    for recipe in args.recipes or sorted(glob.glob("configs/*_tpu.toml")):
        command = [sys.executable, __file__, recipe, "--one", *(f"--override={o}" for o in args.override)]
        done = subprocess.run(command, capture_output=True, text=True, env=ENV)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"| {recipe} | failed: {last[:200]} |||||")
            continue
        print(row(recipe, json.loads(done.stdout.strip().splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
