"""Re-check the compile reports against today's code: each recipe's programs captured and lowered
again (no XLA compile) and their fingerprints held against the ones its report certifies.

A compile report (bench/results/xla/<recipe>.json) certifies a program: the StableHLO our lowering
handed XLA, named by its fingerprint (graph/fingerprint.py). Any change to capture, lowering,
parallelism or the recipe can change that program, and only its fingerprint tells: this re-lowers
every recipe as `titan-tpu compile` would (tools/compile_cmd.py `fingerprints_for_tpu`: the same
resolution, assembly and lowering, stopping before XLA's compile, a few seconds a recipe where the
compile takes a minute) and names the recipes whose fingerprints moved. `make tpu-check` runs it
(tests/tpu/test_recipe_fingerprints.py) and `python -m titan_tpu.tools.recipe_table` marks those
recipes stale on docs/tpu_recipes.md. Each recipe is captured in a process of its own (a fake
process group per capture, as bench/tpu_compile_table.py compiles them). Needs JAX:

    .venv-tpu/bin/python -m titan_tpu.tools.recheck                 # every compiled recipe
    .venv-tpu/bin/python -m titan_tpu.tools.recheck configs/llama3_8b_tpu.toml --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["ENV", "moved_recipes", "recheck", "recipe_target"]

ROOT = Path(__file__).resolve().parents[2]
# A compile-only libtpu client takes no device: let it load beside another process's (libtpu's
# lockfile otherwise refuses); keep torch-tpu from looking for a TPU.
ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1"}


def recipe_target(recipe: str, overrides: list[str] = ()) -> tuple[object, str]:
    """(the recipe's config as its run resolves it, the slice its job.description names): what
    bench/tpu_compile_table.py compiles and this re-lowers. A Transformers-backend recipe's model
    directory is its weightless stand-in (tools/hf_shape_dir.py), written when missing."""
    from titan_tpu.config import build_config
    from titan_tpu.plan.topology import recipe_topology
    from titan_tpu.run.setup import prepare_run
    from titan_tpu.tools.hf_shape_dir import ensure

    cfg = build_config(recipe, list(overrides))
    ensure(cfg.model.hf_config, log=lambda message: print(message, file=sys.stderr))
    cfg = prepare_run(cfg).cfg
    return cfg, recipe_topology(cfg)


def _one(recipe: str) -> dict[str, str]:
    """This process's recipe, captured and lowered: its programs' fingerprints."""
    from titan_tpu.tools.compile_cmd import fingerprints_for_tpu

    cfg, topology = recipe_target(recipe)
    return fingerprints_for_tpu(cfg, topology)


def _lowered(recipe: str, timeout: float) -> tuple[dict[str, str] | None, str, float]:
    """(fingerprints or None, the child's error line, seconds) of one recipe in a process of its own."""
    from titan_tpu.tools.compile_cmd import child_error_line

    start = time.perf_counter()
    command = [sys.executable, "-m", "titan_tpu.tools.recheck", recipe, "--one"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ENV}, cwd=ROOT,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"stopped after {timeout:.0f} s", time.perf_counter() - start
    if done.returncode != 0:
        return None, child_error_line(done.stderr), time.perf_counter() - start
    return json.loads(done.stdout.strip().splitlines()[-1]), "", time.perf_counter() - start


def recheck(recipes: list[str] | None = None, *, reports: Path | None = None, workers: int = 2,
            timeout: float = 900, log=print) -> dict[str, dict]:
    """Each compiled recipe (default: every report in `reports` that compiled) re-lowered: recipe ->
    {"certified": the report's fingerprints, "today": today's (None where the lowering failed),
    "error": why it failed, "seconds": the re-lowering's time here}. Two recipes at a time: the
    capture is single-threaded Python."""
    from titan_tpu.tools.recipe_table import REPORTS

    reports = reports or REPORTS
    if recipes is None:
        recipes = sorted(f"configs/{path.stem}.toml" for path in reports.glob("*.json")
                         if "error" not in json.loads(path.read_text()) and (ROOT / "configs" / f"{path.stem}.toml")
                         .is_file())
    certified = {recipe: json.loads((reports / f"{Path(recipe).stem}.json").read_text()).get("fingerprints", {})
                 for recipe in recipes}
    results = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for recipe, (today, error, seconds) in zip(recipes, pool.map(lambda r: _lowered(r, timeout), recipes)):
            results[recipe] = {"certified": certified[recipe], "today": today, "error": error, "seconds": seconds}
            log(_line(recipe, results[recipe]))
    return results


def moved_recipes(results: dict[str, dict]) -> dict[str, str]:
    """recipe -> what moved (e.g. "step 26e95b36 -> 5c0d2a1e"), for the recipes whose certificate no
    longer names what today's code builds, or whose lowering failed."""
    moved = {}
    for recipe, result in results.items():
        if result["today"] is None:
            moved[recipe] = f"it no longer lowers: {result['error']}"
        elif result["today"] != result["certified"]:
            names = sorted(set(result["today"]) | set(result["certified"]))
            moved[recipe] = ", ".join(f"{name} {result['certified'].get(name, 'none')} -> "
                                      f"{result['today'].get(name, 'none')}" for name in names
                                      if result["today"].get(name) != result["certified"].get(name))
    return moved


def _line(recipe: str, result: dict) -> str:
    moved = moved_recipes({recipe: result})
    verdict = f"MOVED: {moved[recipe]}" if moved else "same program: " + ", ".join(
        f"{name} {fp}" for name, fp in result["today"].items())
    return f"{recipe}: {verdict} ({result['seconds']:.0f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", help="TOML recipes (default: every recipe with a compile report)")
    parser.add_argument("--json", action="store_true", help="print {moved: {recipe: what moved}, results} as one "
                        "JSON object at the end")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one:
        try:
            print(json.dumps(_one(args.recipes[0])))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        return
    start = time.perf_counter()
    results = recheck(args.recipes or None, log=lambda line: print(line, file=sys.stderr, flush=True))
    moved = moved_recipes(results)
    print(f"{len(results) - len(moved)} of {len(results)} certificates name today's programs "
          f"({time.perf_counter() - start:.0f} s)" + (f"; stale: {', '.join(moved)}: recompile them with "
                                                     "bench/tpu_compile_table.py" if moved else ""), file=sys.stderr)
    if args.json:
        print(json.dumps({"moved": moved, "results": results}))
    sys.exit(1 if moved else 0)


if __name__ == "__main__":
    main()
