"""The activation-memory model the planner reads (titan_tpu/plan): what a transformer's forward
keeps for its backward, per layer, per activation-checkpointing mode.

Counted from the model's code (models/common/transformer.py and each piece's own function:
attention, feed-forward, MoE, MLA, the norms), checked against autograd's saved tensors in
tests/test_planner.py. Beside the model rather than inside it: the model runs, this counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from titan_tpu.models.common.transformer import TransformerArgs


@dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one micro-batch on one rank, in bytes."""

    saved_per_layer: tuple[int, ...]  # kept from the forward until the layer's backward
    recompute: int  # checkpointed modes: the largest layer's intermediates, live while it is recomputed
    head: int  # the final norm and the token ids (the loss kernel's memory is counted by the kernel)

    @property
    def saved(self) -> int:
        return sum(self.saved_per_layer)


def block_saved_per_token(args: TransformerArgs, *, moe_layer: bool, ac_mode: str, ep: int = 1,
                          traced: bool = False, partitioned: bool = False, tp: int = 1,
                          padded_values: bool = False) -> tuple[float, float]:
    """(compute-dtype elements, 4-byte elements) one block keeps per token of this rank.

    none: everything its ops save (each RMSNorm: input, input * rstd, output; attention; the
    feed-forward or MoE layer). full: only the block input (traced by the graph trainer, the
    attention kernel's output and log-sum-exp are kept too where its op may draw random numbers,
    as SDPA's may: such ops are not replayed; the planner's `Setting.traced` says when).
    selective: the block input plus the outputs of matmuls and of the attention kernel
    (activation_checkpoint.SAVED_OPS). partitioned: what scan's own autograd keeps per layer
    (scanned layers in graph mode without full checkpointing, models/common/scan.py): its min-cut
    partitioner picks the values (each module's `partitioned` count; selective's tags do not reach
    it, so selective keeps what none keeps). MoE layers are counted as eagerly (not measured).
    padded_values: multi-head latent attention's values padded to the queries' width by the
    attention kernel (kernels/attention.py `pads_values`; models/common/mla.py)."""
    from titan_tpu.models.common.attention import attention_matmul_outputs_per_token, attention_saved_per_token
    from titan_tpu.models.common.feed_forward import feed_forward_matmul_outputs_per_token, feed_forward_saved_per_token
    from titan_tpu.models.common.moe import moe_matmul_outputs_per_token, moe_saved_per_token
    from titan_tpu.models.common.norms import rms_norm_saved_per_row

    d = args.dim
    if partitioned and ac_mode != "full":
        ac_mode = "none"
    if ac_mode == "full":
        if traced:
            out = args.n_heads * args.hd
            if args.mla is not None:
                out = args.n_heads * (args.mla.qk_head_dim if padded_values else args.mla.v_head_dim)
            return (d + out) / tp, args.n_heads / tp
        return d / tp, 0
    if ac_mode == "selective":
        if moe_layer:
            e, f = moe_matmul_outputs_per_token(dim=d, args=args.moe)
        else:
            e, f = feed_forward_matmul_outputs_per_token(dim=d, hidden_dim=args.ffn_hidden_dim), 0
        # Under tp w2's output (d) is whole until reduce-scattered; an MoE layer's outputs are the
        # rank's sequence shard's (its experts run there, tensor_parallel.py).
        whole_ffn_out = d if tp > 1 and not moe_layer else 0
        if args.mla is not None:  # already this rank's share (its latent projections whole)
            from titan_tpu.models.common.mla import mla_matmul_outputs_per_token

            elements, fp32 = mla_matmul_outputs_per_token(dim=d, n_heads=args.n_heads, args=args.mla, tp=tp,
                                                          padded_values=padded_values)
            if tp > 1:
                return d / tp + elements + (e - whole_ffn_out) / tp + whole_ffn_out, fp32 + f / tp
            return d + elements + e, fp32 + f
        elements, fp32 = attention_matmul_outputs_per_token(dim=d, n_heads=args.n_heads,
                                                            n_kv_heads=args.n_kv_heads, head_dim=args.hd)
        if tp > 1:  # and wo's output (d) too
            return (d + elements + e - d - whole_ffn_out) / tp + d + whole_ffn_out, (fp32 + f) / tp
        return d + elements + e, fp32 + f
    norm, norm_fp32 = rms_norm_saved_per_row(d, partitioned=partitioned)
    if args.mla is not None:  # counted as eagerly (not measured partitioned); this rank's share
        from titan_tpu.models.common.mla import mla_saved_per_token

        elements, fp32 = mla_saved_per_token(n_heads=args.n_heads, args=args.mla, tp=tp, padded_values=padded_values)
    else:
        elements, fp32 = attention_saved_per_token(n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                                                   head_dim=args.hd, qk_norm=args.qk_norm, partitioned=partitioned)
        elements, fp32 = elements / tp, fp32 / tp
    if moe_layer:
        e, f = moe_saved_per_token(dim=d, args=args.moe, ep=ep)
    else:
        e, f = feed_forward_saved_per_token(args.ffn_hidden_dim, partitioned=partitioned), 0
    # Two norms: their saved tensors and their outputs (the matmuls' inputs; gathered whole under tp,
    # but for an MoE layer, which reads the rank's sequence shard).
    whole_inputs = 2 * d if tp == 1 or not moe_layer else d + d / tp
    return elements + (e + 2 * norm) / tp + whole_inputs, fp32 + (f + 2 * norm_fp32) / tp


def activation_bytes(args: TransformerArgs, *, tokens: int, ac_mode: str, dtype_bytes: int, ep: int = 1,
                     traced: bool = False, partitioned: bool = False, tp: int = 1,
                     padded_values: bool = False) -> ActivationBytes:
    """Activation memory of a micro-batch of `tokens` tokens (batch x sequence) on one rank.
    partitioned: the layers are scanned in graph mode under scan's own autograd
    (`block_saved_per_token`); what scan adds around them is `scan.scan_autograd_memory`.
    tp: tensor parallelism's share of them (`block_saved_per_token`); padded_values: see there."""
    from titan_tpu.models.common.norms import rms_norm_saved_per_row

    if partitioned and ac_mode != "full":
        ac_mode = "none"  # selective's tags do not reach scan's partitioner: nothing is recomputed

    def nbytes(counts: tuple[float, float]) -> int:
        return int(tokens * (counts[0] * dtype_bytes + counts[1] * 4))

    saved, recompute = [], 0
    for layer_id in range(args.n_layers + args.mtp_num_layers):  # the layers, then the MTP blocks
        moe = args.is_moe_layer(layer_id)
        saved.append(nbytes(block_saved_per_token(args, moe_layer=moe, ac_mode=ac_mode, ep=ep, traced=traced,
                                                  partitioned=partitioned, tp=tp, padded_values=padded_values)))
        if ac_mode != "none":
            whole = nbytes(block_saved_per_token(args, moe_layer=moe, ac_mode="none", ep=ep, tp=tp,
                                                 padded_values=padded_values))
            recompute = max(recompute, whole)
    norm, norm_fp32 = rms_norm_saved_per_row(args.dim)
    # The final norm (on a rank's 1 / tp of the sequence under tensor parallelism); the token ids.
    head = tokens * ((norm + args.dim) * dtype_bytes + norm_fp32 * 4) // tp + tokens * 8
    # Multi-token prediction, per depth (models/common/mtp.py): its three norms, the concatenation
    # eh_proj reads, its norm's output (the loss's input), and its input tokens and targets.
    head += args.mtp_num_layers * tokens * ((3 * norm + 3 * args.dim) * dtype_bytes + 3 * norm_fp32 * 4 + 16)
    if tp > 1:
        # The loss's input: the final norm's output gathered over the sequence, whole [tokens, dim]
        # (parallel/tensor_parallel.py), live beside the rank's own part while the loss runs.
        head += tokens * args.dim * dtype_bytes
    return ActivationBytes(saved_per_layer=tuple(saved), recompute=recompute, head=head)
