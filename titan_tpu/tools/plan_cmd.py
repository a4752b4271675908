"""`titan-tpu plan`: its arguments (`_parser`), then the calibration, the search (and its
certification by XLA), or one plan printed with what goes beside it (`_beside`: XLA's numbers for
the same program, the step as TorchTPU runs it, the other precision).

A tool beside compile_cmd.py: it prints what tools/ compiles and certifies beside the plan.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv: list[str]) -> int:
    """`titan-tpu plan ARGV`: the plan (or the search, or the calibration), printed."""
    args, overrides = _parser().parse_known_args(argv)
    if args.calibrate:
        from titan_tpu.plan.calibrate import calibrate_main

        return calibrate_main(out_dir=args.out, replay=args.replay, only=args.only)
    if not args.config:
        raise ValueError("titan-tpu plan needs --config (a TOML recipe), or --calibrate")
    import sys

    from titan_tpu.config import build_config
    from titan_tpu.plan import format_plan, resolve_hardware
    from titan_tpu.plan.planner import plan_run
    from titan_tpu.plan.setting import setup_for_planning
    from titan_tpu.tools.hf_shape_dir import ensure

    # A recipe's weightless stand-in of a Transformers-backend model's directory (the VLM recipe's), made
    # here on a fresh clone as compile makes it; said on stderr (--json's stdout).
    ensure(build_config(args.config, overrides).model.hf_config, log=lambda message: print(message, file=sys.stderr))
    setup = setup_for_planning(args.config, overrides)
    cfg = setup.cfg
    hardware, chips = resolve_hardware(args.hardware, dtype=cfg.model.dtype) if args.hardware else (None, None)
    if chips is not None and hardware.name != "cpu" and not hardware.devices_per_node:
        chips *= cfg.parallelism.slices  # a TPU slice name is one of parallelism.slices (MaxText's compile_topology)
    if args.certify and not args.search:
        raise ValueError("--certify K certifies the search's best K: add --search")
    if args.search:
        return _search(args, overrides, cfg, hardware, chips)
    if args.storage_gbps <= 0 or args.local_gbps <= 0:
        raise ValueError(f"--storage-gbps {args.storage_gbps:g} and --local-gbps {args.local_gbps:g} must be > 0")
    plan = plan_run(setup, hardware, chips=chips, gather=args.gather, storage_gbps=args.storage_gbps,
                    local_gbps=args.local_gbps)
    extra, lines = _beside(args, overrides, setup, plan, hardware, chips)
    if args.json:
        print(json.dumps({**json.loads(plan.to_json()), **extra}, indent=2))
    else:
        print("\n".join([format_plan(plan, explain=args.explain), *lines]))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-tpu plan",
        description="Predict per-device memory, FLOPs, communication, step time, tokens/s and MFU of a run "
                    "from its config, before touching the hardware (docs/planner.md). Config overrides as "
                    "for train.")
    parser.add_argument("--config", help="TOML recipe, e.g. configs/qwen3_235b_a22b_tpu.toml")
    parser.add_argument("--hardware", help="v4, v5e, v5p, v6e, v7, h100, h200, b200 or cpu, with a size as "
                                           "Google names slices (v5p-1024: 512 chips) or a device count (h100-8); "
                                           "with parallelism.slices N, one of the N slices; default: what the "
                                           "config names")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--explain", action="store_true", help="after the plan, what each of its terms means")
    parser.add_argument("--gather", default=None, choices=["model", "layer"],
                        help="what-if for gathered block weights: layer (re-sharded after the forward, gathered "
                             "again per layer) or model (kept from forward to backward); default: what the code "
                             "does with the config (parallelism.reshard_after_forward)")
    parser.add_argument("--search", action="store_true",
                        help="plan activation checkpointing, scan, re-sharding, bucket size, micro-batch x "
                             "accumulation (same global batch), dp_replicate x dp_shard and ep, and rank what fits "
                             "by predicted tokens/s (docs/playbook.md)")
    parser.add_argument("--keep", default="",
                        help="with --search: config keys to hold at the config's value, "
                             "comma-separated (e.g. activation_checkpoint.mode,model.scan_layers)")
    parser.add_argument("--top", type=int, default=5, help="with --search: how many ranked configurations to print")
    parser.add_argument("--allow-fp8", action="store_true",
                        help="with --search: plan each candidate with fp8 matmuls too ([fp8] enabled: they change the "
                             "numbers the run computes, so never without this flag), on hardware with an fp8 peak "
                             "(tpu7x, h100, h200, b200)")
    parser.add_argument("--certify", type=int, metavar="K", default=0,
                        help="with --search: compile the K best with XLA's TPU compiler for the slice and keep those "
                             "XLA accepts and fits, in the planner's order (needs .venv-tpu; minutes per candidate)")
    parser.add_argument("--xla", metavar="JSON",
                        help="a saved `titan-tpu compile --json` report of the same config and slice: XLA's "
                             "per-chip peak and FLOPs printed beside the plan's")
    parser.add_argument("--torchtpu", action="store_true",
                        help="after the plan, the step as TorchTPU runs it: one program (the trainer's call) and "
                             "split at every collective (torch-tpu's Dynamo backend as it is); plan/torchtpu.py")
    parser.add_argument("--storage-gbps", type=float, default=1.0,
                        help="write bandwidth of the checkpoint storage, GB/s for the whole job (default 1.0): the "
                             "persistent checkpoint's time, against checkpoint.grace_seconds")
    parser.add_argument("--local-gbps", type=float, default=5.0,
                        help="write bandwidth of each device's local checkpoint tier, GB/s (default 5.0)")
    parser.add_argument("--calibrate", action="store_true",
                        help="run real CPU configurations and print predicted vs measured (minutes; run alone)")
    parser.add_argument("--replay", action="store_true", help="with --calibrate: recompute from the saved results")
    parser.add_argument("--only", help="with --calibrate: only the configurations whose name contains this "
                                       "(several: a|b)")
    parser.add_argument("--out", default="outputs/plan_calibration", help="with --calibrate: where runs and "
                                                                             "results go")
    return parser


def _search(args: argparse.Namespace, overrides: list[str], cfg, hardware, chips: int | None) -> int:
    """`plan --search` (and `--certify K`): rank the layouts that fit, print the best."""
    from titan_tpu.plan.search import format_search, search, search_json

    keep = [k.strip() for k in args.keep.split(",") if k.strip()]
    result = search(cfg, hardware, chips=chips, keep=keep, allow_fp8=args.allow_fp8)
    if not args.certify:
        print(search_json(result, top=args.top) if args.json else format_search(result, top=args.top))
        return 0
    from titan_tpu.tools.certify import certified_json, certify, format_certified

    if not args.json:
        print(format_search(result, top=args.top), flush=True)
    certified = certify(result, args.config, overrides, top=args.certify,
                        log=(lambda line: None) if args.json else print)
    print(certified_json(result, certified, top=args.top) if args.json else format_certified(certified))
    return 0


def _beside(args: argparse.Namespace, overrides: list[str], setup, plan, hardware,
                 chips: int | None) -> tuple[dict, list[str]]:
    """What `plan` prints after the plan, and adds to its JSON: XLA's numbers for the same
    program, the step as TorchTPU runs it, the other precision where fp8 can pay."""
    from titan_tpu.plan.planner import plan_run

    cfg = setup.cfg
    extra, lines = {}, []
    # XLA's numbers beside the plan: the report given, or a shipped recipe's own compile report when
    # the plan is of the recipe as it stands (no override, its own slice), which XLA compiled.
    xla = args.xla
    if not xla and not overrides and not args.hardware and not args.gather:
        from titan_tpu.tools.recipe_table import saved_report

        xla = saved_report(args.config)
        xla = xla and os.path.relpath(xla)
    if xla:
        from titan_tpu.plan.xla_compare import xla_beside_plan

        # XLA compiled the program titan-tpu compile hands it: compare the plan of that program.
        compiled = plan_run(setup, hardware, chips=chips, gather=args.gather, as_compiled=True)
        xla_lines, extra["xla"] = xla_beside_plan(plan, xla, compiled=compiled)
        lines.append(xla_lines)
    if args.torchtpu:
        import dataclasses

        from titan_tpu.plan.torchtpu import torchtpu_lines

        # The step as TorchTPU would run it, also for a recipe that runs the JAX path.
        on_torchtpu = plan if cfg.compile.backend == "tpu" else plan_run(
            dataclasses.replace(setup, cfg=dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile,
                                                                                                backend="tpu"))),
            hardware, chips=chips, gather=args.gather, storage_gbps=args.storage_gbps, local_gbps=args.local_gbps)
        torchtpu, extra["torchtpu"] = torchtpu_lines(on_torchtpu)
        lines.append(torchtpu)
    if plan.hardware["fp8_peak_flops"] or "fp8" in plan.batch:
        # Where fp8 can pay, or the recipe asks for it: the same hardware (this CPU is not measured
        # again) and chips, the other precision.
        from titan_tpu.plan.fp8 import fp8_beside
        from titan_tpu.plan.hardware import Hardware

        other = plan_run(setup, Hardware(**plan.hardware), chips=plan.devices // plan.hardware["devices_per_chip"],
                         gather=args.gather, fp8="fp8" not in plan.batch)
        fp8_lines, extra["fp8_vs_bf16"] = fp8_beside(plan, other)
        lines.insert(0, fp8_lines)
    return extra, lines
