"""The plan's fp8 what-if: what running the blocks' linears as fp8 matmuls changes (the config's
[fp8] section, or `plan_run`'s fp8 argument): their FLOPs at the fp8 peak, the casts as elementwise
traffic, one layer's fp8 copies and scales in memory (`fp8_terms`); and a plan beside its twin in
the other precision (`fp8_beside`). With `fp8.experts` the MoE experts' grouped matmuls too
(`fp8_expert_terms`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.config import Config
from titan_tpu.plan.hardware import Hardware
from titan_tpu.plan.setting import Setting

if TYPE_CHECKING:
    from titan_tpu.plan.result import Plan

__all__ = ["FP8_CAST_BYTES_PER_ELEMENT", "fp8_beside", "fp8_expert_terms", "fp8_experts_on", "fp8_linear_params",
           "fp8_note", "fp8_setting", "fp8_terms"]


def fp8_setting(cfg: Config) -> tuple[bool, str]:
    """(fp8 on, its scaling) as the config's [fp8] section says; off for a config without one."""
    section = getattr(cfg, "fp8", None)
    return bool(getattr(section, "enabled", False)), str(getattr(section, "scaling", "tensorwise"))


def fp8_experts_on(cfg: Config) -> bool:
    """Whether the config's [fp8] section converts the MoE experts too (fp8.experts)."""
    return bool(getattr(getattr(cfg, "fp8", None), "experts", False))


def fp8_linear_params(args) -> tuple[int, int]:
    """(weight elements of the linears an fp8 recipe converts, of those the feed-forward down
    projections): every block's attention projections and dense feed-forward (w1 w2 w3). Not
    converted: the output projection (kept in bf16, as torchao and TorchTitan keep it), the
    embedding, norms, the MoE router and its experts (grouped matmuls, not linears)."""
    from titan_tpu.models.registry import _attention_params

    attention = _attention_params(args) - (2 * args.hd if args.qk_norm and args.mla is None else 0)
    dense = [not args.is_moe_layer(i) for i in range(args.n_layers + args.mtp_num_layers)]
    return (len(dense) * attention + sum(dense) * 3 * args.dim * args.ffn_hidden_dim,
            sum(dense) * args.dim * args.ffn_hidden_dim)


# Bytes the casts to fp8 move per element quantised: read it to find its amax (2 bytes in bf16),
# read it again to scale and convert (2), write the fp8 copy (1). An estimate: XLA may fuse the amax
# into the producer of the value, or the convert into the dot's operand fusion.
FP8_CAST_BYTES_PER_ELEMENT = 5


def fp8_terms(s: Setting) -> dict[str, float]:
    """What running the blocks' linears as fp8 matmuls changes, per device per step.

    flops: the converted matmuls' executed FLOPs (forward, the two backward matmuls, and the
    forward's rerun under full checkpointing, less the down projection it skips), which run at the
    fp8 peak: `hardware.fp8_peak_flops`, or the compute dtype's peak on a chip without one (XLA runs
    an f8 dot there at the bf16 rate: no gain, only the casts). cast_bytes: the quantisation, each
    quantised operand (activation, weight, output gradient) read twice and written once in fp8
    (FP8_CAST_BYTES_PER_ELEMENT), a rowwise recipe quantising the activation and the gradient a
    second time along the other dimension for the weight gradient. copies_bytes: one layer's fp8
    weights and its largest fp8 activation, alive while its matmuls run. scales_bytes: the fp32
    scales of one layer's matmuls (0-dim tensorwise; a row and a column per matmul rowwise)."""
    t, p = s.cfg.training, s.cfg.parallelism
    converted, down = fp8_linear_params(s.args)
    tokens = s.tokens / p.cp
    layers = s.args.n_layers + s.args.mtp_num_layers
    rerun = s.ac == "full"
    flops = (6 * converted + (2 * (converted - down) if rerun else 0)) * tokens / p.tp * t.grad_accum_steps
    rowwise = s.fp8_scaling == "rowwise"
    # activations and output gradients of all converted linears, per token (inputs: dim wide for the
    # attention and w1/w3, ffn_hidden for w2; outputs likewise)
    width_in = _fp8_io_width(s.args, side="in") / p.tp
    width_out = _fp8_io_width(s.args, side="out") / p.tp
    forwards = 2 if rerun else 1
    # activations: each forward and the weight gradient (rowwise: along the other dimension once more);
    # output gradients: the input gradient and the weight gradient (rowwise: again); the gathered
    # weights: each forward and the input gradient
    elements = tokens * (width_in * (forwards + 1 + rowwise) + width_out * (2 + rowwise)) \
        + converted / p.tp * (forwards + 1)
    cast_bytes = FP8_CAST_BYTES_PER_ELEMENT * elements * t.grad_accum_steps
    layer_weights = converted / layers / p.tp
    largest_in = max(s.args.dim, s.args.ffn_hidden_dim) / p.tp
    linears = 7 if s.args.mla is None else 9  # one block's converted linears, three matmuls each
    scales = 4 * 3 * linears * ((tokens + max(s.args.dim, s.args.ffn_hidden_dim)) if rowwise else 2)
    peak = s.hardware.fp8_peak_flops or s.hardware.peak_flops
    terms = {"flops": flops, "peak_flops": peak, "cast_bytes": cast_bytes,
             "copies_bytes": layer_weights + tokens * largest_in, "scales_bytes": float(scales)}
    experts = fp8_expert_terms(s) if s.fp8_experts else None
    if experts:
        terms["flops"] += experts["flops"]
        terms["cast_bytes"] += experts["cast_bytes"]
        # the largest layer's copies are alive at once: a dense block's or an MoE block's
        terms["copies_bytes"] = max(terms["copies_bytes"], layer_weights - _dense_ffn_weights(s) / p.tp
                                    + experts["copies_bytes"])
        terms["scales_bytes"] += experts["scales_bytes"]
        terms["expert_flops"] = experts["flops"]
    return terms


def _dense_ffn_weights(s: Setting) -> float:
    """One dense block's feed-forward weights (0 where every block is MoE): what an MoE block has not."""
    layers = s.args.n_layers + s.args.mtp_num_layers
    dense = sum(not s.args.is_moe_layer(i) for i in range(layers))
    return 3 * s.args.dim * s.args.ffn_hidden_dim if dense else 0.0


def fp8_expert_terms(s: Setting) -> dict[str, float] | None:
    """What running the MoE experts' grouped matmuls in float8 adds to `fp8_terms`, per device per
    step (None for a dense model). flops: each token's top-k experts' three matmuls, forward, input
    and weight gradients, and under full checkpointing all three again (the rerun recomputes the
    down projection too: its output, times the routing weight, is what the weight's gradient reads),
    over this device's tokens (its cp chunk, its tp sequence shard: the experts are whole on tp).
    cast_bytes: the routed rows each grouped matmul quantises (ep x top-k per token under expert
    parallelism's all_gather dispatch, the rows of other ranks' experts included, as the layer
    quantises its whole buffer), as for the linears, and this device's E / ep experts' weights
    once per forward and once for the input gradient. copies_bytes: one MoE layer's fp8 expert
    weights and its largest fp8 routed activation. scales_bytes: one layer's fp32 scales."""
    moe = getattr(s.args, "moe", None)
    if moe is None:
        return None
    t, p = s.cfg.training, s.cfg.parallelism
    layers = sum(s.args.is_moe_layer(i) for i in range(s.args.n_layers + s.args.mtp_num_layers))
    D, F, k = s.args.dim, moe.hidden_dim, moe.top_k
    tokens = s.tokens / p.cp / p.tp
    rerun = s.ac == "full"
    active = layers * k * 3 * D * F  # expert weights one token's forward multiplies by
    flops = (6 + (2 if rerun else 0)) * active * tokens * t.grad_accum_steps
    rowwise = s.fp8_scaling == "rowwise"
    forwards = 2 if rerun else 1
    rows = tokens * k * p.ep
    width_in, width_out = 2 * D + F, 2 * F + D  # w1 and w3 read the rows, w2 the hidden; their outputs likewise
    local_weights = moe.num_experts / p.ep * 3 * D * F
    elements = layers * (rows * (width_in * (forwards + 1 + rowwise) + width_out * (2 + rowwise))
                         + local_weights * (forwards + 1))
    scales = 4 * 3 * 3 * ((rows + moe.num_experts / p.ep * max(D, F)) if rowwise else moe.num_experts / p.ep + 1)
    return {"flops": flops, "cast_bytes": FP8_CAST_BYTES_PER_ELEMENT * elements * t.grad_accum_steps,
            "copies_bytes": local_weights + rows * max(D, F), "scales_bytes": float(scales)}


def _fp8_io_width(args, *, side: str) -> float:
    """Summed input (side "in") or output ("out") width of one token's converted linears over all
    blocks: what the casts of its activations (inputs) and output gradients (outputs) touch."""
    hd, heads, kv = args.hd, args.n_heads, args.n_kv_heads
    attention = (3 * args.dim + heads * hd) if side == "in" else (heads * hd + 2 * kv * hd + args.dim)
    ffn = (2 * args.dim + args.ffn_hidden_dim) if side == "in" else (2 * args.ffn_hidden_dim + args.dim)
    blocks = range(args.n_layers + args.mtp_num_layers)
    return sum(attention + (0 if args.is_moe_layer(i) else ffn) for i in blocks)


def fp8_note(hardware: Hardware) -> str | None:
    """One line for an fp8 plan on a chip without an fp8 peak (None where it has one)."""
    if hardware.fp8_peak_flops:
        return None
    return (f"{hardware.name} has no fp8 peak above its bf16 one: XLA (or the CPU) runs the f8 dots at the bf16 rate, "
            "so fp8 gains no speed here and adds its casts; fp8 pays on tpu7x, H100/H200 and B200")


def fp8_beside(plan: Plan, other: Plan) -> tuple[str, dict]:
    """(one line, a dict) comparing a plan with its fp8 (or bf16) twin (`plan_run`'s fp8 what-if)."""
    fp8, bf16 = (plan, other) if "fp8" in plan.batch else (other, plan)
    if fp8.tokens_per_s is None or bf16.tokens_per_s is None:
        return "", {}
    gain = fp8.tokens_per_s / bf16.tokens_per_s
    beside = {"bf16_step_s": bf16.time["step_s"], "fp8_step_s": fp8.time["step_s"],
              "bf16_tokens_per_s": bf16.tokens_per_s, "fp8_tokens_per_s": fp8.tokens_per_s, "speedup": gain,
              "fp8_peak_bytes": fp8.peak_bytes, "bf16_peak_bytes": bf16.peak_bytes, "fp8_fits": fp8.fits}
    line = (f"fp8 vs bf16 (the blocks' linears as fp8 matmuls, {fp8.batch['fp8']}): bf16 {bf16.time['step_s']:.4g} "
            f"s/step, {bf16.tokens_per_s:,.0f} tokens/s; fp8 {fp8.time['step_s']:.4g} s/step, "
            f"{fp8.tokens_per_s:,.0f} tokens/s ({gain:.2f}x); peak {fp8.peak_bytes / 1e9:.2f} GB vs "
            f"{bf16.peak_bytes / 1e9:.2f} GB{'' if fp8.fits else ' (fp8 does NOT fit)'}")
    note = fp8_note(Hardware(**fp8.hardware))
    return line + (f"; {note}" if note else ""), beside
