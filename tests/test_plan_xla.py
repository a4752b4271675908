"""`titan-tpu plan --xla REPORT`: XLA's per-chip numbers from a saved `titan-tpu compile --json`
report beside the plan's (the compile itself needs .venv-tpu; tests/tpu compiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_tpu.cli import main
from titan_tpu.plan import resolve_hardware
from titan_tpu.plan.planner import plan_config
from titan_tpu.plan.setting import for_planning

CONFIG = ["--config", "configs/llama3_debug.toml", "--hardware", "v5p-8"]


def _report(tmp_path, devices=4, **more):
    # The fields `titan-tpu compile --json` writes that the comparison reads.
    report = more | {"topology": "v5p:2x2x1", "devices": devices, "config": "configs/llama3_debug.toml",
              "peak_per_chip_bytes": 3.0e8, "flops_per_chip": 8.0e10,
              "memory_per_chip_bytes": {"arguments": 1.7e7, "outputs": 1.7e7, "aliased": 1.6e7,
                                        "temporaries": 2.2e8, "code": 5.8e7}}
    path = tmp_path / "xla.json"
    path.write_text(json.dumps(report))
    return path


def test_plan_prints_xla_beside_its_own(tmp_path, capsys):
    path = _report(tmp_path)
    assert main(["plan", *CONFIG, "--xla", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = for_planning("configs/llama3_debug.toml", [])
    hardware, chips = resolve_hardware("v5p-8", dtype=cfg.model.dtype)
    plan = plan_config(cfg, hardware, chips=chips)
    compiled = plan_config(cfg, hardware, chips=chips, as_compiled=True)  # donated update: less than the plan
    assert compiled.peak_bytes < plan.peak_bytes
    assert out["xla"]["plan_peak_bytes"] == pytest.approx(plan.peak_bytes)
    assert out["xla"]["plan_peak_as_compiled_bytes"] == pytest.approx(compiled.peak_bytes)
    assert out["xla"]["peak_ratio"] == pytest.approx(compiled.peak_bytes / 3.0e8)
    assert out["xla"]["flops_ratio"] == pytest.approx(plan.flops["executed_per_step_per_device"] / 8.0e10)
    assert main(["plan", *CONFIG, "--xla", str(path)]) == 0
    text = capsys.readouterr().out
    assert "XLA's TPU compiler (compile-only, v5p:2x2x1" in text and "0.300 GB" in text


def test_plan_compares_flops_counted_as_xla_counts(tmp_path, capsys):
    """With the report's formula counted as XLA counts (scanned loop bodies once, no work inside
    the Pallas kernels), the FLOPs ratio is that against XLA's, and the plan's whole step beside."""
    path = _report(tmp_path, formula_as_xla_counts_per_chip=7.6e10)
    assert main(["plan", *CONFIG, "--xla", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["xla"]["flops_ratio"] == pytest.approx(0.95)
    assert main(["plan", *CONFIG, "--xla", str(path)]) == 0
    assert "our formula counted so 0.076 TFLOP (0.950x XLA's)" in capsys.readouterr().out


def test_plan_refuses_a_report_of_another_slice_or_no_report(tmp_path, capsys):
    assert main(["plan", *CONFIG, "--xla", str(_report(tmp_path, devices=8))]) != 0
    err = capsys.readouterr().err.strip()
    assert "compiled for 8 chips (v5p:2x2x1), the plan is for 4" in err and "\n" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", *CONFIG, "--xla", str(bad)]) != 0
    err = capsys.readouterr().err.strip()
    assert "not a report of `titan-tpu compile --json`" in err and "\n" not in err


def test_plan_compares_with_the_matmuls_of_xla_program_where_the_report_has_them(tmp_path, capsys):
    """Our formula counts matmuls only: with the matmul FLOPs of XLA's optimized program in the
    report, the ratio is against them, not cost analysis's total (elementwise work included)."""
    path = _report(tmp_path, formula_as_xla_counts_per_chip=7.6e10, xla_matmul_flops_per_chip=7.6e10)
    assert main(["plan", *CONFIG, "--xla", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["xla"]["flops_ratio"] == pytest.approx(1.0)


def test_plan_of_a_shipped_tpu_recipe_shows_its_compile(tmp_path, capsys):
    """`titan-tpu plan` of a TPU recipe XLA compiled as it stands prints XLA's numbers from the
    recipe's report (bench/results/xla) with no flag; an override, or a recipe changed since its
    compile, plans a program XLA never saw, and prints none."""
    from titan_tpu.tools.recipe_table import REPORTS

    recipe = "configs/qwen3_8b_tpu.toml"
    report = json.loads((REPORTS / "qwen3_8b_tpu.json").read_text())
    assert main(["plan", "--config", recipe, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["xla"]["xla_peak_bytes"] == report["peak_per_chip_bytes"]
    assert out["xla"]["topology"] == report["topology"]
    assert main(["plan", "--config", recipe]) == 0
    assert f"XLA's TPU compiler (compile-only, {report['topology']}, {report['date']}" in capsys.readouterr().out
    assert main(["plan", "--config", recipe, "--training.batch_size", "1", "--json"]) == 0
    assert "xla" not in json.loads(capsys.readouterr().out)
    commented = tmp_path / "commented" / "qwen3_8b_tpu.toml"  # a comment changes nothing XLA compiled
    commented.parent.mkdir()
    commented.write_text(Path(recipe).read_text() + "# a note added since its compile\n")
    assert main(["plan", "--config", str(commented), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["xla"]["xla_peak_bytes"] == report["peak_per_chip_bytes"]
    changed = tmp_path / "qwen3_8b_tpu.toml"  # a setting changed since its compile: not that program
    text = Path(recipe).read_text()
    assert "\nsteps = 1000\n" in text
    changed.write_text(text.replace("\nsteps = 1000\n", "\nsteps = 999\n"))
    assert main(["plan", "--config", str(changed), "--json"]) == 0
    assert "xla" not in json.loads(capsys.readouterr().out)


# Two programs in XLA's optimized-HLO text form: a dot, and a convolution whose padded window
# reaches outside its input (the form XLA gives batched and outer products); a while loop's body
# holds the dot, counted once as XLA's cost analysis counts it.
_HLO = "\n".join([
    "HloModule m",
    "",
    "%fused_computation.1 (param_0.1: bf16[8,64], param_1.1: bf16[64,32]) -> bf16[8,32] {",
    "  %param_0.1 = bf16[8,64]{1,0:T(8,128)(2,1)} parameter(0)",
    "  %param_1.1 = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(1)",
    "  ROOT %dot.1 = bf16[8,32]{1,0:T(8,128)(2,1)} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, "
    'rhs_contracting_dims={0}, metadata={op_name="jit(local)/while/body/dot_general"}',
    "}",
    "",
    "%fused_computation.2 (param_0.2: bf16[2,16,40,30], param_1.2: bf16[32,16,7,4]) -> bf16[2,32,42,29] {",
    "  %param_0.2 = bf16[2,16,40,30]{3,2,1,0} parameter(0)",
    "  %param_1.2 = bf16[32,16,7,4]{3,2,1,0} parameter(1)",
    "  ROOT %convolution.2 = bf16[2,32,42,29]{3,2,1,0} convolution(%param_0.2, %param_1.2), "
    "window={size=7x4 pad=3_5x2_0}, dim_labels=bf01_oi01->bf01",
    "}",
    ""])


def test_matmul_flops_counts_dots_and_the_taps_inside_a_convolution_input(tmp_path):
    from titan_tpu.xla.dump import matmul_flops

    (tmp_path / "p.txt").write_text(_HLO)
    (tmp_path / "p-live-range.txt").write_text("")

    def taps(n, k, low, out):  # (output position, tap) pairs reading inside the input, by brute force
        return sum(1 for t in range(k) for p in range(out) if 0 <= p + t - low < n)

    dot = 2 * 8 * 32 * 64
    convolution = 2 * 2 * 32 * 16 * taps(40, 7, 3, 42) * taps(30, 4, 2, 29)
    assert convolution < 2 * 2 * 32 * 42 * 29 * 16 * 7 * 4  # the padding's taps are not counted
    assert matmul_flops(tmp_path / "p") == dot + convolution


def test_placed_values_read_the_temporaries_allocation_with_offsets_and_live_ranges(tmp_path):
    """The largest preallocated-temp allocation's values, highest end first, each with its live range;
    a loop carry without one in the live-range file is still placed (the peak section leaves it out)."""
    from titan_tpu.xla.dump import live_in_allocation, placed_values

    (tmp_path / "p-buffer-assignment.txt").write_text(
        "allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:\n"
        " value: <1 param.0 @0> (size=64,offset=0): f32[16]{0}\n"
        "allocation 1: size 96, page 0, preallocated-temp:\n"
        " value: <2 fusion.1 @0> (size=32,offset=0): bf16[16]{0:T(128)}\n"
        " value: <3 fusion.2{1} @0> (size=48,offset=48): f32[12]{0}\n"
        " value: <4 while.3{2} @0> (size=16,offset=32): f32[4]{0}\n"
        "allocation 2: size 8, page 0, preallocated-temp:\n"
        " value: <5 fusion.4 @0> (size=8,offset=0): f32[2]{0}\n")
    (tmp_path / "p-live-range.txt").write_text(
        "HloLiveRange (max 9):\n  BufferLiveRange:\n    fusion.1{}:1-4\n    fusion.2{1}:3-6\n    param.0{}:0-9\n")
    values = placed_values(tmp_path / "p")
    assert [(v.name, v.offset, v.bytes, v.shape, v.live) for v in values] == [
        ("fusion.2{1}", 48, 48, "f32[12]", (3, 6)), ("while.3{2}", 32, 16, "f32[4]", None),
        ("fusion.1", 0, 32, "bf16[16]", (1, 4))]
    at, alive = live_in_allocation(values)
    assert at == 3 and [v.name for v in alive] == ["fusion.2{1}", "fusion.1"]
    assert [v.name for v in live_in_allocation(values, at=5)[1]] == ["fusion.2{1}"]


# A layer loop as lax.scan leaves it after XLA's passes (its trip count in the condition), the body
# calling a fusion with a dot and running an inner loop whose trip count XLA knows.
_LOOP_HLO = "\n".join([
    "HloModule loops",
    "",
    "%fused_dot (p0: bf16[8,64], p1: bf16[64,32]) -> bf16[8,32] {",
    "  %p0 = bf16[8,64]{1,0} parameter(0)",
    "  %p1 = bf16[64,32]{1,0} parameter(1)",
    "  ROOT %dot.1 = bf16[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "}",
    "",
    "%inner_body (q: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {",
    "  %q = (s32[], bf16[8,64]) parameter(0)",
    "  %x = bf16[8,64]{1,0} get-tuple-element(%q), index=1",
    "  %dot.2 = bf16[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}",
    "  ROOT %t = (s32[], bf16[8,64]) tuple(%i, %x)",
    "}",
    "",
    "%inner_cond (q: (s32[], bf16[8,64])) -> pred[] {",
    "  ROOT %c = pred[] constant(true)",
    "}",
    "",
    "%layer_body (p: (s32[], bf16[8,64], bf16[64,32])) -> (s32[], bf16[8,64], bf16[64,32]) {",
    "  %p = (s32[], bf16[8,64], bf16[64,32]) parameter(0)",
    "  %a = bf16[8,64]{1,0} get-tuple-element(%p), index=1",
    "  %w = bf16[64,32]{1,0} get-tuple-element(%p), index=2",
    "  %fusion.1 = bf16[8,32]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot",
    '  %while.2 = (s32[], bf16[8,64]) while(%t0), condition=%inner_cond, body=%inner_body, '
    'backend_config={"known_trip_count":{"n":"3"}}',
    "  ROOT %r = (s32[], bf16[8,64], bf16[64,32]) tuple(%i, %a, %w)",
    "}",
    "",
    "%layer_cond (p: (s32[], bf16[8,64], bf16[64,32])) -> pred[] {",
    "  %constant.7 = s32[]{:T(128)} constant(36)",
    "  %p = (s32[], bf16[8,64], bf16[64,32]) parameter(0)",
    "  %i = s32[]{:T(128)} get-tuple-element(%p), index=0",
    "  ROOT %lt.1 = pred[]{:T(512)} compare(%i, %constant.7), direction=LT",
    "}",
    "",
    "ENTRY %main (a: bf16[8,64], w: bf16[64,32]) -> bf16[8,32] {",
    "  %a = bf16[8,64]{1,0} parameter(0)",
    "  %w = bf16[64,32]{1,0} parameter(1)",
    "  %while.1 = (s32[], bf16[8,64], bf16[64,32]) while(%t), condition=%layer_cond, body=%layer_body",
    "  ROOT %fusion.9 = bf16[8,32]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot",
    "}",
    ""])


def test_matmul_flops_as_run_count_a_loop_body_its_trip_count_times(tmp_path):
    """XLA's cost analysis counts a while loop's body once; as_run counts it as often as it runs: the
    layer loop's 36 trips read from its condition (i < 36), an inner loop's 3 from XLA's known trip
    count, a fusion as often as its caller."""
    from titan_tpu.xla.dump import computation_runs, matmul_flops

    (tmp_path / "p.txt").write_text(_LOOP_HLO)
    (tmp_path / "p-live-range.txt").write_text("")
    runs = computation_runs(_LOOP_HLO)
    assert (runs["main"], runs["layer_body"], runs["inner_body"], runs["fused_dot"]) == (1, 36, 108, 37)
    projection, gram = 2 * 8 * 32 * 64, 2 * 8 * 8 * 64
    assert matmul_flops(tmp_path / "p") == projection + gram  # each instruction once
    assert matmul_flops(tmp_path / "p", as_run=True) == 37 * projection + 108 * gram
