"""TorchTPU's own lowering of the captured step against ours, both compiled by XLA's TPU compiler.

The step of a config for a TPU slice (rank 0 of one rank per chip, as `titan-tpu compile` captures
it) is lowered by TorchTPU in a child process with torch-tpu loaded (tools/torchtpu_lowering.py),
the two ways TorchTPU can run it:

* split: torch-tpu 0.2.0's Dynamo backend as it is: a program for each piece between two
  collectives and one for each collective, nothing donated;
* one program: as the trainer calls TorchTPU (graph/torchtpu.py): every node SPMD-safe, the
  collectives inside, the parameters and moments donated;

and by our FX -> JAX table (`titan-tpu compile`'s core). TorchTPU's programs are compiled with
libtpu's compile-only client for one chip of the topology (each process of a TPU run compiles its
own), ours for the slice, on this CPU. The collectives in TorchTPU's programs are stand-ins of the
same shapes (a TPU process group cannot start without a chip; the module docstring of
tools/torchtpu_lowering.py). Printed side by side: programs per step, donated arguments, XLA's
memory by kind and peak (split: the peak program's, with what the chip holds outside it), FLOPs
and bytes accessed per chip, the compile time here, op counts, and the fingerprint of what each
hands XLA. Kernels: both lowerings must trace the same ATen ops (e.g. --kernels.attention
reference --kernels.loss chunked). Needs .venv-tpu (torch-tpu, jax, libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/torchtpu_lowering.py --config configs/llama3_debug.toml \
        --topology v5p:2x2x1 --parallelism.dp_shard 4 --kernels.attention reference --kernels.loss chunked
"""

from __future__ import annotations

import os

# This process compiles with JAX's libtpu and needs no TorchTPU (the child loads it): keep torch
# from loading it, libtpu from asking a metadata server for a TPU, and let two libtpu clients load.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402 - after the environment libtpu and torch read at import
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

MiB = 1024**2
COLUMNS = (("split", "TorchTPU split (0.2.0's Dynamo backend)"),
           ("one_program", "TorchTPU one program (the trainer's call)"), ("jax", "ours (JAX)"))


def _columns(report: dict) -> list[tuple[str, str, dict | None]]:
    runtimes = report["runtimes"]
    return [(key, name, report["jax"] if key == "jax" else runtimes.get(key)) for key, name in COLUMNS]


def _rows(report: dict) -> list[tuple[str, list]]:
    columns = _columns(report)

    def each(read):  # one value per column; None where a runtime was not lowered or XLA refused it
        return [None if r is None or "refused" in r else read(r) for _, _, r in columns]

    def counts(level, key):
        return [((r or {}).get(level) or {}).get(key) for _, _, r in columns]

    def programs(r):  # ours: one program per step, or two under gradient accumulation ("programs" names them)
        return len(r["programs"]) if isinstance(r.get("programs"), dict) else r.get("programs")

    rows = [("programs per step", [programs(r) if r else None for _, _, r in columns]),
            ("of them a collective's", [r.get("collective_programs") if r else None for _, _, r in columns]),
            ("donated arguments", [r.get("donated_arguments") if r else None for _, _, r in columns])]
    rows += [(f"{kind} MiB", each(lambda r, kind=kind: r["memory_per_chip_bytes"][kind] / MiB))
             for kind in ("arguments", "outputs", "aliased", "temporaries", "code")]
    rows += [("held outside the program MiB", each(lambda r: r.get("held_outside_bytes", 0) / MiB)),
             ("peak MiB", each(lambda r: r["peak_per_chip_bytes"] / MiB)),
             ("FLOPs", each(lambda r: r["flops_per_chip"])),
             ("bytes accessed MiB", each(lambda r: r["bytes_accessed_per_chip"] / MiB)),
             ("compile s (this CPU)", each(lambda r: r["compile_seconds"]))]
    rows += [(f"StableHLO {key}", counts("stablehlo", key)) for key in ("ops", "dot_general", "while",
                                                                          "optimization_barrier")]
    rows += [(f"optimized HLO {key}", counts("hlo", key)) for key in ("instructions_outside_fusions", "fusions",
                                                                        "copy", "while")]
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 1e6:
        return f"{value:.4e}"
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def format_report(report: dict) -> str:
    header = ["", *(name for _, name in COLUMNS), "one program / ours"]
    split = report["runtimes"].get("split")
    lines = [f"{report['config']} for {report['topology']} ({report['devices']} chips, rank 0's program; "
             f"re-shard after forward {str(report['reshard_after_forward']).lower()}); kernels "
             + ", ".join(f"{op} {name}" for op, name in report["kernels"].items()),
             "step's collectives: " + (", ".join(f"{op.split('.')[1]} {n}" for op, n in report["collectives"].items()
                                                 if "wait_tensor" not in op) or "none"),
             " | ".join(header), " | ".join("---" for _ in header)]
    for name, values in _rows(report):
        one, ours = values[1], values[2]
        ratio = f"{one / ours:.3f}" if isinstance(one, (int, float)) and isinstance(ours, (int, float)) and ours \
            else "-"
        lines.append(" | ".join([name, *(_cell(v) for v in values), ratio]))
    for key, name, r in _columns(report):
        if r and "refused" in r:
            lines.append(f"{name}: XLA refused it: {r['refused']}")
    if split and "refused" not in split and split["programs"] > 1:
        lines.append(f"split: the peak is program {split['peak_program']}'s plus what the chip holds outside it; the "
                     f"{split['programs']} programs' code is {split['code_all_programs_bytes'] / MiB:,.1f} MiB if all "
                     "stay loaded")
    for key, name, r in _columns(report):
        if r and key != "jax":
            fingerprints = r["fingerprints"]
            shown = ", ".join(fingerprints[:3]) + (f", ... ({len(fingerprints)})" if len(fingerprints) > 3 else "")
            lines.append(f"{name}: lowered in {r['lowering_seconds']:.1f} s; fingerprint {shown}")
    fingerprints = report["jax"].get("fingerprints") or {}
    if fingerprints:
        lines.append("ours: fingerprint " + ", ".join(f"{k} {v}" for k, v in fingerprints.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--topology", default="v5p:1x1x1",
                        help="libtpu topology: one rank per chip; TorchTPU's programs compile for its first chip")
    parser.add_argument("--runtimes", default="split,one_program", help="TorchTPU's runtimes to lower, comma-separated")
    parser.add_argument("--json", help="also write the report here")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as work:
        # XLA writes each optimized program here (read before JAX starts): libtpu cannot print
        # programs in which it offloaded a scatter to the SparseCore (the embedding gradient).
        dump = Path(work) / "xla"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
        from titan_tpu.tools.torchtpu_lowering import compare

        report = compare(args.config, overrides, args.topology, Path(work), runtimes=args.runtimes.split(","),
                         xla_dump=dump)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
