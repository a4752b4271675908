"""The fingerprint of every TPU recipe's program, lowered as `titan-tpu compile` lowers it but not
compiled: a refactor of the run's assembly, capture or lowering must leave each one unchanged.

A fingerprint (graph/fingerprint.py) is the hash of the StableHLO handed to XLA, so it is fixed
before XLA's compile starts; this stops there (seconds a recipe, where XLA's compile takes minutes).
`titan-tpu compile`'s own path runs (tools/compile_cmd.py `compile_step_for_tpu`), with its XLA
compile replaced by the lowering alone. Each recipe in its own process (one fake process group per
capture), one at a time. Needs .venv-tpu (jax + libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/recipe_fingerprints.py --out before.json     # the old code
    PYTHONPATH=$PWD .venv-tpu/bin/python bench/recipe_fingerprints.py --compare before.json # the new code
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: step_parity's write_or_compare
ENV = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TPU_SKIP_MDS_QUERY": "1"}


def _lower_only(step, devices, *, program: str, dump=None, xla_dump=None) -> dict:
    """`compile_program` up to the lowering: the fingerprint, and neutral numbers for the rest."""
    from titan_tpu.graph.jax_program import jax_mesh, lower_step

    lowered = lower_step(step, jax_mesh(step, devices), program)
    return {"memory": {"arguments": 0, "outputs": 0, "aliased": 0, "temporaries": 0, "code": 0}, "peak": 0,
            "fingerprint": lowered.fingerprint, "flops": None, "matmul_flops": None, "bytes_accessed": None,
            "lower_seconds": lowered.lower_seconds, "compile_seconds": 0.0, "cpu_seconds": 0.0, "operations": 0,
            "f8_dots": 0, "at_peak": [], "xla_stages": {}, "text": "", "lowered_text": lowered.text,
            "collectives_from": "StableHLO, before XLA's passes"}


def one(recipe: str) -> dict[str, str]:
    """{program: fingerprint} of the recipe's step on the slice it names."""
    from titan_tpu.config import build_config
    from titan_tpu.plan.topology import recipe_topology
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu
    from titan_tpu.tools.hf_shape_dir import ensure

    try:
        import titan_tpu.xla.numbers as xla_numbers
        from titan_tpu.run.setup import prepare_run
    except ImportError:  # the code before the run's resolution (titan_tpu/run/) and the XLA readers (xla/) moved
        import titan_tpu.tools.xla_numbers as xla_numbers
        from titan_tpu.run_setup import prepare_run

    xla_numbers.compile_program = _lower_only
    cfg = build_config(recipe, [])
    ensure(cfg.model.hf_config, log=lambda message: print(message, file=sys.stderr))
    cfg = prepare_run(cfg).cfg
    report = compile_step_for_tpu(cfg, recipe_topology(cfg))
    return report["fingerprints"]


def main(argv: list[str] | None = None) -> int:
    from step_parity import write_or_compare

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipes", nargs="*", help="default: every configs/*_tpu.toml")
    parser.add_argument("--out", help="write {recipe: {program: fingerprint}} here")
    parser.add_argument("--compare", help="fail naming each recipe whose fingerprints differ from this file's")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one recipe, JSON on stdout
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per recipe (900)")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    recipes = args.recipes or sorted(glob.glob(str(ROOT / "configs" / "*_tpu.toml")))
    found: dict[str, dict | str] = {}
    for recipe in recipes:
        name = Path(recipe).stem
        try:
            done = subprocess.run([sys.executable, __file__, "--one", recipe], capture_output=True, text=True,
                                  env=ENV, timeout=args.timeout)
            last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            found[name] = json.loads(last) if done.returncode == 0 and last.startswith("{") else \
                "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        except subprocess.TimeoutExpired:
            found[name] = f"failed: ran past {args.timeout:.0f} s"
        print(f"{name}: {found[name]}", flush=True)
    return write_or_compare(found, out=args.out, compare=args.compare, same="fingerprints identical")


if __name__ == "__main__":
    sys.exit(main())
