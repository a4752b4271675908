"""What one program for every cp rank costs in XLA's numbers: the compiled step as `titan-tpu
compile` builds it (cp's rank the mesh axis index, every chunk against all keys, splash's kernel per
chunk place picked by lax.switch) beside rank 0's program (the trainer's form: each chunk against
the keys up to its end, the offsets rank 0's numbers, run on every chip), compiled for the same
topology in the same process. Compile-only (libtpu's client on this CPU): XLA's per-chip memory
by kind, its peak, FLOPs and bytes accessed, and the ratio of each. Needs .venv-tpu:

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/cp_one_program.py \\
        --config configs/llama3_8b_128k_cp_tpu.toml --topology v5p:2x2x2 \\
        --training.seq_len 8192 --parallelism.dp_shard 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

GiB = 1024**3


def compile_both(config: str, topology: str, overrides: list[str]) -> dict[str, dict]:
    from titan_tpu import tracing
    from titan_tpu.config import build_config
    from titan_tpu.run.setup import prepare_run
    from titan_tpu.tools.compile_cmd import compile_step_for_tpu

    cfg = prepare_run(build_config(config, overrides)).cfg
    reports = {"one program": compile_step_for_tpu(cfg, topology)}
    saved = tracing.one_program_for_every_rank
    tracing.one_program_for_every_rank = contextlib.nullcontext  # capture as the trainer does, as rank 0
    try:
        reports["rank 0's program"] = compile_step_for_tpu(cfg, topology)
    finally:
        tracing.one_program_for_every_rank = saved
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--topology", required=True)
    parser.add_argument("--json", help="write both reports here")
    args, overrides = parser.parse_known_args()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    reports = compile_both(args.config, args.topology, overrides)
    one, rank0 = reports["one program"], reports["rank 0's program"]
    print(f"{args.config} {' '.join(overrides)} on {args.topology} (mesh {one['mesh']}), XLA's numbers per chip:")
    rows = [(f"memory {kind} GiB", one["memory_per_chip_bytes"][kind] / GiB, rank0["memory_per_chip_bytes"][kind] / GiB)
            for kind in one["memory_per_chip_bytes"]]
    rows += [("peak GiB", one["peak_per_chip_bytes"] / GiB, rank0["peak_per_chip_bytes"] / GiB),
             ("FLOPs", one["flops_per_chip"], rank0["flops_per_chip"]),
             ("bytes accessed GiB", one["bytes_accessed_per_chip"] / GiB, rank0["bytes_accessed_per_chip"] / GiB),
             ("compile s (loose)", one["compile_seconds"], rank0["compile_seconds"])]
    print(f"  {'':<24} {'one program':>14} {'rank 0':>14} {'ratio':>7}")
    for name, a, b in rows:
        print(f"  {name:<24} {a:>14.4g} {b:>14.4g} {a / b if b else float('nan'):>7.3f}")
    print("  Pallas kernels, one program: " + ", ".join(f"{k} {v}" for k, v in one["tpu_kernels"].items()))
    print("  Pallas kernels, rank 0:      " + ", ".join(f"{k} {v}" for k, v in rank0["tpu_kernels"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
