"""TorchTPU's own lowering of the captured step against ours, both compiled by XLA's TPU compiler.

One device's step of a config (world size 1) is captured twice on fake tensors, the same way: once
lowered by TorchTPU (its Dynamo backend "tpu", as the trainer calls it on a TPU, in a child process
with torch-tpu loaded: tools/torchtpu_lowering.py) and once by our FX -> JAX table (`titan-tpu
compile`'s core). Both programs are compiled with libtpu's compile-only client for one chip of the
topology, on this CPU. Printed side by side: XLA's memory by kind and peak, FLOPs and bytes
accessed, the compile time here, and op counts (StableHLO before XLA's passes; the optimized HLO
where libtpu can print it). TorchTPU's program twice: as the trainer compiles it (nothing donated)
and with the donation ours has (parameters and moments), whose ratio to ours compares the
lowerings alone. Kernels: both lowerings must trace the same ATen ops (e.g. --kernels.attention
reference --kernels.loss chunked); the Pallas kernels reach TorchTPU through jax_op, which needs a
TPU. Needs .venv-tpu (torch-tpu, jax, libtpu):

    PYTHONPATH=$PWD .venv-tpu/bin/python bench/torchtpu_lowering.py --config configs/llama3_debug.toml \
        --kernels.attention reference --kernels.loss chunked
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
COLUMNS = (("torchtpu_undonated", "TorchTPU, as the trainer calls it"), ("torchtpu", "TorchTPU, donated as ours"),
           ("jax", "ours (JAX)"))


def _rows(report: dict) -> list[tuple[str, list]]:
    def each(read):  # one value per column; None where XLA refused that program or did not say
        return [None if "refused" in report[k] else read(report[k]) for k, _ in COLUMNS]

    def counts(level, key):
        return [(report[k].get(level) or {}).get(key) for k, _ in COLUMNS]

    rows = [(f"{kind} MiB", each(lambda r, kind=kind: r["memory_per_chip_bytes"][kind] / MiB))
            for kind in ("arguments", "outputs", "aliased", "temporaries", "code")]
    rows += [("peak MiB (args + outs - aliased + temps + code)", each(lambda r: r["peak_per_chip_bytes"] / MiB)),
             ("FLOPs", each(lambda r: r["flops_per_chip"])),
             ("bytes accessed MiB", each(lambda r: r["bytes_accessed_per_chip"] / MiB)),
             ("compile s (this CPU)", each(lambda r: r["compile_seconds"]))]
    rows += [(f"StableHLO {key}", counts("stablehlo", key)) for key in ("ops", "dot_general", "while", "scatter",
                                                                          "custom_call", "calls")]
    rows += [(f"optimized HLO {key}", counts("hlo", key)) for key in ("instructions_outside_fusions", "fusions",
                                                                        "copy", "custom-call", "while")]
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 1e6:
        return f"{value:.4e}"
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def format_report(report: dict) -> str:
    header = ["", *(name for _, name in COLUMNS), "TorchTPU donated / ours"]
    lines = [f"{report['config']} on one chip of {report['topology']}; kernels "
             + ", ".join(f"{op} {name}" for op, name in report["kernels"].items()),
             f"TorchTPU: captured in {report['torchtpu_capture_seconds']:.1f} s, lowered in "
             f"{report['torchtpu_lowering_seconds']:.1f} s ({report['scan_bodies']} scan bodies); ours: captured in "
             f"{report['jax'].get('capture_seconds', float('nan')):.1f} s; outputs' shapes "
             + {True: "match", False: "DIFFER", None: "not compared"}[report["outputs_match"]],
             " | ".join(header), " | ".join("---" for _ in header)]
    for name, values in _rows(report):
        donated, ours = values[1], values[2]
        ratio = f"{donated / ours:.3f}" if isinstance(donated, (int, float)) and ours else "-"
        lines.append(" | ".join([name, *(_cell(v) for v in values), ratio]))
    lines += [f"{name}: XLA refused it: {report[k]['refused']}" for k, name in COLUMNS if "refused" in report[k]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--topology", default="v5p:1x1x1", help="libtpu topology; its first chip is compiled for")
    parser.add_argument("--json", help="also write the report here")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as work:
        # XLA writes each optimized program here (read before JAX starts): libtpu cannot print
        # programs in which it offloaded a scatter to the SparseCore (the embedding gradient).
        dump = Path(work) / "xla"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
        from titan_tpu.tools.torchtpu_lowering import compare

        report = compare(args.config, overrides, args.topology, Path(work), xla_dump=dump)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
