"""The measured tables of docs/playbook.md, regenerated in one run: every knob against its
baseline on this CPU (tokens/s, peak memory, compile seconds, as ratios from the same run) beside
the planner's predicted effect of the same change on the TPU recipes (v5p, v6e).

    python bench/playbook.py                 # every row (about 25 short runs; run it alone)
    python bench/playbook.py --short         # the rows marked short (about 10 runs)
    python bench/playbook.py --predict-only  # only the planner's columns (no training, seconds)
    python bench/playbook.py --only "AC|bucket"   # rows whose knob matches
    python bench/playbook.py --refresh-planner   # today's planner columns into the page, its CPU columns kept

Each run trains six steps in a fresh process (torchrun for two ranks) as `titan-tpu plan
--calibrate` does (plan/calibrate.py: validation and checkpoints off; tokens/s the best of steps
2-6, or their mean where a knob acts on some steps only; peak memory the trainer's max_memory_gb,
rank 0's resident peak; compile seconds the first row's capture_s + compile_s). Every row's
baseline is measured beside its variant, not shared between rows: a row is --rounds pairs of runs,
baseline and variant back to back, the order swapped from one pair to the next (and from one row to
the next), and each column is the median of the pairs' ratios, so load that drifts over the run
(another session starting, a neighbour's compile) hits both sides of a ratio alike instead of
showing up as a knob's effect. Writes docs/playbook_tables.md (the playbook links it) and
<out>/playbook.json. The ratios are speeds: run it alone where you can; where the machine is
shared, say so beside the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from titan_tpu.plan.calibrate import Case, _run_case
from titan_tpu.plan.planner import plan_config
from titan_tpu.plan.setting import for_planning

ROOT = Path(__file__).resolve().parents[1]
LLAMA, MOE = "configs/llama3_debug.toml", "configs/qwen3_moe_debug.toml"
GRAPH = ("--training.mode", "graph", "--compile.backend", "inductor")
TWO = ("--parallelism.dp_shard", "2")
# The TPU recipes the planner predicts each knob on: v5p (dense and MoE) and v6e.
RECIPES = (("v5p", "llama3_405b_tpu"), ("v5p", "qwen3_235b_a22b_tpu"), ("v6e", "qwen3_8b_graph_tpu"))


@dataclass(frozen=True)
class Row:
    knob: str
    variant: str
    overrides: tuple[str, ...]  # on top of the baseline's
    base: tuple[str, ...] = ()  # the baseline's overrides of the config
    config: str = LLAMA
    ranks: int = 1
    short: bool = False
    mean: bool = False  # tokens/s as the mean of steps 2-6 (the knob acts on some steps)
    tpu: tuple[str, ...] | None = None  # the planner's what-if on the recipes (None: as overrides; (): not modelled)
    tpu_base: tuple[str, ...] = ()  # the recipes' baseline for that what-if (the recipe as is by default)


ROWS = [
    Row("graph mode", "--training.mode graph (inductor) vs eager", GRAPH, short=True, tpu=()),
    Row("graph mode", "--compile.backend aot_eager vs eager", ("--training.mode", "graph", "--compile.backend",
                                                               "aot_eager"), tpu=()),
    Row("compile split", "--compile.split fwd_bwd vs none (graph, inductor)", ("--compile.split", "fwd_bwd"),
        base=GRAPH, tpu=()),
    Row("scan", "--model.scan_layers true vs false (graph, inductor)", ("--model.scan_layers", "true"), base=GRAPH,
        short=True, tpu_base=("--model.scan_layers", "false")),
    Row("scan", "--model.scan_layers true vs false (eager)", ("--model.scan_layers", "true"),
        tpu_base=("--model.scan_layers", "false")),
    Row("activation checkpointing", "--activation_checkpoint.mode selective vs none",
        ("--activation_checkpoint.mode", "selective"), short=True, tpu_base=("--activation_checkpoint.mode", "none")),
    Row("activation checkpointing", "--activation_checkpoint.mode full vs none",
        ("--activation_checkpoint.mode", "full"), short=True, tpu_base=("--activation_checkpoint.mode", "none")),
    Row("reshard_after_forward", "--parallelism.reshard_after_forward false vs true (2 ranks)",
        ("--parallelism.reshard_after_forward", "false"), base=TWO + ("--parallelism.reshard_after_forward", "true"),
        ranks=2, short=True),
    Row("bucket_mb", "--parallelism.bucket_mb 0 vs 256 (2 ranks)", ("--parallelism.bucket_mb", "0"), base=TWO,
        ranks=2, short=True),
    Row("bucket_mb", "--parallelism.bucket_mb 25 vs 256 (2 ranks)", ("--parallelism.bucket_mb", "25"), base=TWO,
        ranks=2),
    Row("prefetch", "--compile.prefetch -1 vs 1 (2 ranks, graph, inductor, split collectives)",
        ("--compile.prefetch", "-1"), base=TWO + GRAPH + ("--compile.split", "collectives"), ranks=2, tpu=()),
    Row("loss kernel", "--kernels.loss reference vs chunked", ("--kernels.loss", "reference"), short=True),
    Row("loss kernel", "--kernels.loss_chunk_tokens 256 vs auto", ("--kernels.loss_chunk_tokens", "256")),
    Row("attention kernel", "--kernels.attention reference vs sdpa", ("--kernels.attention", "reference"), tpu=()),
    Row("document masks", "--data.document_mask true vs false", ("--data.document_mask", "true"), tpu=()),
    Row("ep", "--parallelism.ep 2 vs 1 (qwen3_moe, 2 ranks; planner: the recipe's ep 8 vs 1)",
        ("--parallelism.ep", "2"), base=TWO, config=MOE, ranks=2, tpu=("--parallelism.ep", "8"),
        tpu_base=("--parallelism.ep", "1")),
    Row("dp_replicate x dp_shard", "--parallelism.dp_replicate 2 vs dp_shard 2 (2 ranks; planner: 2 replicas of "
        "half the slice vs all of it sharded)", ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "1"),
        base=TWO, ranks=2, tpu=("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "-1")),
    Row("batch / accumulation", "--training.batch_size 4 --training.grad_accum_steps 2 vs 8 x 1",
        ("--training.batch_size", "4", "--training.grad_accum_steps", "2"), short=True, tpu=()),
    Row("batch / accumulation", "--training.batch_size 2 --training.seq_len 1024 vs 8 x 256 (same tokens)",
        ("--training.batch_size", "2", "--training.seq_len", "1024"), tpu=()),
    Row("reduce dtype", "--parallelism.reduce_dtype bfloat16 vs float32 (2 ranks)",
        ("--parallelism.reduce_dtype", "bfloat16"), base=TWO, ranks=2),
    Row("async checkpoints", "--checkpoint.async_save true vs false (a checkpoint every 2 steps)",
        ("--checkpoint.async_save", "true"), base=("--checkpoint.enabled", "true", "--checkpoint.interval", "2"),
        mean=True, tpu=()),
]


def measure(row: Row, overrides: tuple[str, ...], out: Path, tag: str) -> dict:
    case = Case(f"{row.knob} {tag} {len(overrides)}", row.config, overrides, ranks=row.ranks)
    r = _run_case(case, out, tokenizer="", python=sys.executable)
    later = r["step_tokens_per_s"][1:]
    return {"tokens_per_s": sum(later) / len(later) if row.mean else r["measured_tokens_per_s"],
            "peak_gb": r["measured_peak_gb"], "compile_s": r["compile_s"], "wall_s": r["wall_s"]}


def measure_pairs(row: Row, out: Path, *, rounds: int, first: int) -> dict:
    """`rounds` pairs of runs, baseline and variant back to back (the variant first in odd pairs,
    counted from `first`); each quantity as the median of its per-pair ratios, and the medians of
    the values themselves (for the brackets of the table)."""
    pairs = []
    for k in range(rounds):
        order = ("base", "var") if (first + k) % 2 == 0 else ("var", "base")
        runs = {tag: measure(row, row.base + (row.overrides if tag == "var" else ()), out, tag) for tag in order}
        pairs.append({"base": runs["base"], "variant": runs["var"]})

    def median_of(side: str, key: str) -> float:
        return statistics.median(p[side][key] for p in pairs)

    def ratio(key: str) -> float | None:
        if not all(p["base"][key] and p["variant"][key] for p in pairs):
            return None
        return statistics.median(p["variant"][key] / p["base"][key] for p in pairs)

    keys = ("tokens_per_s", "peak_gb", "compile_s", "wall_s")
    return {"pairs": pairs, "ratio": {key: ratio(key) for key in keys[:3]},
            "base": {key: median_of("base", key) for key in keys},
            "variant": {key: median_of("variant", key) for key in keys}}


def predict(row: Row) -> dict:
    """The planner's ratio (variant / baseline) of tokens/s and peak memory on each TPU recipe."""
    out = {}
    if row.tpu == ():
        return {f"{hw} {name}": None for hw, name in RECIPES}
    change = row.tpu if row.tpu is not None else row.overrides
    for hw, name in RECIPES:
        recipe = ROOT / "configs" / f"{name}.toml"
        try:
            base = plan_config(for_planning(recipe, list(row.tpu_base)))
            var = plan_config(for_planning(recipe, list(row.tpu_base + change)))
        except ValueError as e:  # e.g. ep on a dense model
            out[f"{hw} {name}"] = {"error": str(e).split(";")[0]}
            continue
        out[f"{hw} {name}"] = {"tokens_per_s": var.tokens_per_s / base.tokens_per_s,
                              "peak": var.peak_bytes / base.peak_bytes, "fits": var.fits, "base_fits": base.fits}
    return out


def _cell(p) -> str:
    if p is None:
        return "not modelled"
    if "error" in p:
        return "n/a"
    fit = "" if p["fits"] else " (does not fit)" if p["base_fits"] else " (neither fits)"
    return f"{p['tokens_per_s']:.2f}x tok/s, {p['peak']:.2f}x mem{fit}"


def table(results: list[dict], header: str) -> str:
    lines = [header, "",
             "| knob | change | CPU tok/s | CPU peak RSS | CPU compile s | "
             + " | ".join(f"planner {hw} {n}" for hw, n in RECIPES) + " |",
             "|---|---|---:|---:|---:|" + "---|" * len(RECIPES)]
    for r in results:
        m = r.get("measured")
        if m:
            b, v, x = m["base"], m["variant"], m["ratio"]
            comp = f"{x['compile_s']:.2f}x ({b['compile_s']:.0f} -> {v['compile_s']:.0f} s)" \
                if x["compile_s"] else ("+" + f"{v['compile_s']:.0f} s" if v["compile_s"] else "-")
            cpu = (f"{x['tokens_per_s']:.2f}x ({b['tokens_per_s']:,.0f} -> {v['tokens_per_s']:,.0f})",
                   f"{x['peak_gb']:.2f}x ({b['peak_gb']:.2f} -> {v['peak_gb']:.2f} GB)", comp)
        else:
            cpu = ("not run", "", "")
        lines.append(f"| {r['knob']} | {r['variant']} | {' | '.join(cpu)} | "
                     + " | ".join(_cell(r["predicted"][f"{hw} {n}"]) for hw, n in RECIPES) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="only the rows marked short")
    parser.add_argument("--only", help="rows whose knob or change matches this regular expression")
    parser.add_argument("--predict-only", action="store_true", help="the planner's columns only, no runs")
    parser.add_argument("--refresh-planner", action="store_true",
                        help="rewrite only the planner's columns of --write (seconds): the planner changes more "
                             "often than the CPU measurements need redoing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs (baseline beside variant) per row; each ratio is their median")
    parser.add_argument("--out", default="outputs/playbook")
    parser.add_argument("--write", default=str(ROOT / "docs" / "playbook_tables.md"))
    return parser


_REFRESHED = re.compile(r" Planner columns refreshed .*? the run above's\.")


def refresh_planner(page: Path) -> str:
    """The page with every row's planner cells recomputed and its CPU cells as they were (a row
    matched by knob and change; a row the page lacks shows "not run"), the date of the refresh in
    its header."""
    lines = page.read_text().splitlines()
    header_end = next(i for i, line in enumerate(lines) if line.startswith("| knob |"))
    measured = {}
    for line in lines[header_end + 2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5:
            measured[(cells[0], cells[1])] = cells[2:5]
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = "\n".join(lines[:header_end]).rstrip()
    header = _REFRESHED.sub("", header) + (f" Planner columns refreshed {date} with that day's planner "
                                           "(`python bench/playbook.py --refresh-planner`); the CPU columns are "
                                           "the run above's.")
    out = [header, "", lines[header_end], lines[header_end + 1]]
    for row in ROWS:
        cpu = measured.get((row.knob, row.variant), ["not run", "", ""])
        predicted = predict(row)
        out.append(f"| {row.knob} | {row.variant} | {' | '.join(cpu)} | "
                   + " | ".join(_cell(predicted[f"{hw} {n}"]) for hw, n in RECIPES) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    args = build_parser().parse_args()
    if args.refresh_planner:
        Path(args.write).write_text(refresh_planner(Path(args.write)))
        print(f"wrote {args.write}: the planner's columns")
        return 0
    rows = [r for r in ROWS if (not args.short or r.short)
            and (not args.only or re.search(args.only, f"{r.knob} {r.variant}"))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, start = [], time.perf_counter()
    load = os.getloadavg()
    for i, row in enumerate(rows):
        result = {"knob": row.knob, "variant": row.variant, "predicted": predict(row)}
        if not args.predict_only:
            result["measured"] = measure_pairs(row, out, rounds=args.rounds, first=i)
            print(f"{row.knob}: {row.variant}: {result['measured']['ratio']} "
                  f"({time.perf_counter() - start:.0f} s so far)", flush=True)
        results.append(result)
    minutes, load = (time.perf_counter() - start) / 60, (load, os.getloadavg())
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python bench/playbook.py " + " ".join(sys.argv[1:])
    header = (f"<!-- generated by bench/playbook.py; do not edit by hand -->\n# Playbook tables\n\n"
              f"`{command.strip()}`, {date}, {cpu}, torch fp32, 2 threads shared by the ranks; {minutes:.0f} minutes, "
              f"load average {load[0][0]:.1f} at the start and {load[1][0]:.1f} at the end. CPU columns: the median "
              f"over {args.rounds} pair(s) of runs of variant / baseline, each pair measured back to back in this run "
              "(the medians of baseline -> variant in brackets); llama3 debug, batch 8 x "
              "seq 256 per rank, eager, unless the change says otherwise. Planner columns: `titan-tpu plan` of the "
              "recipe with the change / without it (the recipe's own slice; for scan and AC the baseline is the recipe "
              "unrolled / without checkpointing), tokens/s and peak memory per device.")
    text = table(results, header)
    print(text)
    (out / "playbook.json").write_text(json.dumps({"date": date, "cpu": cpu, "command": command, "minutes": minutes,
                                                   "load": load, "results": results}, indent=2))
    if not args.predict_only:
        Path(args.write).write_text(text + "\n")
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
