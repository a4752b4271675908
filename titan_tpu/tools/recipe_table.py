"""docs/tpu_recipes.md: every TPU recipe, what vouches for it (planned only, compiled by XLA, run on a
TPU), and XLA's numbers beside the planner's, generated from the compile reports.

The reports (bench/results/xla/<recipe>.json) are written by bench/tpu_compile_table.py, which
compiles each recipe's step, built by the trainer's own assembly (tools/compile_cmd.py), with libtpu's
compile-only client; each carries where it was made (`provenance`: date, CPU, libtpu/JAX versions, commit, and
a hash of the recipe file). This module needs no JAX: it renders the table from the reports and
today's planner, so `python -m titan_tpu.tools.recipe_table` regenerates the page and the suite
(tests/test_tpu_recipes.py) checks that the page is what the reports and the planner give today,
that no recipe changed after its compile, and that the planner stays within its stated distance of
XLA on every row.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from titan_tpu.device_cpu import _cpu_model
from titan_tpu.plan.xla_compare import compared_flops

__all__ = ["REPORTS", "PAGE", "Row", "provenance", "recipe_hash", "render", "rows", "saved_report", "stage_line"]

ROOT = Path(__file__).resolve().parents[2]  # the repository
REPORTS = ROOT / "bench/results/xla"
# The planner's held-out set (its validation, apart from the recipes it was calibrated on) and its reports.
HELDOUT = ROOT / "bench/planner_heldout.toml"
HELDOUT_REPORTS = ROOT / "bench/results/xla_heldout"
PAGE = ROOT / "docs/tpu_recipes.md"
GiB = 1024**3
# How close the planner must stay to XLA, on every compiled row (tests/test_tpu_recipes.py).
PEAK_TOLERANCE = 0.10  # the planner's peak, planned as compiled, against XLA's per-chip peak
FLOPS_TOLERANCE = 0.03  # our formula counted as XLA counts, against XLA's matmul FLOPs
# Beyond this distance between XLA's time estimate as run and the planner's step time, a row says why
# (TIME_NOTES, HELDOUT_NOTES; tests/test_tpu_recipes.py holds both ways).
TIME_TOLERANCE = 0.25
# What XLA's cost model counts, measured on small programs (bench/xla_cost_model.py).
_COST = json.loads((ROOT / "bench/results/xla_cost_model.json").read_text())
# Why XLA's time estimate and the planner's step time differ by more than TIME_TOLERANCE, per row.
_EFFICIENCY = ("XLA's model runs matmuls near {:.0%} of peak where the planner assumes {:.0%} ({:.2f}x on its own)"
               .format(_COST["matmul_fraction_of_peak"], _COST["planner_efficiency"],
                       _COST["planner_efficiency"] / _COST["matmul_fraction_of_peak"]))
# {outside}: the row's share of XLA's FLOPs outside its matmuls, read off its report (`_time_note`).
_MOE = ("XLA's estimate of a MoE step is above the planner's, most with expert parallelism: XLA prices "
        "megablox's grouped matmuls by the kernel's own cost estimate, 2 m k n over the static rows m of the buffer "
        "the kernel is handed, and under ep that buffer is sized for the worst case while the kernel visits only "
        "the rows its groups cover (a buffer of 8x the rows: {gmm:.1f}x XLA's time, bench/xla_cost_model.py); its "
        "cost analysis counts {{outside}} of this step's FLOPs outside its dots (the Pallas kernels' estimates and "
        "the elementwise work)").format(gmm=_COST["gmm_8x_buffer_rows_over_1x"])
_LONG_ATTENTION = ("at {} tokens a sequence attention is most of the work, and it runs inside splash's Pallas "
                   "kernels, which XLA's cost model does not see into (their time is what the kernels' cost estimates "
                   "say); the planner counts attention's FLOPs at 70% of peak")
_STACKS = ("XLA's cost model charges the scanned step's in-place updates of its stacked buffers more than the "
           "unrolled program's (bench/xla_cost_model.py){}")
TIME_NOTES: dict[str, str] = {
    "qwen3_8b_tpu": _STACKS.format(": its estimate of this step unscanned (--model.scan_layers false) is 1.137 s, "
                                   "0.84x the planner's"),
    "llama3_8b_tpu": _EFFICIENCY + "; the planner's collectives over 64 chips add the rest",
    "llama3_8b_128k_cp_tpu": _LONG_ATTENTION.format("131,072"),
    "qwen3_30b_a3b_tpu": _MOE,
    "qwen3_235b_a22b_tpu": _MOE,
    "deepseek_v3_671b_tpu": _MOE,
}
HELDOUT_NOTES: dict[str, str] = {
    "llama3_8b_v5p32": _EFFICIENCY + "; the planner's collectives over 16 chips add the rest",
    "llama3_8b_64k_cp4": _LONG_ATTENTION.format("65,536"),
    "qwen3_30b_ep4_all_to_all": _MOE,
    "qwen3_30b_ep4_all_gather": _MOE,
    "qwen3_30b_seq8k": _MOE,
    "qwen3_30b_ep8_all_to_all": _MOE,
    "qwen3_30b_ep4_tp2": _MOE,
    "qwen3_30b_ep8_tp2_all_gather": _MOE,
    "qwen3_30b_ep4_resharded": _MOE,
    "qwen3_30b_ep2_all_to_all": _MOE,
    "deepseek_v3_16b_ep4_all_to_all": _MOE,
}


def recipe_hash(path: str | Path) -> str:
    """The hash of the recipe's settings (its TOML parsed, comments and layout left out): a report
    whose hash differs compiled another recipe; a recipe whose comments changed compiles the same."""
    settings = tomllib.loads(Path(path).read_text())
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def saved_report(config: str | Path) -> Path | None:
    """The compile report of this recipe file (bench/results/xla/<recipe>.json) when XLA compiled
    it as it stands: a report that compiled, of a recipe whose content has not changed since; else
    None. `titan-tpu plan` of a shipped TPU recipe prints XLA's numbers from it."""
    path = REPORTS / f"{Path(config).stem}.json"
    if not Path(config).is_file() or not path.is_file():
        return None
    report = json.loads(path.read_text())
    return path if "error" not in report and report.get("recipe_sha") == recipe_hash(config) else None


def heldout_rows() -> list[dict]:
    """The held-out set's rows (bench/planner_heldout.toml): name, recipe, overrides, varies."""
    return tomllib.loads(HELDOUT.read_text())["row"]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def provenance(recipe: str) -> dict:
    """Where a compile report was made: what a reader needs to trust or redo it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"date": date.today().isoformat(), "recipe_sha": recipe_hash(recipe), "commit": commit,
            "cpu": f"{_cpu_model()}, {os.cpu_count()} cores", "libtpu": _version("libtpu"), "jax": _version("jax"),
            "python": sys.version.split()[0]}


def _slices(report: dict) -> str:
    """"2 x " before the topology of a multi-slice compile (parallelism.slices), "" for one slice."""
    return f"{report['slices']} x " if report.get("slices", 1) > 1 else ""


def stage_line(recipe: str, report: dict) -> str:
    """One line per compiled recipe: the stages' times here, XLA's peak and FLOPs."""
    return (f"{recipe}: {_slices(report)}{report['topology']} ({report['devices']} chips): capture "
            f"{report['capture_seconds']:.0f} s, "
            f"lowering {report['lower_seconds']:.0f} s ({report['operations']:,} operations), XLA compile "
            f"{report['compile_seconds']:.0f} s, {report.get('max_rss_bytes', 0) / GiB:.1f} GiB here; XLA peak "
            f"{report['peak_per_chip_bytes'] / GiB:.1f} GiB per chip, {compared_flops(report):.3e} FLOPs in XLA's "
            f"matmuls (our formula so: {_formula_ratio(report)})"
            + (f"; {report['f8_dots']} f8 dots (a loop body's once)" if report.get("f8_dots") else ""))


def _formula_ratio(report: dict) -> str:
    """Our formula over XLA's matmuls: counted as XLA counts, or where the formula cannot count so
    yet (a Transformers-backend model) its MFU count, marked."""
    counted = report.get("formula_as_xla_counts_per_chip")
    if counted is not None:
        return f"{counted / compared_flops(report):.3f}x"
    return f"{report['formula_flops_per_chip'] / compared_flops(report):.3f}x (MFU's count)"


@dataclass
class Row:
    recipe: str  # configs/<name>.toml
    report: dict | None  # the compile report, None when only planned
    stale: bool  # the recipe changed after its compile
    plan_peak: float  # the planner's peak per chip, the program a TPU runs
    plan_peak_compiled: float  # the same, with the compiled forms where they differ (the loss kernel)
    plan_flops: float  # the planner's executed FLOPs per chip (whole step)
    topology: str
    backend: str  # the recipe's compile.backend: "jax" runs the program the report certifies
    counted: float | None = None  # today's FLOP formula counted as XLA counts, for the report's step
    plan_seconds: float | None = None  # the planner's step time for the compiled program
    model_flops: float = 0.0  # the model FLOPs per step per chip MFU counts (the planner's)
    peak_flops: float = 0.0  # the chip's dense bf16 peak, FLOP/s
    name: str = ""  # a held-out row's name (bench/planner_heldout.toml); "" for a recipe
    varies: str = ""  # a held-out row: what it varies from its recipe
    fitted: str = ""  # a held-out row a planner term was read from after all (which, and why): calibration now
    moved: str = ""  # what re-lowering found moved in its programs (tools/recheck.py), "" when not re-checked or same

    @property
    def mfu_count(self) -> bool:
        """Whether the formula held against XLA is the compile's MFU count: a model today's formula
        cannot count as XLA counts (a Transformers-backend model)."""
        return self.counted is None and self.report.get("formula_as_xla_counts_per_chip") is None

    @property
    def formula_flops(self) -> float:
        """Our formula for the compiled step, per chip, to hold against XLA's matmuls: counted as XLA
        counts where it can be (today's, else the report's), else the report's MFU count."""
        if self.counted is not None:
            return self.counted
        if not self.mfu_count:
            return self.report["formula_as_xla_counts_per_chip"]
        return self.report["formula_flops_per_chip"]

    @property
    def xla_seconds(self) -> float | None:
        """XLA's time estimate for the step with its loops counted as they run (xla/numbers.py
        as_run_seconds), None where the report has none."""
        return (self.report or {}).get("xla_optimal_seconds_per_step_as_run")

    @property
    def compiled(self) -> bool:
        return self.report is not None and "error" not in self.report


def rows(reports: Path = REPORTS) -> list[Row]:
    """Every configs/*_tpu.toml, with its report when there is one and today's plan beside it."""
    out = []
    for recipe in sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("configs/*_tpu.toml")):
        path = reports / f"{Path(recipe).stem}.json"
        report = json.loads(path.read_text()) if path.exists() else None
        out.append(planned_row(recipe, [], report))
    return out


def heldout_table(reports: Path = HELDOUT_REPORTS) -> list[Row]:
    """The held-out set's rows (bench/planner_heldout.toml), with their reports where compiled."""
    out = []
    for entry in heldout_rows():
        path = reports / f"{entry['name']}.json"
        report = json.loads(path.read_text()) if path.exists() else None
        out.append(planned_row(entry["recipe"], entry["overrides"], report, name=entry["name"],
                               varies=entry["varies"], fitted=entry.get("fitted", "")))
    return out


def planned_row(recipe: str, overrides: list[str], report: dict | None, *, name: str = "", varies: str = "",
                fitted: str = "") -> Row:
    """A recipe (with overrides) planned by today's planner, beside its compile report."""
    from titan_tpu.config import build_config
    from titan_tpu.models.spec import model_spec
    from titan_tpu.plan.planner import plan_config
    from titan_tpu.plan.setting import default_hardware, planning_machine
    from titan_tpu.plan.topology import topology_for_chips
    from titan_tpu.run.setup import prepare_run
    from titan_tpu.tools.hf_shape_dir import ensure

    with planning_machine():
        cfg = build_config(ROOT / recipe, list(overrides))
        ensure(cfg.model.hf_config, log=lambda message: None)  # a Transformers-backend recipe's stand-in
        setup = prepare_run(cfg)
        cfg = setup.cfg
    hardware, chips = default_hardware(cfg, measure=False)
    topology = _slices({"slices": cfg.parallelism.slices}) + topology_for_chips(
        hardware.name, chips // cfg.parallelism.slices)
    plan = plan_config(cfg, hardware, chips=chips, measure=False)
    counted = None
    if report is not None and "error" not in report:  # today's formula, on the compiled step's tokens
        from titan_tpu.plan.xla_compare import formula_as_xla_counts
        from titan_tpu.run.resolved import Target, resolve_run

        tokens = report.get("tokens_per_chip") or report["formula_flops_per_chip"] / \
            model_spec(cfg.model).flops_per_token(None, cfg.training.seq_len)[0]
        schedule = resolve_run(setup, Target(world_size=None), runnable=False).pipeline
        counted = formula_as_xla_counts(cfg, report["kernels"], tokens, schedule=schedule,
                                        topology=report["topology"])
    compiled = plan_config(cfg, hardware, chips=chips, measure=False, as_compiled=True)
    return Row(recipe=recipe, report=report, stale=_stale(report, recipe, overrides), plan_peak=plan.peak_bytes,
               plan_peak_compiled=compiled.peak_bytes, plan_flops=plan.flops["executed_per_step_per_device"],
               topology=topology, backend=cfg.compile.backend, counted=counted,
               plan_seconds=compiled.time.get("step_s"), model_flops=compiled.flops["model_per_step_per_device"],
               peak_flops=hardware.peak_flops, name=name, varies=varies, fitted=fitted)


def _stale(report: dict | None, recipe: str, overrides: list[str] = ()) -> bool:
    """Whether the recipe (or a held-out row's overrides) changed after its compile (or its failed one)."""
    if report is None:
        return False
    if report.get("recipe_sha") != recipe_hash(ROOT / recipe):
        return True
    return bool(overrides) and report.get("config") != " ".join([recipe, *overrides])


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def _compiled_cells(row: Row) -> list[str]:
    r = row.report
    xla_peak, xla_flops = r["peak_per_chip_bytes"], compared_flops(r)
    stages = (f"{r['capture_seconds'] + r['lower_seconds'] + r['compile_seconds']:.0f} s "
              f"({r['capture_seconds']:.0f} + {r['lower_seconds']:.0f} + {r['compile_seconds']:.0f})")
    planned = f"{row.plan_peak_compiled / GiB:.1f} ({row.plan_peak_compiled / xla_peak:.2f}x)"
    stale = " (STALE: the recipe changed since)" if row.stale else \
        f" (STALE: its program changed since: {row.moved}; recompile it)" if row.moved else ""
    return [f"compiled by XLA {r['date']}{stale}",
            _certificate(row), f"{_slices(r)}{r['topology']} ({r['devices']})", f"{xla_peak / GiB:.1f}",
            planned, _gib(row.plan_peak), _flops_cell(row), f"{1 - xla_flops / r['flops_per_chip']:.0%}", stages]


def _flops_cell(row: Row) -> str:
    """Our formula against XLA's matmuls: counted as XLA counts where today's formula can (a native
    model), else the MFU formula the compile reported (the work the step does: no rerun under
    checkpointing, attention inside a kernel counted), marked as such."""
    return f"{row.formula_flops / compared_flops(row.report):.3f}x" + (" (MFU's count)" if row.mfu_count else "")


def _certificate(row: Row) -> str:
    """Which runtime runs the compiled program, with each program's fingerprint (what a run of the
    recipe logs handing it to XLA): the JAX path runs our lowering; another backend runs another."""
    prints = ", ".join(f"{name} `{fp}`" for name, fp in row.report.get("fingerprints", {}).items()) or "none recorded"
    if row.backend == "jax":
        return f"compile.backend jax: {prints}"
    return f"our lowering ({prints}); the recipe runs compile.backend {row.backend}, another program"


def render(reports: Path = REPORTS, heldout_reports: Path = HELDOUT_REPORTS, moved: dict[str, str] | None = None
           ) -> str:
    """The page docs/tpu_recipes.md. moved: recipe -> what moved in its programs since its compile
    (tools/recheck.py `moved_recipes`), marked stale on the page."""
    table = rows(reports)
    for row in table:
        row.moved = (moved or {}).get(row.recipe, "")
    compiled = [r for r in table if r.report is not None and "error" not in r.report]
    lines = [
        "# The TPU recipes, certified by the TPU compiler",
        "",
        "Generated by `python -m titan_tpu.tools.recipe_table` from the compile reports in `bench/results/xla/` "
        "(written by `PYTHONPATH=$PWD .venv-tpu/bin/python bench/tpu_compile_table.py`, which compiles every "
        "`configs/*_tpu.toml`, its step built by the trainer's own assembly for its slice, with libtpu's "
        "compile-only client on a CPU machine) and today's planner. `tests/test_tpu_recipes.py` fails when this "
        "page differs from what the reports and the planner give, when a recipe changed after its compile, and "
        "when a compiled row's "
        f"planner peak moves outside {PEAK_TOLERANCE:.0%} of XLA's (or our formula outside {FLOPS_TOLERANCE:.0%} of "
        "the matmul FLOPs of XLA's program) other than the rows it lists, with what the planner misses there, "
        "as the planner's open work.",
        "",
        f"{len(compiled)} of {len(table)} recipes compiled by XLA; none has run on a TPU (no TPU was available to "
        "this project). What each column means is under the table.",
        "",
        "| recipe | status | certified for: backend, program fingerprints | slice (chips) | XLA peak per chip, GiB "
        "| planner as compiled, GiB | planner as a TPU runs it, GiB | FLOPs: our formula / XLA's matmuls | XLA's "
        "cost analysis beyond its matmuls | compile here: capture + lowering + XLA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in table:
        name = f"`{Path(row.recipe).name}`"
        if row.report is None:
            cells = ["planned only", "", row.topology, "", "", _gib(row.plan_peak), "", "", ""]
        elif "error" in row.report:
            stale = " (STALE: the recipe changed since)" if row.stale else ""
            cells = [f"not compiled {row.report['date']}{stale}: {row.report['error']}", "", row.topology, "",
                     _gib(row.plan_peak_compiled), _gib(row.plan_peak), "", "", ""]
        else:
            cells = _compiled_cells(row)
        lines.append("| " + " | ".join([name, *cells]) + " |")
    lines += ["", "Where each compile ran:", ""]
    for row in compiled:
        r = row.report
        lines.append(f"- `{Path(row.recipe).name}`: {r['date']}, {r['cpu']}, libtpu {r['libtpu']}, JAX {r['jax']}; "
                     f"peak {r.get('max_rss_bytes', 0) / GiB:.1f} GiB of memory "
                     f"here; re-shard after forward {str(r.get('reshard_after_forward')).lower()}, "
                     f"{r.get('grad_accum_steps', 1)} micro-batch(es)"
                     + (f"; {r['f8_dots']} matmuls on float8 operands in XLA's optimized program (a loop body's "
                        "once)" if r.get("f8_dots") else "") + ".")
    lines += ["", _COLUMNS, "", *_time_section(compiled), "", *_heldout_section(heldout_table(heldout_reports))]
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _time_cells(row: Row) -> list[str]:
    """The planner's step time and XLA's estimate as run, their ratio, and the MFU each implies."""
    xla, planned = row.xla_seconds, row.plan_seconds
    once = row.report.get("xla_optimal_seconds_per_step")
    if once is not None and once < 0:
        return [_seconds(planned), "none (XLA's cost model gives a negative time for this target)", "", "", ""]
    if xla is None or not planned:
        return [_seconds(planned), "not estimated yet (bench/tpu_compile_table.py --time-only)", "", "", ""]
    mfu = lambda seconds: f"{100 * row.model_flops / seconds / row.peak_flops:.0f}%"  # noqa: E731
    return [_seconds(planned), _seconds(xla), f"{xla / planned:.2f}x", mfu(planned), mfu(xla)]


def _time_note(row: Row, notes: dict[str, str]) -> str:
    """The row's note on its time estimate, `{outside}` filled from its report: the share of XLA's
    FLOPs outside its matmuls (of the program at its peak)."""
    note = notes.get(row.name or Path(row.recipe).stem, "")
    if "{outside}" in note:
        program = row.report["programs"][row.report["peak_program"]]
        note = note.format(outside=f"{1 - program['matmul_flops'] / program['flops']:.0%}")
    return note


def _time_section(compiled: list[Row]) -> list[str]:
    lines = ["## XLA's time estimate beside the planner's", "",
             "XLA's TPU compiler estimates each program's time (its cost analysis's `optimal_seconds`). It counts a "
             "while loop's body once, so the estimate of a scanned step is taken as run: the body's time read off a "
             "second compile of the step with two layers a loop trip, added once per further trip "
             "(`titan_tpu/xla/numbers.py` `time_as_run`; the method is in each report). What the estimate counts, "
             "measured on small programs built for the purpose (`bench/xla_cost_model.py`): a large matmul at "
             f"{_COST['matmul_fraction_of_peak']:.0%} of the chip's peak (the planner assumes "
             f"{_COST['planner_efficiency']:.0%} for its matmul-dominated work), elementwise work at "
             f"{_COST['elementwise_fraction_of_bandwidth']:.0%} of the planner's memory bandwidth, collectives at a "
             "cost of their own added to the compute's with no overlap (a matmul beside an independent all-gather "
             f"costs {_COST['matmul_beside_all_gather_over_sum']:.2f}x the two alone), and, in a scanned stack's "
             "gradient, each loop trip's in-place update of the stacked weights' gradient at more than the unrolled "
             f"program's cost ({_COST['stack_gradient_as_run_over_unrolled']:.2f}x the unrolled estimate on a 16-layer "
             f"toy stack; its forward {_COST['stack_forward_as_run_over_unrolled']:.2f}x). MFU is the planner's model "
             "FLOPs per step (`titan-tpu plan`'s count) over the chip's peak and the time. A row whose ratio is "
             "outside "
             f"{1 - TIME_TOLERANCE:.2f}x to {1 + TIME_TOLERANCE:.2f}x says why.", "",
             "| recipe | planner step, s | XLA as run, s | XLA / planner | planner MFU | MFU at XLA's time | XLA as it "
             "counts (loops once), s | why they differ |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in compiled:
        once = row.report.get("xla_optimal_seconds_per_step")
        once = once if once is None or once >= 0 else None
        lines.append("| " + " | ".join([f"`{Path(row.recipe).name}`", *_time_cells(row), _seconds(once),
                                        _time_note(row, TIME_NOTES)]) + " |")
    return lines


def within_peak_tolerance(row: Row) -> bool:
    return abs(row.plan_peak_compiled / row.report["peak_per_chip_bytes"] - 1) <= PEAK_TOLERANCE


def _heldout_section(table: list[Row]) -> list[str]:
    held_out = [row for row in table if not row.fitted]
    compiled = [row for row in held_out if row.compiled]
    within = [row for row in compiled if within_peak_tolerance(row)]
    moe = [row for row in compiled if "--parallelism.ep=" in row.report.get("config", "")]
    recipes = [row for row in rows() if row.compiled]
    fitted = [row for row in table if row.fitted and row.compiled]
    calibrated = [row for row in recipes + fitted if within_peak_tolerance(row)]
    lines = ["## The planner's held-out set", "",
             "The planner's memory terms were read off the recipes' own compiles above, so the recipes' agreement "
             f"is its calibration ({len(calibrated)} of {len(recipes) + len(fitted)} peaks within "
             f"{PEAK_TOLERANCE:.0%} of XLA's, counting the rows below marked *fitted*: a term was read from their "
             "programs after they were held out). "
             "Its validation is the rest of this set (`bench/planner_heldout.toml`): the same model families at "
             "other batch sizes, sequence lengths, slices, checkpointing modes and MoE layouts, none of which any "
             "planner term was read from, compiled by `bench/tpu_compile_table.py --heldout` into "
             f"`bench/results/xla_heldout/`. {len(within)} of {len(compiled)} compiled rows are within "
             f"{PEAK_TOLERANCE:.0%} of XLA's peak"
             + (f" ({len(held_out) - len(compiled)} not compiled)" if len(compiled) < len(held_out) else "")
             + f"; of the {len(moe)} with expert parallelism, {len([r for r in moe if within_peak_tolerance(r)])}.",
             "",
             "| row | varies | slice (chips) | XLA peak per chip, GiB | planner as compiled, GiB | planner step, s "
             "| XLA as run, s | XLA / planner | planner MFU | MFU at XLA's time | why they differ |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        if not row.compiled:
            why = row.report["error"] if row.report else "not compiled"
            lines.append(f"| `{row.name}` | {row.varies} | {row.topology} | {why} | {_gib(row.plan_peak_compiled)} "
                         "| | | | | | |")
            continue
        r = row.report
        lines.append("| " + " | ".join([
            f"`{row.name}`" + (" (*fitted*)" if row.fitted else ""), row.varies,
            f"{_slices(r)}{r['topology']} ({r['devices']})",
            _gib(r["peak_per_chip_bytes"]),
            f"{row.plan_peak_compiled / GiB:.1f} ({row.plan_peak_compiled / r['peak_per_chip_bytes']:.2f}x)",
            *_time_cells(row), _time_note(row, HELDOUT_NOTES)]) + " |")
    return lines


_COLUMNS = """Columns:
- **certified for**: the compile is of our lowering of the step (graph/jax_lowering.py), the one
  program `--compile.backend jax` hands XLA on the recipe's slice; each program's fingerprint
  (graph/fingerprint.py) is what a run of the recipe logs when it hands XLA that program, so a run
  can be matched to its certificate. A recipe on another backend runs another program.
- **XLA peak per chip**: arguments + outputs - aliased + temporaries + generated code, from XLA's
  memory analysis of the compiled program (the larger of the two programs under gradient
  accumulation).
- **planner as compiled**: `titan-tpu plan` of the same recipe with the compiled forms where the
  program XLA compiled here differs from the one a TPU runs: tokamax's loss kernel is compiled in
  its plain-XLA form (its Mosaic kernel cannot be traced off a TPU), which keeps the logits. The
  ratio is against XLA's peak. A Transformers-backend model's terms are measured on the model
  built on the meta device (docs/planner.md).
- **planner as a TPU runs it**: the plan a user sees (`titan-tpu plan --config ...`): the real kernels.
- **FLOPs**: our FLOP formula (matmuls only, as MFU counts) counted as XLA counts (a scanned loop's
  body once, no work inside a Pallas kernel, checkpointing's rerun) against the multiply-adds of the
  dots and convolutions in XLA's optimized program (`titan_tpu/xla/dump.py` `matmul_flops`,
  which agrees with XLA's cost analysis on a program of matmuls alone). "MFU's count": a model the
  formula cannot yet count as XLA counts (a Transformers-backend model), its MFU formula as the
  compile reported it, which counts attention inside its kernel and no rerun under checkpointing.
- **XLA's cost analysis beyond its matmuls**: the share of XLA's cost-analysis FLOPs that are not in
  its dots and convolutions: elementwise work (norms, softmax, SiLU, AdamW; under expert parallelism
  the router's and the worst-case dispatch buffers'), which our formula leaves out.
- **compile here**: seconds on the CPU named below the table: capturing the step on fake tensors, lowering
  it to StableHLO, XLA's compile for the slice."""


def rechecked() -> dict[str, str] | None:
    """recipe -> what moved in its programs since its compile, re-lowered by tools/recheck.py under
    .venv-tpu (JAX and libtpu; the capture and lowering, no XLA compile); None where there is none."""
    python = ROOT / ".venv-tpu/bin/python"
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-m", "titan_tpu.tools.recheck", "--json"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    if not done.stdout.strip():
        raise SystemExit(f"tools/recheck.py failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["moved"]


def main() -> None:
    moved = rechecked()
    if moved is None:
        print("the compile reports' fingerprints not re-checked: that needs .venv-tpu "
              "(make .venv-tpu/.installed-stamp)")
    elif moved:
        print("stale (recompile with bench/tpu_compile_table.py): " + "; ".join(f"{k}: {v}" for k, v in moved.items()))
    PAGE.write_text(render(moved=moved))
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
