"""The plan as text: the report `titan-tpu plan` prints (`format_plan`, with what each memory term
means: `TERMS`), and what to change when a plan does not fit (`advice`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.config import Config
from titan_tpu.plan.fp8 import fp8_note
from titan_tpu.plan.hardware import Hardware

if TYPE_CHECKING:
    from titan_tpu.plan.result import Plan

__all__ = ["TERMS", "advice", "format_plan"]


def advice(plan: Plan, cfg: Config, *, acts_share: float) -> list[str]:
    """What to change when it does not fit, biggest lever first."""
    if plan.fits:
        return []
    m, out = plan.memory, []
    # Under pipeline stages nothing is re-sharded (a stage keeps its rows): more stages shrink them (below).
    # An hf model is one piece (its parts measured): re-sharding after the forward has no layer to act on.
    if m["gathered_weights"] + m["full_size_gradient"] > 0.25 * plan.peak_bytes and plan.mesh["gather"] == "model" \
            and not plan.pipeline and "parts" not in plan.params:
        out.append(f"the gathered block weights ({m['gathered_weights'] / 1e9:.1f} GB) are kept from the forward to "
                   f"the end of the backward and their full-size gradient reaches {m['full_size_gradient'] / 1e9:.1f} "
                   "GB: more dp_shard does not shrink them; re-sharding after the forward does "
                   "(--parallelism.reshard_after_forward true with bucket_mb > 0; scanned layers in graph mode "
                   "also need --activation_checkpoint.mode full)")
    if cfg.activation_checkpoint.mode != "full" and acts_share > 0.2:
        out.append("--activation_checkpoint.mode full (keeps one [batch, seq, dim] tensor per layer)")
    if acts_share > 0.2 and cfg.training.batch_size > 1:
        out.append(f"a smaller --training.batch_size (now {cfg.training.batch_size}) with "
                   "--training.grad_accum_steps to keep the tokens per step")
    if plan.pipeline:
        out.append(f"more --parallelism.pp (now {plan.pipeline['stages']}): a stage keeps its "
                   f"{plan.pipeline['layers_per_stage']} layers gathered for the step, with their full-size gradient")
    state = m["parameters"] + m["gradients"] + m["optimizer_state"]
    if state > 0.3 * plan.peak_bytes:
        out.append(f"more --parallelism.dp_shard (parameters, gradients and moments are {state / 1e9:.1f} GB per "
                   "device, divided by dp_shard)")
    if cfg.kernels.loss == "reference":
        out.append("--kernels.loss chunked (never holds the whole logits)")
    return out or ["a device with more memory"]


def _batch_unit(mesh: dict) -> str:
    """Who holds a micro-batch: a device, or under cp / tp / pp a group of devices that splits it."""
    split = mesh.get("cp", 1) * mesh.get("tp", 1)
    pp = mesh.get("pp", 1)
    if split * pp == 1:
        return "device"
    if pp > 1:
        return f"data-parallel rank (its {pp} pipeline stages{f' x {split} cp x tp devices' if split > 1 else ''})"
    return f"data-parallel rank (its {split} cp x tp devices each hold 1/{mesh.get('cp', 1)} of every sequence)"


def _parts_lines(plan: Plan) -> list[str]:
    """An hf model's parameters by part, as measured on its meta model (plan/hf_terms.py); none for a
    native model."""
    parts = plan.params.get("parts")
    if parts is None:
        return []
    shown = ", ".join(f"{name.replace('_', ' ')} {parts[name] / 1e6:,.3f} M" for name in
                      ("embedding", "output", "decoder_layers", "vision_tower", "projector", "other") if parts[name])
    return [f"  measured on the model built on the meta device: {shown}; {parts['trained'] / 1e6:,.3f} M trained"]


def _padding_words(pipe: dict) -> str:
    """The pipeline line's words for padding rows (parallel/pipeline.py), "" without."""
    rows = pipe["layers_per_stage"] * pipe["stages"]
    return (f"; {rows - pipe['padding']} layers padded to {rows} rows, {pipe['padding']} identity rows in the last "
            f"chunks counted as layers: {pipe['padding'] / rows:.1%} of the work" if pipe.get("padding") else "")


def _ahead_words(pipe: dict) -> str:
    """The pipeline line's words for the layers ahead of the stages (DeepSeek-V3's dense first layers)."""
    ahead = pipe.get("layers_ahead", 0)
    return f"; {ahead} dense layer{'s' if ahead > 1 else ''} ahead of the stages, whole on every stage" if ahead else ""


def _pipeline_lines(plan: Plan) -> list[str]:
    """What the plan counts for pipeline stages (plan/pipeline_terms.py), under the batch line."""
    pipe = plan.pipeline
    if not pipe:
        return []
    return [f"  pipeline: {pipe['stages']} stages x {pipe['repeats']} repeat{'s' if pipe['repeats'] > 1 else ''} "
            f"({pipe['layers_per_stage']} layers a stage, chunks of {pipe['layers_per_chunk']}{_padding_words(pipe)}"
            f"{_ahead_words(pipe)}), "
            f"{pipe['micro_batches']} micro-batches of {pipe['micro_batch_rows']} row"
            f"{'s' if pipe['micro_batch_rows'] != 1 else ''}, {pipe['iterations']} iterations: bubble "
            f"{pipe['bubble']:.3f} = (pp - 1) / (repeats x micro-batches + pp - 1); memory is the last stage's "
            "(its layers, the weights outside the stack whole, the loss), with every micro-batch's activations "
            "alive at the backward's start"]


def _gb(x: float) -> str:
    return f"{x / 1e9:8.3f} GB"


# What each memory term of a plan is, for `titan-tpu plan --explain` (bytes per device).
TERMS = {
    "fp8_copies": "fp8 recipes: one layer's gathered weights and its largest activation in fp8, alive while its "
                  "matmuls run (added to the backward moment)",
    "fp8_scales": "fp8 recipes: the fp32 scales of one layer's fp8 matmuls (tensorwise 0-dim; rowwise a row and a "
                  "column each)",
    "parameters": "the fp32 master weights this device stores (its shard under dp_shard, its slice under tp/ep)",
    "gradients": "their fp32 gradients, reduced and sharded like the parameters",
    "optimizer_state": "AdamW's two fp32 moments per stored parameter",
    "activations": "what the forward keeps for the backward (per activation-checkpointing mode), for one "
                   "micro-batch",
    "activation_recompute": "the largest block's activations while its forward is recomputed in the backward "
                            "(activation checkpointing)",
    "gathered_weights": "weights all-gathered from the shards for compute, in the compute dtype: one bucket "
                        "(re-gathered per layer) or the whole model (kept from forward to backward; under pipeline "
                        "stages the stage's layers and the weights outside the stack)",
    "full_size_gradient": "the largest gradient alive at full size before its reduce-scatter to this device's shard",
    "scan_saved_copies": "scanned layers: copies of weights and RoPE tables the scan loop saves per layer",
    "scan_flipped": "scanned layers: the reversed copies of the saved stacks the backward loop reads",
    "scan_gradient_stack": "scanned layers: the stacked weight gradients the backward loop writes",
    "loss_kept": "what the output projection + loss kernel keeps from its forward for the backward",
    "loss_peak": "the loss kernel's largest transient (a chunk of logits and what is computed from it)",
    "optimizer_temporary": "AdamW's temporaries during the update (sqrt of the second moment; graph mode's "
                           "out-of-place update also writes fresh parameters and moments)",
    "moe_dispatch": "MoE under ep: what the ep group's tokens add to the activations (counted within them)",
    "runtime": "what the process holds beside the model's tensors (on the CPU: Python, torch, the data "
               "loader, gloo; the compiled step in graph mode)",
    "peak": "the largest sum of the terms alive at one moment (forward end, backward, optimizer step)",
}


def format_plan(plan: Plan, *, explain: bool = False) -> str:
    """The human-readable report `titan-tpu plan` prints; explain appends what each term means."""
    hw, m, b = plan.hardware, plan.memory, plan.batch
    gathered = "re-gathered per layer" if plan.mesh["gather"] == "layer" else "kept forward to backward"
    what_if = ""
    if plan.mesh["gather"] != plan.mesh["code_gather"]:
        what_if = f" (what-if; the code {'re-gathers' if plan.mesh['code_gather'] == 'layer' else 'keeps them'})"
    lines = [
        f"plan for {plan.model} on {plan.devices} x {hw['name']} "
        f"(mesh dp_replicate {plan.mesh['dp_replicate']} x dp_shard {plan.mesh['dp_shard']}"
        f"{', ep ' + str(plan.mesh['ep']) if plan.mesh['ep'] > 1 else ''}"
        f"{' x cp ' + str(plan.mesh.get('cp', 1)) if plan.mesh.get('cp', 1) > 1 else ''}"
        f"{' x pp ' + str(plan.mesh.get('pp', 1)) if plan.mesh.get('pp', 1) > 1 else ''}"
        f"{' x tp ' + str(plan.mesh.get('tp', 1)) if plan.mesh.get('tp', 1) > 1 else ''}"
        f"{'; dp_replicate across ' + str(plan.mesh['slices']) + ' slices' if plan.mesh.get('slices', 1) > 1 else ''}"
        f"; {plan.mesh['mode']}"
        f"; gathered weights: {gathered}{what_if})",
        f"  batch {b['batch_size']} x seq {b['seq_len']} x accum {b['grad_accum_steps']} per "
        f"{_batch_unit(plan.mesh)}, {b['tokens_per_step']:,} tokens/step; {b['dtype']}; "
        f"AC {b['activation_checkpoint']}; "
        f"{'scanned' if b['scan_layers'] else 'unrolled'}; loss {b['loss']}; {b['mode']} mode",
        f"  parameters {plan.params['total'] / 1e9:.3f} B ({plan.params['active'] / 1e9:.3f} B active), "
        f"{plan.params['stored_per_device'] / 1e9:.3f} B stored per device",
        *_parts_lines(plan),
        *_pipeline_lines(plan),
        "memory per device:",
    ]
    for key in ("parameters", "reference", "gradients", "optimizer_state", "activations", "activation_recompute",
                "gathered_weights", "full_size_gradient", "scan_saved_copies", "scan_flipped", "scan_gradient_stack",
                "loss_kept", "loss_peak", "optimizer_temporary",
                "moe_dispatch", "fp8_copies", "fp8_scales", "runtime"):
        if key in m and m[key]:
            note = "  (ep dispatch buffers, within activations)" if key == "moe_dispatch" else ""
            lines.append(f"  {key:22s}{_gb(m[key])}{note}")
    phases = ", ".join(f"{k} {v / 1e9:.3f}" for k, v in m["phases"].items())
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  peak {_gb(plan.peak_bytes)} at {plan.peak_phase} (GB by moment: {phases}); "
                 f"device has {plan.capacity_bytes / 1e9:.1f} GB: {verdict}")
    f = plan.flops
    reference = f" + {f['reference_per_token'] / 1e6:,.1f} of the frozen reference's forward" \
        if "reference_per_token" in f else ""
    lines.append(f"FLOPs: {f['per_token'] / 1e6:,.1f} MFLOP/token (the trainer's count){reference}; per device per "
                 "step "
                 f"{f['model_per_step_per_device'] / 1e12:,.3f} TFLOP model, "
                 f"{f['executed_per_step_per_device'] / 1e12:,.3f} TFLOP executed")
    if "fp8_executed_per_step_per_device" in f:
        lines.append(f"  fp8 ({b['fp8']}): {f['fp8_executed_per_step_per_device'] / 1e12:,.3f} TFLOP of it in the "
                     f"blocks' linears as fp8 matmuls at {plan.time['fp8_peak_flops'] / 1e12:.4g} TFLOP/s; their casts "
                     f"{plan.time['fp8_cast_bytes'] / 1e9:,.1f} GB of elementwise traffic")
        note = fp8_note(Hardware(**hw))
        if note:
            lines.append(f"  note: {note}")
    if plan.communication:
        lines.append("communication per device per step:")
        for c in plan.communication:
            lines.append(f"  {c['kind']:26s} over {c['axis']:15s} ({c['group_size']:>4}): "
                         f"{c['bytes_per_step'] / 1e9:9.3f} GB in {c['calls']:>5} calls at "
                         f"{c['bandwidth'] / 1e9:6.4g} GB/s ({c['fabric']}): "
                         f"{c['bytes_per_step'] / c['bandwidth'] * 1e3:8.1f} ms  {c['purpose']}")
        sources = {c["fabric"]: c["source"] for c in plan.communication}
        lines += [f"  {fabric}: {source}" for fabric, source in sources.items()]
    t = plan.time
    if plan.speed_basis is None:
        lines.append("predicted: no step time: eager mode on a TPU runs op by op for debugging and has never been "
                     "measured; plan the run with --training.mode graph (the TPU path)")
    else:
        bubble = f", the pipeline's bubble ({t['pipeline_bubble']:.3f}) included" if "pipeline_bubble" in t else ""
        lines.append(f"time per step: compute {t['compute_s']:.4g} s (at {t['efficiency']:.0%} of "
                     f"{hw['peak_flops'] / 1e12:.4g} TFLOP/s{bubble}), elementwise {t['elementwise_s']:.4g} s, "
                     f"collectives {t['collectives_s']:.4g} s; {t['step_s_no_overlap']:.4g} s without overlap, "
                     f"{t['step_s_overlap']:.4g} s with")
        lines.append(f"predicted: {t['step_s']:.4g} s/step "
                     f"({'overlapped' if t['overlap_assumed'] else 'no overlap'}), "
                     f"{plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1f}%"
                     f"{' (of the bf16 peak)' if 'fp8' in b else ''}; speed basis: {plan.speed_basis}")
    for a in plan.advice:
        lines.append(f"to fit: {a}")
    c = plan.checkpoint
    if c:
        lines.append(f"checkpoint: {c['bytes_total'] / 1e9:,.2f} GB in {c['persistent_s']:.3g} s at "
                     f"{c['storage_gbps']:g} GB/s to storage; local tier {c['bytes_per_device'] / 1e9:,.2f} GB per "
                     f"device in {c['local_s']:.3g} s at {c['local_gbps']:g} GB/s; {c['verdict']}")
    lines.append(f"hardware source: {hw['source']}")
    if explain:
        lines.append("terms (bytes per device):")
        lines += [f"  {key:22s}{meaning}" for key, meaning in TERMS.items() if key == "peak" or m.get(key)]
    else:
        lines.append("(titan-tpu plan --explain: what each term means)")
    return "\n".join(lines)
