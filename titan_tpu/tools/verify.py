"""`titan-tpu verify MODEL`: check a model end to end before a long run.

MODEL is a native name/flavor (llama3/8B), a Hugging Face directory (config.json, with or without
weights) or a transformers model type (with --overrides). Each check prints one line, PASS / WARN /
FAIL with its measured number and threshold, or SKIP with the reason it could not run; the exit
status is 0 only without FAIL; report.json and report.md go to --report DIR.

    preflight  backend, feature table (supported / falls back / blocker), parameters, FLOPs per token
    weights    HF -> ours -> HF round trip exact, no missing or extra tensor (both MoE layouts)
    numerics   against unmodified transformers, fp32, same weights: per-token KL, max |logit diff|,
               top-1 agreement on a short and a >= 512-token sequence; loss and first-step gradients
    train      loss falls over 20 steps on the embedded corpus
    rerun      the same seed reruns bitwise
    graph      the captured step equals the eager step (or the capture error names the op and module)
    ac         full activation checkpointing equals none
    fsdp       2 fully_shard ranks equal one process
    scan       scanned layers equal unrolled ones (native)
    resume     checkpoint + resume is bitwise
    export     export, then transformers' from_pretrained holds the trained weights exactly and gives our logits
    plan       titan-tpu plan of the real-size config (native or hf) on --hardware: fits or not, what to change, MFU

--tiny shrinks the config first (one layer of each kind, small sizes, as hf-sweep does), so that a
70B config verifies on a CPU in minutes; the plan check still plans the real size.

A vision-language directory or type (Qwen2.5-VL, Gemma 3, LLaVA; a directory with its image processor's
files) is checked on rows with an image in their slot (verify_checks.py `token_batch`); --tiny shrinks
its vision tower too.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
import time
from pathlib import Path

from titan_tpu.tools import verify_checks as checks
from titan_tpu.tools.subject import Subject, resolve

CHECKS = ("preflight", "weights", "numerics", "train", "rerun", "graph", "ac", "fsdp", "scan", "resume", "export",
          "plan")


def parse_checks(text: str | None) -> tuple[str, ...]:
    if not text:
        return CHECKS
    chosen = tuple(c.strip() for c in text.split(",") if c.strip())
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r} in --checks; choose from {', '.join(CHECKS)}")
    return chosen


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_check(name: str, subject: Subject, *, hardware: str) -> checks.Result:
    fn = getattr(checks, f"check_{name}")
    start = time.perf_counter()
    try:
        result = fn(subject, hardware) if name == "plan" else fn(subject)
    except Exception as e:  # noqa: BLE001 - a check that raises fails, with the error as its measurement
        result = checks.Result(name, "FAIL", f"raised {_first_line(e)}")
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def format_line(r: checks.Result) -> str:
    threshold = f"  [threshold: {r.threshold}]" if r.threshold else ""
    return f"{r.status:<4}  {r.check:<9} {r.measured}{threshold}  ({r.seconds:.1f} s)"


def verify(spec: str, *, hardware: str = "v5p-256", tiny: bool = False, only: tuple[str, ...] = CHECKS,
           report_dir: Path | None = None, overrides: dict | None = None, print_fn=print) -> dict:
    """Run the checks; returns the report (also written to report_dir when given)."""
    from titan_tpu.plan import resolve_hardware

    resolve_hardware(hardware, measure=False)  # an unknown name fails before any work
    with tempfile.TemporaryDirectory(prefix="titan_tpu_verify_") as tmp:
        start = time.perf_counter()
        subject = resolve(spec, work_dir=Path(tmp), tiny=tiny, overrides=overrides)
        setup_s = time.perf_counter() - start
        print_fn(f"verify {spec}: backend {subject.backend}, weights: {subject.weights}"
                 f"{' (--tiny)' if tiny else ''}  (setup {setup_s:.1f} s)")
        results = []
        for name in only:
            result = run_check(name, subject, hardware=hardware)
            results.append(result)
            print_fn(format_line(result))
    failed = [r.check for r in results if r.status == "FAIL"]
    report = {"model": spec, "backend": subject.backend, "native_name": subject.native_name, "tiny": tiny,
              "weights": subject.weights, "hardware": hardware, "date": datetime.date.today().isoformat(),
              "setup_seconds": round(setup_s, 2), "status": "FAIL" if failed else "PASS", "failed": failed,
              "checks": [dataclasses.asdict(r) for r in results]}
    print_fn(f"verify {spec}: {'FAIL (' + ', '.join(failed) + ')' if failed else 'no FAIL'}; "
             f"{time.perf_counter() - start:.1f} s in all")
    if report_dir is not None:
        write_report(report, Path(report_dir))
    return report


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# titan-tpu verify {report['model']}", "",
             f"{report['date']}; backend {report['backend']}; weights: {report['weights']}; "
             f"{'--tiny; ' if report['tiny'] else ''}hardware for the plan: {report['hardware']}.", "",
             f"**{report['status']}**" + (f": {', '.join(report['failed'])} failed" if report["failed"] else ""), "",
             "| check | status | measured | threshold | s |", "| --- | --- | --- | --- | --- |"]
    for r in report["checks"]:
        cells = [r["check"], r["status"], r["measured"], r["threshold"], f"{r['seconds']:.1f}"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    features = next((r["details"].get("features") for r in report["checks"] if r["check"] == "preflight"), None)
    if features:
        lines += ["", "## Features", "", "| feature | value | support |", "| --- | --- | --- |"]
        lines += [f"| {f['feature']} | {f['value']} | {f['support']} |" for f in features]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan-tpu verify", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[7:21]))
    parser.add_argument("model", help="native name/flavor (llama3/8B), an HF directory, or a transformers model type")
    parser.add_argument("--hardware", default="v5p-256", help="what the plan check plans for (v5p-256)")
    parser.add_argument("--tiny", action="store_true", help="shrink the config (one layer of each kind, small sizes)")
    parser.add_argument("--checks", help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--report", help="directory for report.json and report.md")
    parser.add_argument("--overrides", default="", help="config changes for an HF type or directory: "
                                                        "hidden_size=64,num_hidden_layers=2 or JSON")
    args = parser.parse_args(argv)

    from titan_tpu.models.hf.config import parse_overrides

    only = parse_checks(args.checks)
    report = verify(args.model, hardware=args.hardware, tiny=args.tiny, only=only,
                    report_dir=Path(args.report) if args.report else None, overrides=parse_overrides(args.overrides))
    if args.report:
        print(f"report written to {args.report}/report.json and report.md")
    return 1 if report["failed"] else 0
