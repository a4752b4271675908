"""The plan beside XLA's numbers for the same program (a `titan-tpu compile --json` report):
the peak per chip beside the plan of the compiled program, and XLA's FLOPs beside our formula
counted as XLA counts them (`formula_as_xla_counts`: loop bodies once, no work inside the Pallas
kernels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_tpu.parallel.pipeline import PipelineSchedule

__all__ = ["compared_flops", "formula_as_xla_counts", "xla_beside_plan"]


def compared_flops(report: dict) -> float | None:
    """The XLA count our formula is compared with: the matmul FLOPs of XLA's optimized program where
    the report has them (our formula counts matmuls only; under expert parallelism XLA's cost
    analysis adds much elementwise work on the dispatch buffers), else its cost analysis's total."""
    return report.get("xla_matmul_flops_per_chip") or report["flops_per_chip"]


def xla_beside_plan(plan, path: str, compiled=None) -> tuple[str, dict]:
    """(lines for `titan-tpu plan --xla PATH`, the comparison as a dict): XLA's per-chip numbers
    from a saved `titan-tpu compile --json` report beside the plan's. The report must be of the
    same number of chips; its config is named in it, so a report of another recipe is visible.
    compiled: the plan of the compiled program (planner `as_compiled`), whose peak is the one
    compared with XLA's; default: `plan`'s."""
    try:
        report = json.loads(Path(path).read_text())
        xla_peak, xla_flops = report["peak_per_chip_bytes"], compared_flops(report)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--xla {path}: not a report of `titan-tpu compile --json` ({type(e).__name__}: {e}); "
                         "save one with titan-tpu compile --config ... --json > xla.json") from e
    if report["devices"] != plan.devices:
        raise ValueError(f"--xla {path}: compiled for {report['devices']} chips ({report['topology']}), the plan is "
                         f"for {plan.devices}; compile the same slice (--hardware) or plan its size")
    compiled = compiled or plan
    plan_flops = plan.flops["executed_per_step_per_device"]
    # XLA counts a scanned loop's body once and no work inside a Pallas kernel: the comparison is
    # with our formula counted the same way (the report's), where the report has it.
    counted = report.get("formula_as_xla_counts_per_chip")
    compared = counted if counted else plan_flops
    beside = {"config": report.get("config"), "topology": report["topology"], "xla_peak_bytes": xla_peak,
              "plan_peak_bytes": plan.peak_bytes, "plan_peak_as_compiled_bytes": compiled.peak_bytes,
              "peak_ratio": compiled.peak_bytes / xla_peak,
              "xla_flops": xla_flops, "plan_flops": plan_flops, "formula_as_xla_counts": counted,
              "flops_ratio": compared / xla_flops if xla_flops else None,
              "xla_memory_bytes": report["memory_per_chip_bytes"]}
    kinds = report["memory_per_chip_bytes"]
    made = f", {report['date']}" if report.get("date") else ""
    lines = [f"XLA's TPU compiler (compile-only, {report['topology']}{made}, from {path}"
             f"{', config ' + report['config'] if report.get('config') else ''}), per chip beside the plan:",
             f"  peak {xla_peak / 1e9:.3f} GB (arguments {kinds['arguments'] / 1e9:.3f}, temporaries "
             f"{kinds['temporaries'] / 1e9:.3f}, code {kinds['code'] / 1e9:.3f}); plan of the compiled program "
             f"{compiled.peak_bytes / 1e9:.3f} GB ({beside['peak_ratio']:.2f}x XLA's; as a TPU runs it "
             f"{plan.peak_bytes / 1e9:.3f} GB)"]
    if xla_flops and counted:
        counted_in = ("in the dots and convolutions of its program" if report.get("xla_matmul_flops_per_chip")
                      else "by its cost analysis")
        lines.append(f"  FLOPs per step {xla_flops / 1e12:,.3f} TFLOP {counted_in} (scanned loop bodies once, no "
                     f"work inside the Pallas kernels); our formula counted so {counted / 1e12:,.3f} TFLOP "
                     f"({beside['flops_ratio']:.3f}x XLA's); the plan's whole step {plan_flops / 1e12:,.3f} TFLOP")
    elif xla_flops:
        lines.append(f"  FLOPs per step {xla_flops / 1e12:,.3f} TFLOP; plan executed {plan_flops / 1e12:,.3f} TFLOP "
                     f"({beside['flops_ratio']:.3f}x XLA's)"
                     + ("; XLA counted the scanned layers' loop bodies once, so these differ by about the "
                        "layer count" if report.get("loop_body_counted_once") else ""))
    return "\n".join(lines), beside


def formula_as_xla_counts(cfg, kernels_used: dict, tokens_per_chip: float, *, schedule: PipelineSchedule | None,
                          topology: str) -> float | None:
    """Our FLOP formula counted as XLA's cost analysis counts the compiled step (models/registry.py
    flops_per_token_as_xla_counts): a scanned stack's loop body once, nothing inside the Mosaic
    custom calls (splash attention, megablox's gmm and tgmm), full checkpointing's rerun of the
    forward, a frozen reference's forwards (DPO's), and on tpu7x the logits of tokamax's plain-XLA loss computed
    twice (XLA rematerializes them there). schedule: the run's pipeline schedule (run/resolved.py), None
    without stages. topology: the slice compiled for, e.g. "v5p:2x2x1". None for a model without native
    args (an HF directory)."""
    from titan_tpu.kinds import kind_of
    from titan_tpu.models.registry import flops_per_token_as_xla_counts
    from titan_tpu.models.spec import model_spec

    spec = model_spec(cfg.model)
    if spec.kind != "native":
        return None
    args = spec.args
    # Pipeline stages unroll their rows (no loop body counted once), and in the one program every
    # stage computes in every iteration, the bubble's too.
    looped = cfg.model.scan_layers and schedule is None
    attention = kernels_used.get("attention", "").split()[0] if kernels_used.get("attention") else ""
    mode = "kernel" if attention.startswith("splash") else "full" if attention in ("sdpa", "reference") else "causal"
    per_token = flops_per_token_as_xla_counts(
        args, cfg.training.seq_len, layers_counted=1 if looped else args.n_layers + args.mtp_num_layers,
        recompute=cfg.activation_checkpoint.mode == "full", attention=mode,
        experts_in_kernel=kernels_used.get("grouped_mm", "").startswith("gmm"), frozen_base=cfg.lora.enabled,
        reference_forwards=kind_of(cfg).reference_forwards(cfg),
        logits_recomputed=topology.startswith("tpu7x") and kernels_used.get("loss", "").startswith("tokamax"),
        blocks_repeated=1.0 if schedule is None else schedule.iterations / (schedule.iterations - schedule.stages + 1))
    return per_token * tokens_per_chip
