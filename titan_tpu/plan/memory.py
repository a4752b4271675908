"""The plan's memory: bytes per device by term, and the moments of a step whose largest is the
peak (rank 0's view; every rank is alike). The terms live beside the code they describe:

* the model: activations per layer per activation-checkpointing mode
  (models/common/activation_memory.py `activation_bytes` and the per-module functions it calls);
* scanned layers in graph mode without full checkpointing: what scan's own autograd holds (the
  modules' partitioned counts, models/common/scan.py `scan_autograd_memory`);
* the loss kernel: what it keeps and its peak (kernels/loss.py `loss_memory_bytes`);
* the parallel layout: stored shards, gathered weights and full-size gradients
  (parallel/plan_terms.py);
* AdamW: two moments like each parameter, and one temporary like the parameters during its update
  (train/optim.py: the foreach sqrt of the second moment).

The moments (`memory_phases`): forward end (all activations kept, the loss kernel at its peak),
backward (activations of the layers below and gradients of the layers above, plus one recomputed
layer and the largest full-size gradient), under XLA the backward's end (`_xla_backward_end`) and
the optimizer update (gradients and the AdamW temporary).

Under pipeline stages every term is the last stage's (plan/pipeline_terms.py): `Setting.args` holds
its layers only, and its activations are those of every micro-batch, alive at the backward's start.

A Transformers-backend model's activations are measured (`Setting.hf`, plan/hf_terms.py); the
layout's, the loss kernel's and AdamW's terms are the same functions, read with its measured
parameter counts. It is one piece to SimpleFSDP: all its weights gathered together and kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_tpu.kernels.loss import loss_memory_bytes
from titan_tpu.kinds.record import reference_holder
from titan_tpu.models.common.activation_memory import ActivationBytes, activation_bytes
from titan_tpu.models.common.rope import rope_real_saved_per_position
from titan_tpu.models.common.scan import ScanAutogradMemory, scan_autograd_memory
from titan_tpu.models.registry import num_expert_params, num_params
from titan_tpu.parallel.context_parallel import cp_attention_saved_bytes
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.plan.setting import (
    Setting,
    attention_widths,
    chunk_attention_impl,
    grouped_mm_impl,
    loss_impl,
)
from titan_tpu.train.optim import update_buffers

__all__ = ["StepMemory", "XLA_BACKENDS", "optimizer_temporary_bytes", "runtime_bytes", "scanned_autograd_memory",
           "step_memory"]


@dataclass(frozen=True)
class StepMemory:
    """The memory terms of one step on one device (`step_memory`)."""

    terms: dict  # bytes per device by term (the plan's `memory`); "phases": the moments of the step
    acts: ActivationBytes
    loss_peak: float
    scan: ScanAutogradMemory | None

    @property
    def activations_held(self) -> float:
        """What activations hold at the peak, for the advice: the saved activations, the loss
        kernel's peak, and scan's autograd's saved stacks (twice) and gradient stack: activation
        memory too, which full checkpointing removes (the scanned full mode keeps only the layer
        inputs)."""
        scan_held = self.scan.at_backward_start - self.scan.activations if self.scan else 0.0
        return self.acts.saved + self.loss_peak + scan_held


def step_memory(s: Setting) -> StepMemory:
    """Bytes per device by term, with the moments of the step (`memory_phases`) under "phases"."""
    mb = s.layout.master_bytes()
    acts = rank_activations(s)
    loss_kept, loss_peak = loss_bytes(s)
    gathered = gathered_bytes(s)
    full_grad = 0.0 if s.lora else full_gradient_bytes(s)  # LoRA: only the small adapters have gradients
    scan = scan_memory(s, acts, full_grad)
    phases = memory_phases(s, acts=acts, loss_kept=loss_kept, loss_peak=loss_peak, gathered=gathered,
                           full_grad=full_grad, scan=scan)
    terms = {
        "parameters": s.stored * mb, "gradients": s.trained * mb, "optimizer_state": 2 * s.trained * mb,
        **({"reference": s.reference_stored * mb} if reference_holder(s.kind, s.cfg) != "none" else {}),
        "activations": acts.saved + acts.head, "activation_recompute": acts.recompute,
        "gathered_weights": gathered, "full_size_gradient": full_grad,
        # scan's weight copies beyond the gathered weights they are when sharded, and the RoPE copies
        "scan_saved_copies": (scan.weight_copies - copies_gathered(s, gathered, scan) + scan.shared if scan else 0.0),
        "scan_flipped": (scan.flipped if scan else 0.0), "scan_gradient_stack": (scan.gradients if scan else 0.0),
        "loss_kept": loss_kept, "loss_peak": loss_peak, "optimizer_temporary": optimizer_temporary_bytes(s),
        "runtime": runtime_bytes(s), "phases": phases,
    }
    if s.args.moe is not None:
        terms["moe_dispatch"] = moe_dispatch_bytes(s)
    return StepMemory(terms=terms, acts=acts, loss_peak=loss_peak, scan=scan)


def rank_activations(s: Setting) -> ActivationBytes:
    """Activations of one micro-batch on one rank: under context parallelism its 1 / cp of the
    tokens, and attention keeps every rank's keys and values (of its kv heads: 1 / tp of them).
    An hf model's are measured, LoRA's adapters included (plan/hf_terms.py)."""
    # Layers that are no loop in a step XLA compiles whole: XLA sees the forward and the backward as
    # one program and fuses the elementwise work (the norms, SiLU times the gate) into the backward's
    # fusions, recomputing it from the matmuls' outputs, so without checkpointing a layer keeps what
    # selective checkpointing keeps (its input, the matmuls' and the attention kernel's outputs) and
    # reruns nothing. XLA's live values of llama3_8b_pp_tpu without checkpointing: per layer and
    # micro-batch two bf16 [8192, 14336] (w1's and w3's outputs), q, k, v and the attention output,
    # and two [8192, 4096] inputs of the residual stream, what selective counts; the eager autograd
    # count is 1.8x that. qwen2_5_vl_7b_tpu without checkpointing: 71.7 GiB by XLA, 74.1 planned so
    # (90.2 with the eager count). Scanned layers are partitioned by scan's own autograd before XLA
    # sees them (`Setting.partitioned`). Under LoRA XLA keeps each adapted projection's output (the
    # base's and the adapter's summed, one fusion), not the adapter's B (A x) beside it: with it
    # qwen2_5_vl_7b_tpu's LoRA plan was 83.0 GB against XLA's 60.8 (and full fine-tuning's 79.6).
    ac_mode = "selective" if s.ac == "none" and _xla_unrolled_step(s) else s.ac
    if s.hf is not None:
        acts = s.hf.activations(rows=s.tokens // s.cfg.training.seq_len, ac_mode=ac_mode, traced=s.traced,
                                adapter_outputs=ac_mode == s.ac)
        return acts if ac_mode == s.ac else dataclasses.replace(acts, recompute=0)
    cfg, args, cp, tp = s.cfg, s.args, s.cfg.parallelism.cp, s.cfg.parallelism.tp
    acts = activation_bytes(args, tokens=s.tokens // cp, ac_mode=ac_mode, dtype_bytes=s.layout.compute_bytes,
                            ep=cfg.parallelism.ep, traced=s.traced, partitioned=s.partitioned, tp=tp,
                            padded_values=s.padded_values)
    if ac_mode != s.ac:
        acts = dataclasses.replace(acts, recompute=0)  # kept as selective keeps, nothing rerun
    if cp > 1 and s.ac == "none":
        t = cfg.training
        mask = chunk_attention_impl(cfg.kernels.chunk_attention, s.hardware.name) in ("sdpa", "reference")
        q_dim, k_dim, v_dim = attention_widths(args, tp)
        extra = cp_attention_saved_bytes(batch_size=t.batch_size, seq_len=t.seq_len, cp=cp,
                                         dtype_bytes=s.layout.compute_bytes, q_dim=q_dim, kv_dim=k_dim, v_dim=v_dim,
                                         documents=s.run.documents, mask=mask, padded_values=s.padded_values)
        acts = dataclasses.replace(acts, saved_per_layer=tuple(saved + extra for saved in acts.saved_per_layer))
    if s.schedule is not None and acts.recompute:
        # A pipeline stage keeps every micro-batch's activations, but recomputes one layer of one
        # micro-batch at a time (plan/pipeline_terms.py).
        one = activation_bytes(args, tokens=s.tokens // cp // s.schedule.micro_batches, ac_mode=s.ac,
                               dtype_bytes=s.layout.compute_bytes, ep=cfg.parallelism.ep, traced=s.traced, tp=tp,
                               padded_values=s.padded_values)
        acts = dataclasses.replace(acts, recompute=one.recompute)
    if s.schedule is not None:
        # The loss's input is the stage's share of the tokens (parallel/pipeline.py `loss_share`),
        # not the final norm's whole output, which the share-out reads and keeps nothing of.
        share = -(-s.tokens // s.schedule.stages)
        acts = dataclasses.replace(acts, head=acts.head - (s.tokens - share) * args.dim * s.layout.compute_bytes // tp)
    if s.schedule is not None and s.cfg.compile.backend == "jax" and s.graph:
        # One program for every stage (parallel/pipeline.py `run_pipeline_spmd`): every stage computes
        # in every iteration, the bubble's too, and keeps what each one saves for the backward.
        passes = s.schedule.iterations - (s.schedule.stages - 1)
        acts = dataclasses.replace(acts, saved_per_layer=tuple(
            saved * s.schedule.iterations // passes for saved in acts.saved_per_layer))
    return _with_lora_activations(s, acts) if s.lora else acts


def _xla_unrolled_step(s: Setting) -> bool:
    """A step XLA compiles whole (graph mode) whose layers are no loop: pipeline stages, a
    Transformers-backend model's layers, or scan_layers false."""
    unrolled = s.schedule is not None or not s.scanned or s.hf is not None
    return s.cfg.compile.backend in XLA_BACKENDS and s.graph and unrolled


def _with_lora_activations(s: Setting, acts: ActivationBytes) -> ActivationBytes:
    """What LoRA changes in the saved activations (models/lora.py; measured with autograd's
    saved-tensor hooks on llama3 debug). Each adapted linear keeps its rank-wide intermediate
    A x for B's gradient, and with dropout its dropped input and the mask; each RMSNorm, its scale
    frozen, no longer keeps input * rstd (only the scale's gradient reads it; eager autograd, without
    checkpointing: scan's partitioner does not keep it anyway). Under full checkpointing a block keeps
    its input only, as without LoRA."""
    if s.ac == "full":
        return acts
    tokens, dtype_bytes, lora = s.tokens // s.cfg.parallelism.cp, s.layout.compute_bytes, s.cfg.lora
    frozen_norm = s.args.dim * dtype_bytes * tokens if s.ac == "none" and not s.partitioned else 0

    def adapters(prefix: str) -> int:
        per_token = sum(lora.rank * dtype_bytes + (in_features * (dtype_bytes + 1) if lora.dropout > 0 else 0)
                        for name, in_features in s.adapted if name.startswith(prefix))
        return per_token * tokens

    saved = tuple(int(b + adapters(f"layers.{i}.") - 2 * frozen_norm) for i, b in enumerate(acts.saved_per_layer))
    head = int(acts.head + adapters("output") - frozen_norm)
    return dataclasses.replace(acts, saved_per_layer=saved, head=head)


def loss_bytes(s: Setting) -> tuple[float, float]:
    """(kept, peak) of the loss kernel. Under tensor parallelism it sees every token and its rank's
    1 / tp of the vocabulary (the vocabulary-parallel form, with its own temporaries), under
    context parallelism the rank's tokens, under pipeline stages its stage's share of the tokens."""
    k, p = s.cfg.kernels, s.cfg.parallelism
    impl = _loss_kernel(s)
    # Pipeline stages share the last stage's outputs out by token: each runs the loss on 1 / pp of them.
    tokens = -(-s.tokens // s.schedule.stages) if s.schedule is not None else s.tokens // p.cp
    return loss_memory_bytes(impl, tokens=tokens,
                             vocab_size=s.vocab_size // p.tp, dim=s.dim,
                             dtype_bytes=s.layout.compute_bytes, chunk_tokens=k.loss_chunk_tokens,
                             vocab_parallel=p.tp > 1, weight_trained=not s.lora)


def _loss_kernel(s: Setting) -> str:
    """The loss kernel as the step runs it (kernels/loss.py `loss_memory_bytes` names)."""
    impl = loss_impl(s.cfg.kernels.loss, s.hardware.name)
    if s.as_compiled and impl == "tokamax":
        impl = "tokamax_xla"
    if s.hf is not None and not s.hf.chunked_loss:  # transformers' own logits, materialised
        impl = "reference"
    return impl


def gathered_bytes(s: Setting) -> float:
    """Gathered block weights alive at once (parallel/plan_terms.py); with the weights kept
    gathered (gather "model") the embedding's and the output projection's gathered copies too,
    kept from the forward to the backward like the blocks' (XLA's live ranges of
    qwen3_8b_lora_chat_tpu: the gathered bf16 [vocab, dim] beside the gathered stacks)."""
    if s.hf is not None:  # one piece: every weight gathered together (its embedding and output too)
        return s.layout.gathered_bytes(block_params=s.base_params + s.adapter_params, expert_params=s.expert_params,
                                       n_layers=s.n_layers)
    blocks = s.layout.gathered_bytes(block_params=s.block_params, expert_params=num_expert_params(s.args),
                                     n_layers=s.args.n_layers)
    if s.gather != "model" or not s.layout.sharded or _read_in_place(s):
        return blocks
    args = s.args
    head = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) / s.cfg.parallelism.tp
    return blocks + head * s.layout.compute_bytes


def _read_in_place(s: Setting) -> bool:
    """Pipeline stages without a data-parallel or cp axis, in fp32: a stage reads its own rows and
    the whole weights outside the stack as they are stored (the pp axis is not gathered), so
    nothing is copied and the gradients are the stored ones (no reduce-scatter)."""
    layout = s.layout
    return s.schedule is not None and layout.dp_shard * layout.dp_replicate * layout.cp == 1 and \
        layout.compute_bytes == layout.master_bytes()


def full_gradient_bytes(s: Setting) -> float:
    """The largest full-size gradient alive before its reduce-scatter. A scanned stack gathered per
    layer has one layer's, also where the gathered weights are kept (scan's autograd without full
    checkpointing: gather "model", the gradients still per layer)."""
    if _read_in_place(s):
        return 0.0
    layout = s.layout
    grad_layout = dataclasses.replace(layout, gather="layer") if s.scanned and s.per_layer_stack else layout
    if s.schedule is not None:
        # A stage's weight gradients accumulate over the schedule's iterations in its gathered rows'
        # dtype (the compute dtype) and are cast to the reduce dtype only for their reduce-scatter
        # at the step's end (XLA's live values of llama3_8b_pp_tpu: bf16 [8, 14336, 4096] gradient
        # stacks through the backward, no fp32 stack before its end).
        grad_layout = dataclasses.replace(grad_layout, reduce_bytes=layout.compute_bytes)
    return grad_layout.full_gradient_bytes(largest_param=s.largest_param, block_params=s.block_params,
                                           expert_params=s.expert_params, n_layers=s.n_layers,
                                           scanned=s.scanned and not s.per_layer_stack)


def scan_memory(s: Setting, acts: ActivationBytes, full_grad: float) -> ScanAutogradMemory | None:
    """What scan's own autograd holds (scanned layers in graph mode without full checkpointing),
    else None."""
    if not s.partitioned:
        return None
    k = s.cfg.kernels
    return scanned_autograd_memory(s.args, layout=s.layout, acts=acts, seq_len=s.cfg.training.seq_len,
                                   gradient_stack=not full_grad or s.per_layer_stack,
                                   gathered_in_body=s.layout.sharded and s.per_layer_stack,
                                   experts_copied=grouped_mm_impl(k.grouped_mm, s.hardware.name) != "torch",
                                   flipped=s.cfg.compile.backend not in ("inductor", *XLA_BACKENDS))


def scanned_autograd_memory(args, *, layout: Layout, acts: ActivationBytes, seq_len: int,
                            gradient_stack: bool, gathered_in_body: bool = False,
                            experts_copied: bool = True, flipped: bool = True) -> ScanAutogradMemory:
    """scan.py `scan_autograd_memory` for this model and layout. The forward saves copies of the
    weights the body computes itself: all matmul weights (local experts only under ep; in the
    compute dtype) where each layer gathers its own inside the loop (gathered_in_body: sharded,
    re-sharding after the forward), else only the MoE experts' transposed weights, and those only
    where the grouped_mm kernel reads them as a view (experts_copied: every kernel but "torch",
    kernels/grouped_mm.py `with_linear_layout`; the dense linears' backward reads the stack's slice,
    scan.py `_LinearSavingItsWeight`). The backward
    reads the rest from the stack, flipped: the norm scales, and without the per-layer gather the
    matmul weights too (gathered in the compute dtype when sharded, as stored otherwise). Also the
    RoPE values kept per layer and the stacked weight gradients the backward loop writes (a rank's
    shards when each layer reduce-scatters its own; gradient_stack False when the layout counts the
    stack's gradient as its full-size gradient). flipped False: the backward reads the stacks
    with a reversed index (Inductor, graph/reverse_scan.py), no flipped copies."""
    norm_params = args.n_layers * (2 * args.dim + (2 * args.hd if args.qk_norm else 0))
    block_params = num_params(args) - args.dim - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    experts = num_expert_params(args)
    matmul = layout.local_block_elements(block_params=block_params - norm_params, expert_params=experts)
    stored = layout.master_bytes() / layout.dp_shard  # bytes per block element a rank stores
    if gathered_in_body:
        copied, read = matmul, norm_params * stored
    else:
        stack_bytes = layout.compute_bytes if layout.sharded else stored
        copied = experts / layout.ep if experts_copied else 0.0  # this rank's experts
        read = (matmul - copied + norm_params) * stack_bytes
    return scan_autograd_memory(
        activations_per_layer=acts.saved_per_layer,
        layer_weight_bytes=copied * layout.compute_bytes / args.n_layers,
        shared_per_layer=seq_len * rope_real_saved_per_position(args.hd) * 4,
        read_weight_bytes=read,
        gradient_bytes=block_params * stored if gradient_stack else 0.0, flipped=flipped)


def runtime_bytes(s: Setting) -> float:
    """What the runtime holds beside the model (hardware.mode_constants), and on each rank of a
    multi-process run its process group's state."""
    distributed = s.hardware.distributed_runtime_bytes if s.devices > 1 else 0.0
    return s.hardware.mode_constants(graph=s.graph)[2] + distributed


def optimizer_temporary_bytes(s: Setting) -> float:
    """AdamW's sqrt(v) temporary; the traced step's out-of-place update also writes fresh
    parameters and moments (train/optim.py update_buffers). The compiled program (as_compiled)
    updates its donated buffers in place, each in one fusion: nothing parameter-sized beside them."""
    if s.as_compiled:
        return 0.0
    return update_buffers(out_of_place=s.graph) * s.trained * s.layout.master_bytes()


def memory_phases(s: Setting, *, acts: ActivationBytes, loss_kept: float, loss_peak: float, gathered: float,
                  full_grad: float, scan: ScanAutogradMemory | None) -> dict[str, float]:
    """Memory at the three moments of a step (the module docstring): forward end, backward,
    optimizer update."""
    mb = s.layout.master_bytes()
    params_b = s.stored * mb
    moments_b = 2 * s.trained * mb
    grads_b = s.trained * mb
    accumulating = grads_b if s.cfg.training.grad_accum_steps > 1 else 0.0  # earlier micro-batches' gradients
    static = params_b + moments_b + runtime_bytes(s) + s.reference_stored * mb
    # Under gradient accumulation `titan-tpu compile` compiles the micro-batch program apart from the
    # update (graph/capture.py capture_accumulating_step): its arguments are the parameters and the
    # gradient sums, not the AdamW moments (llama3_70b_v7_tpu's report: 4.4 GB of arguments in the
    # micro-batch program, 8.8 GB in the update's). As compiled, that program's moments of the step
    # (forward end, backward, backward end) count none; on a TPU they sit beside it all the same.
    if s.as_compiled and s.cfg.training.grad_accum_steps > 1:
        static, update_static = static - moments_b, static
    else:
        update_static = static
    forward_end = static + gathered + acts.saved + acts.head + loss_kept + loss_peak + accumulating
    if scan is not None:
        # The saved weight copies are the gathered weights when sharded (`gathered`, kept): counted once.
        forward_end += scan.at_backward_start - scan.activations - copies_gathered(s, gathered, scan)
    # Backward, top layer first: layers below keep their activations, layers above have gradients.
    layer_grad = [g * mb / (s.layout.dp_shard * s.layout.tp) for g in s.layer_gradient_params()]
    below, above, worst = acts.saved, 0.0, 0.0
    if _xla_scan_gradients_whole(s):  # the loop's gradient stack is allocated before its first trip
        # ... sharded, or under expert parallelism with the stacks kept gathered the full-size one
        # itself (`loop_grad`), reduce-scattered only after the loop (`_xla_expert_stacks_kept`)
        above = 0.0 if _xla_expert_stacks_kept(s) else sum(layer_grad)
        layer_grad = [0.0] * len(layer_grad)
    for saved, grad in zip(reversed(acts.saved_per_layer), reversed(layer_grad)):
        worst = max(worst, below + above + grad)
        below -= saved
        above += grad
    # Eager adds each gradient into the sums in place (the sums of the layers done so far are the
    # fresh gradients counted in `worst`); the captured micro-batch program writes new sums and
    # reads the old ones to its end (graph/capture.py, capture_accumulating_step).
    held_sums = accumulating if s.graph else max(accumulating - above, 0.0)
    # the full-size gradients as XLA's backward loop holds them (elsewhere `full_grad`)
    loop_grad = _xla_layer_loop(s) if _xla_per_layer_loop(s) else _xla_loop_gradient_stack(s, full_grad)
    backward = static + gathered + acts.head + loss_kept + worst + acts.recompute + loop_grad + held_sums
    if scan is not None:
        # The backward loop reads every flipped stack until it ends and writes the gradient stack;
        # one layer's intermediates are alive at a time.
        backward = static + acts.head + loss_kept + scan.flipped + scan.gradients + max(acts.saved_per_layer) + \
            full_grad + accumulating
    backward += _xla_loss_held_over_dcn(s, loss_peak) + _xla_logits_gradient_held(s, loss_peak)
    optimizer = update_static + grads_b + optimizer_temporary_bytes(s)
    phases = {"forward_end": forward_end, "backward": backward, "optimizer": optimizer}
    if _xla_backward_end(s):
        phases["backward_end"] = static + grads_b + _xla_backward_end(s) + _xla_expert_stacks_reduced(s)
    return phases


# The compile backends whose step XLA compiles: TorchTPU's, and the JAX path's (our lowering).
XLA_BACKENDS = ("tpu", "jax")


def _xla_scan_gradients_whole(s: Setting) -> bool:
    """Whether the backward loop's gradient stack is alive whole from its first trip: scanned
    layers compiled by XLA, whose while loop carries the stack it writes (not pipeline stages,
    which run their rows without a scan loop)."""
    return s.cfg.compile.backend in XLA_BACKENDS and s.graph and s.scanned and s.schedule is None


def _xla_loss_held_over_dcn(s: Setting, loss_peak: float) -> float:
    """The loss's [tokens, vocab] logits and their gradient, alive through the backward loop of a
    program over several slices: XLA's latency-hiding scheduler (libtpu 0.0.52) moves the loss's two
    consumers that feed nothing in the loop, its value (a reduction over the logits, whose total is
    all-reduced across the slices) and the output projection's weight gradient (a matmul over the
    logits' gradient), to after the loop, between the start and the end of the gradients' DCN
    all-reduces, to hide those transfers behind them. One slice's program has no DCN transfers to
    hide and computes both right after the loss, before the loop. XLA's buffer assignment of
    llama3_8b_multislice_tpu (2 x v5p:4x4x4, 2026-12-06): the logits (fusion.256, bf16[32768, 128256],
    7.83 GiB) alive from the loss to its value's reduction after the loop, their gradient
    (fusion.211, 7.83 GiB) to the weight gradient's matmul after it; the same mesh on one v5p:4x4x8
    slice frees both before the loop (its peak 16.7 GiB lower). With the latency-hiding scheduler off
    (LIBTPU_INIT_ARGS=--xla_tpu_enable_latency_hiding_scheduler=false) both come before the loop again
    (peak 45.6 GiB, docs/planner.md). Where the loss holds its logits whole (tokamax's plain-XLA form,
    `loss_peak` is them) under scanned layers compiled by XLA."""
    k = s.cfg.kernels
    whole_logits = s.as_compiled and loss_impl(k.loss, s.hardware.name) == "tokamax"
    if s.cfg.parallelism.slices <= 1 or s.cfg.parallelism.tp > 1 or not whole_logits or \
            not _xla_scan_gradients_whole(s):
        return 0.0
    return 2.0 * loss_peak


def _xla_logits_gradient_held(s: Setting, loss_peak: float) -> float:
    """The loss's [tokens, vocab] logits gradient, alive from the loss's backward to the step's end
    where the layers are not a loop (pipeline stages, a Transformers-backend model, unscanned
    layers) compiled by XLA: the output projection's weight gradient, the one consumer of it that
    feeds no layer, is scheduled last. XLA's live values at the peak: llama3_8b_pp_tpu's stage share
    (bf16 [8192, 128256], 1.96 GiB) beside the layers' recomputations; the same schedule held
    transformers' whole logits' gradient in qwen2_5_vl_7b_tpu when it was compiled with them (bf16
    [8192, 152064]). A scanned stack's loop is counted apart (`_xla_layer_loop`, and over several
    slices `_xla_loss_held_over_dcn`). Where the loss holds its logits whole (tokamax's plain-XLA
    form, `loss_peak` is them)."""
    whole_logits = _loss_kernel(s) == "tokamax_xla"
    return loss_peak if whole_logits and _xla_unrolled_step(s) else 0.0


def _xla_loop_gradient_stack(s: Setting, full_grad: float) -> float:
    """The full-size gradient the backward holds, as XLA's loop holds it: a scanned stack kept
    gathered whole (re-sharding off) under full checkpointing writes its gradient stack in the
    compute dtype inside the backward loop and casts it to the reduce dtype only after the loop,
    when the gathered weights and the activations are dead (XLA's live ranges of
    llama3_8b_128k_cp_tpu at its peak, inside the backward loop: the bf16 [layers, ...] gradient
    stacks of w1, w2, w3 beside the gathered stacks, no fp32 stack; llama3_8b_tpu's peak is after
    the loop, the fp32 stacks alive and the gathered ones dead). Dense stacks only: no kept MoE
    stack has been read, and the one compiled holds more than even the fp32 count (deepseek_v3_16b_tpu
    with the weights kept gathered: XLA asked for 98.2 GB of temporaries against 95.7 GB of HBM in a
    throwaway compile, where the planner with this term would have said 75.4 GiB and flipped
    auto to keep them), so there the fp32 count stays, and with it re-sharding on for that recipe.
    Elsewhere `full_grad` as it is."""
    if not (_xla_scan_gradients_whole(s) and s.ac == "full" and s.layout.sharded and not s.per_layer_stack) \
            or s.args.moe is not None and not _xla_expert_stacks_kept(s):
        return full_grad
    return full_grad * s.layout.compute_bytes / s.layout.reduce_bytes


def _xla_expert_stacks_kept(s: Setting) -> bool:
    """An MoE model's scanned stacks kept gathered whole (re-sharding off) under expert parallelism
    and full checkpointing, compiled by XLA. Its backward loop writes every stack's full-size
    gradient in the compute dtype and nothing sharded: XLA's allocation of qwen3_30b_a3b with ep 4
    (all_to_all, v5p:2x2x4, 2026-12-07) at the loop's end holds the three gathered bf16 expert
    stacks [48, 32, 768|2048, 2048|768] (13.5 GiB) and their three bf16 gradient stacks of the same
    shapes (13.5 GiB), beside the attention's, no fp32 stack and no reduce-scatter output; those
    come after the loop (`_xla_expert_stacks_reduced`). Without ep the one kept MoE stack compiled
    held more (deepseek_v3_16b_tpu, `_xla_loop_gradient_stack`), so it keeps the fp32 count."""
    return s.args.moe is not None and s.layout.ep > 1 and _xla_scan_gradients_whole(s) and s.ac == "full" \
        and s.layout.sharded and not s.per_layer_stack and s.hf is None


def _xla_expert_stacks_reduced(s: Setting) -> float:
    """After that loop (`_xla_expert_stacks_kept`) XLA casts the gradient stacks to fp32 and
    reduce-scatters them: the non-expert stacks' casts alive together (flat f32 buffers, the
    attention's), the expert stacks one at a time, each as its fp32 cast and the cast split into its
    reduce-scatter's pieces (qwen3_30b_a3b ep 4's values at its peak: f32[192, 32, 192, 2048] made by
    a concatenate, 9.0 GiB, four f32[48, 32, 192, 2048] splits of it, 9.0 GiB, and f32 flats of
    918.8 M elements, the layers' attention and routers). 0 elsewhere."""
    if not _xla_expert_stacks_kept(s):
        return 0.0
    layout = s.layout
    expert_stack = s.expert_params / 3 / layout.ep  # one of an expert's three matrices, every MoE layer's
    dense = (s.block_params - s.expert_params) / layout.tp
    return (dense + 2 * expert_stack) * layout.reduce_bytes


def _xla_per_layer_loop(s: Setting) -> bool:
    """Scanned layers compiled by XLA, gathered and reduce-scattered per layer inside the loop (re-sharding
    on), under full checkpointing, every weight trained (not LoRA's frozen base): where `_xla_layer_loop`
    is the backward's full-size gradient."""
    return _xla_scan_gradients_whole(s) and s.ac == "full" and s.layout.sharded and s.per_layer_stack \
        and not s.lora


def _xla_layer_loop(s: Setting) -> float:
    """The full-size gradients XLA's backward loop holds over a stack gathered per layer: one weight
    matrix's fp32 gradient at a time (each cast and reduce-scattered on its own, not the whole layer's),
    and beside it, through the loop, the output projection's: its fp32 [vocab, dim] weight gradient or
    the loss's bf16 [tokens, vocab] gradient, whichever XLA keeps, counted as the larger of the two (an
    upper bound). Read from XLA's buffer assignment (2026-12-05 dumps): llama3_405b_tpu's backward loop
    holds one f32[53248, 16384] gradient at a time (3.25 GiB; the three of a feed-forward at disjoint
    times) and the output projection's f32[129024, 16384] gradient (7.9 GiB) from before the loop to
    after it; llama3_8b_v6e_tpu's one f32[14336, 4096] at a time and the f32 [vocab, dim] gradient
    through the loop, the logits' gradient freed before it (there the bound counts 1.96 GiB more than
    the loop holds); deepseek_v3_16b_tpu's loop ends with the logits' gradient alive, the weight
    gradient after the loop (an earlier dump, as the recipe test's note on that row read it). An MoE
    layer's largest matrix is its local expert stack."""
    args, layout = s.args, s.layout
    matrix = args.dim * args.ffn_hidden_dim
    if args.moe is not None:
        matrix = max(matrix, args.moe.num_experts * args.dim * args.moe.hidden_dim / layout.ep)
    tp = s.cfg.parallelism.tp
    output = max(s.tokens // s.cfg.parallelism.cp * args.vocab_size * layout.compute_bytes,
                 args.vocab_size * args.dim * layout.master_bytes()) / tp
    return matrix / tp * layout.reduce_bytes + output


def _xla_backward_end(s: Setting) -> float:
    """What XLA's TPU program holds at the backward's end beside every gradient shard: three fp32
    [vocab, dim] matrices at once, the output projection's full-size gradient (computed first,
    its reduce-scatter scheduled late), the embedding's scatter-add gradient and its cast (XLA's
    live ranges of qwen3_8b_graph_tpu at its peak). Sharded, trained embeddings under XLA only."""
    if s.cfg.compile.backend not in XLA_BACKENDS or not s.graph or s.lora or \
            s.layout.dp_shard * s.layout.dp_replicate == 1:
        return 0.0
    return 3.0 * s.vocab_size * s.dim * s.layout.master_bytes() / s.cfg.parallelism.tp


def copies_gathered(s: Setting, gathered: float, scan: ScanAutogradMemory) -> float:
    """The part of scan's saved weight copies that are the gathered weights themselves, counted
    once: all of them when each layer is gathered inside the loop (the body's gathered weights are
    what it saves); none when the whole stack stays gathered, where the copies (MoE experts'
    transposed views for the grouped matmul) are buffers of their own beside the gathered stack
    (XLA's buffers for DeepSeek-V3 16B without checkpointing: each expert stack gathered and, beside
    it, transposed)."""
    return min(gathered, scan.weight_copies) if s.gather == "layer" else 0.0


def moe_dispatch_bytes(s: Setting) -> float:
    """Part of the activations: what expert parallelism adds (each rank's experts see the ep
    group's tokens: ep times the dispatched rows), counted as the run's checkpointing keeps them."""
    p = s.cfg.parallelism
    with_ep, one_rank = (activation_bytes(s.args, tokens=s.tokens // p.cp, ac_mode=s.ac,
                                          dtype_bytes=s.layout.compute_bytes, ep=ep, traced=s.traced,
                                          partitioned=s.partitioned, tp=p.tp, padded_values=s.padded_values)
                         for ep in (p.ep, 1))
    return with_ep.saved - one_rank.saved + with_ep.recompute - one_rank.recompute
