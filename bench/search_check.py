"""`titan-tpu plan --search` against real runs: train the search's top 3 and 3 other fitting
candidates on this CPU and compare the measured tokens/s with the prediction.

    python bench/search_check.py --config configs/llama3_debug.toml
    python bench/search_check.py --config configs/llama3_debug.toml --hardware cpu-2 --keep model.scan_layers
    python bench/search_check.py --config configs/llama3_debug.toml --training.mode graph

Each candidate trains six steps in a fresh process (torchrun for several ranks) exactly as `titan-tpu
plan --calibrate` runs its configurations (plan/calibrate.py: validation and checkpoints off, the
best tokens/s of steps 2-6); the "others" are spread over the rest of the ranking (a third, two
thirds and the end of it). The check: the search's first choice reaches 0.9 of the best measured
tokens/s. The CPU's peak and copy rate are measured by the search in the same sitting. Run it
alone on the machine (`/work/notes/cpu measure` where it is shared). Prints a markdown table and
writes <out>/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from titan_tpu.plan import resolve_hardware
from titan_tpu.plan.calibrate import Case, _run_case
from titan_tpu.plan.search import search
from titan_tpu.plan.setting import for_planning


def picks(fitting: list, top: int = 3, others: int = 3) -> list[tuple[str, object]]:
    """The first `top` candidates and `others` spread over the rest (by rank)."""
    chosen = [(f"#{i + 1}", c) for i, c in enumerate(fitting[:top])]
    rest = fitting[top:]
    idx = range(len(rest)) if len(rest) <= others else \
        sorted({min(len(rest) - 1, round(len(rest) * k / others)) for k in range(1, others + 1)})
    chosen += [(f"#{top + i + 1}", rest[i]) for i in idx]
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--hardware", default="cpu", help="cpu or cpu-N (N ranks)")
    parser.add_argument("--keep", default="", help="as for titan-tpu plan --search")
    parser.add_argument("--out", default="outputs/search_check")
    return parser


def main() -> int:
    args, overrides = build_parser().parse_known_args()
    base = for_planning(args.config, overrides)
    hardware, chips = resolve_hardware(args.hardware)
    result = search(base, hardware, chips=chips, keep=[k for k in args.keep.split(",") if k])
    print(f"search: {result.total} candidates, {len(result.fitting)} fit; CPU peak {hardware.peak_flops / 1e9:.0f} "
          f"GFLOP/s, copy {hardware.memory_bandwidth / 1e9:.1f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rank, cand in picks(result.fitting):
        case = Case(f"{Path(args.config).stem} {rank}", args.config, tuple(overrides) + tuple(cand.changes),
                    ranks=result.devices)
        measured = _run_case(case, out, tokenizer="", python=sys.executable)
        rows.append({"rank": rank, "describe": cand.describe(), "overrides": cand.changes,
                     "predicted": cand.plan.tokens_per_s, "measured": measured["measured_tokens_per_s"],
                     "steps": measured["step_tokens_per_s"]})
        print(f"{rank}: predicted {cand.plan.tokens_per_s:,.0f}, measured {rows[-1]['measured']:,.0f} tok/s "
              f"({cand.describe()})", flush=True)
    best = max(r["measured"] for r in rows)
    print("\n| rank | configuration | predicted tok/s | measured tok/s | of best measured |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rank']} | {r['describe']} | {r['predicted']:,.0f} | {r['measured']:,.0f} | "
              f"{r['measured'] / best:.2f} |")
    first = rows[0]["measured"] / best
    print(f"first choice at {first:.2f} of the best measured: {'within' if first >= 0.9 else 'NOT within'} 10%")
    name = f"{Path(args.config).stem}_{args.hardware}_{'_'.join(o.strip('-') for o in overrides)}"[:120]
    (out / f"{name}.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": args.config, "overrides": overrides,
        "hardware": args.hardware, "peak_flops": hardware.peak_flops, "rows": rows, "first_of_best": first}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
