"""The plan's FLOPs, collectives and time: per device per step, and how long a checkpoint save takes.

FLOPs: the model's per token (models/registry.py, the same `flops_per_token` the trainer logs MFU
with), and what runs: the recomputed forward under full activation checkpointing.

Time: compute = executed FLOPs / (peak x efficiency); elementwise work = memory traffic of the
activations and of the optimizer / (memory bandwidth x elementwise efficiency, fitted on the CPU's
eager runs); collectives (parallel/plan_terms.py) = bytes / the rate of the fabric each one's mesh
axis crosses (plan/fabric.py: NVLink or ICI inside a node or slice, InfiniBand or DCN between
them). Step time without overlap sums them; with overlap, collectives hide behind compute and only
the excess shows. Eager runs (no scheduler to overlap) use the first, graph mode the second.

Pipeline stages (plan/pipeline_terms.py): a device's FLOPs are 1 / pp of its data-parallel rank's;
its block work is stretched by the bubble, the output projection runs on the last stage alone; the
permutes and the shared weights' gradient sums are collectives over pp.

A Transformers-backend model's FLOPs are the trainer's count and its layers' measured forward
(plan/hf_terms.py); its collectives are SimpleFSDP's over its one piece: every weight gathered and
its gradient reduced in runs of bucket_mb, once per micro-batch.
"""

from __future__ import annotations

from titan_tpu.kinds.record import reference_flops
from titan_tpu.models.common.activation_memory import activation_bytes
from titan_tpu.models.registry import (
    flops_per_token,
    frozen_weight_gradient_flops_per_token,
    num_expert_params,
    num_params,
    recomputed_flops_per_token,
)
from titan_tpu.parallel.plan_terms import collective_calls, cp_collectives
from titan_tpu.plan.pipeline_terms import (
    ahead_flops_device,
    head_flops_device,
    pipeline_collectives,
    shared_params,
    stage_compute_flops,
)
from titan_tpu.plan.setting import TPU_NAMES, Setting, attention_widths, layer_params

__all__ = ["LOCAL_GBPS", "STORAGE_GBPS", "checkpoint_time", "cpu_share", "speed_basis", "step_collectives",
           "step_flops", "step_time"]

# Stated defaults for the checkpoint times: a job's aggregate write rate to object storage or a
# network filesystem, and one device's copy to host memory (the local tier). Pass measured ones.
STORAGE_GBPS = 1.0
LOCAL_GBPS = 5.0


def step_flops(s: Setting) -> dict[str, float]:
    """The trainer's FLOPs count, and what runs (recomputed forwards under full checkpointing)."""
    t = s.cfg.training
    args = s.model_args  # the whole model's: a pipeline stage's share is 1 / pp of a rank's tokens' work
    # A native LoRA run's frozen base gets no weight gradients (autograd computes none; the captured
    # step has none): 2 of its 6 FLOPs per weight and token are not done, and MFU counts the work done
    # (components/program.py `flops_per_token`). The adapters' own work is left out (< 1%); an hf
    # model's count reads which weights are frozen itself (models/hf/flops.py).
    frozen = frozen_weight_gradient_flops_per_token(args) if s.lora and not s.hf else 0.0
    fpt = s.hf.flops_per_token if s.hf else flops_per_token(args, t.seq_len) - frozen
    tokens_step_rank = s.tokens * t.grad_accum_steps  # tokens of one data-parallel rank (its tp ranks share them)
    share = s.ranks_per_batch
    model_flops_rank = fpt * tokens_step_rank / share
    # Full checkpointing reruns the blocks' forward in the backward; the output projection and the
    # loss are outside the checkpointed blocks and run once.
    recomputed = 0.0
    if s.ac == "full":
        recomputed = s.hf.recompute_flops_per_token if s.hf else recomputed_flops_per_token(args, t.seq_len)
    reference = reference_flops(s.kind, s.cfg, fpt)  # a frozen reference's forwards (no backward)
    if reference:
        return {"per_token": fpt, "reference_per_token": reference,
                "model_per_step_per_device": (fpt + reference) * tokens_step_rank / share,
                "executed_per_step_per_device": (fpt + recomputed + reference) * tokens_step_rank / share}
    return {"per_token": fpt, "model_per_step_per_device": model_flops_rank,
            "executed_per_step_per_device": (fpt + recomputed) * tokens_step_rank / share}


def step_collectives(s: Setting) -> list:
    """The collectives of one step (parallel/plan_terms.py)."""
    if s.hf is not None:
        return _hf_collectives(s)
    args, t, p = s.args, s.cfg.training, s.cfg.parallelism
    cb = s.layout.compute_bytes
    outside = 2 if args.tie_embeddings else 3
    if s.schedule is not None:
        # A pipeline stage reads each stacked weight of its rows whole, once per accumulated batch
        # (parallel/pipeline.py: no buckets), and reduce-scatters its gradient once.
        gathers, regathers = max(_layer_tensors(args)) + outside, 0
    else:
        gathers, regathers = collective_calls(
            tensors_per_layer=_layer_tensors(args), bytes_per_layer=[g * cb for g in layer_params(args)],
            outside_tensors=outside, bucket_bytes=p.bucket_mb * 2**20,
            scanned_whole=s.scanned and not s.per_layer_stack, regather=s.gather == "layer")
    # Gradients exist for the trained elements only: LoRA's adapters (its frozen base none; LoRA
    # leaves the experts frozen), else every weight.
    trained = (s.adapter_params, 0) if s.lora else (num_params(args), num_expert_params(args))
    collectives = s.layout.step_collectives(total_params=num_params(args), expert_params=num_expert_params(args),
                                            trained_params=trained[0], trained_expert_params=trained[1],
                                            micro_batches=t.grad_accum_steps, moe_layers=args.num_moe_layers,
                                            tokens_per_micro_batch=s.tokens, dim=args.dim,
                                            top_k=args.moe.top_k if args.moe else 0, recompute_blocks=s.ac == "full",
                                            regathered_params=s.block_params if s.gather == "layer" else 0,
                                            gathers=gathers, regathers=regathers, n_layers=args.n_layers,
                                            num_experts=args.moe.num_experts if args.moe else 0)
    if p.cp > 1:
        _, k_dim, v_dim = attention_widths(args, p.tp)
        collectives += cp_collectives(cp=p.cp, micro_batches=t.grad_accum_steps, n_layers=args.n_layers,
                                      kv_elements=s.tokens * k_dim, v_elements=s.tokens * v_dim, compute_bytes=cb,
                                      documents_tokens=s.tokens if s.run.documents else 0,
                                      recompute_blocks=s.ac != "none")
    if s.schedule is not None:
        shared = shared_params(args, s.schedule)  # the weights outside the stack, whole on every stage
        collectives += pipeline_collectives(schedule=s.schedule, tokens=s.tokens, dim=args.dim,
                                            accum=t.grad_accum_steps, compute_bytes=cb,
                                            shared_params=s.layout.stored_elements(shared),
                                            shared_tensors=2 if args.tie_embeddings else 3, split=p.tp * p.cp,
                                            tp=p.tp)
    return collectives


def _hf_collectives(s: Setting) -> list:
    """An hf model's: one piece (HFCausalLM.init_plan) gathered in runs of bucket_mb, or per
    parameter, and nothing gathered again in the backward (nothing is re-sharded after a layer)."""
    t, p = s.cfg.training, s.cfg.parallelism
    params = s.base_params + s.adapter_params
    gathers, _ = collective_calls(tensors_per_layer=[s.hf.params.tensors],
                                  bytes_per_layer=[params * s.layout.compute_bytes], outside_tensors=0,
                                  bucket_bytes=p.bucket_mb * 2**20, scanned_whole=True, regather=False)
    hf = s.hf
    return s.layout.step_collectives(total_params=params, expert_params=s.expert_params,
                                     trained_params=hf.params.trained, trained_expert_params=hf.params.experts_trained,
                                     micro_batches=t.grad_accum_steps, moe_layers=hf.moe_layers,
                                     tokens_per_micro_batch=s.tokens, dim=s.dim, top_k=hf.top_k,
                                     num_experts=hf.num_experts, recompute_blocks=s.ac == "full", gathers=gathers,
                                     n_layers=s.n_layers)


def _layer_tensors(args) -> list[int]:
    """Parameter tensors of each block: wq wk wv wo, two norms (and q/k norms), then w1 w2 w3 or
    an MoE layer's router and three expert stacks."""
    attention = 4 + 2 + (2 if args.qk_norm else 0)
    return [attention + (4 if args.is_moe_layer(i) else 3) for i in range(args.n_layers)]


def step_time(s: Setting, *, executed_rank: float, collectives: list, rates: dict, fp8: dict | None = None) -> dict:
    """Seconds per step: compute, elementwise work and collectives (the module docstring), each
    collective at the rate of the fabric its axis crosses (`rates`, plan/fabric.py). fp8:
    `fp8_terms` when the blocks' linears run as fp8 matmuls: their FLOPs at the fp8 peak, their
    casts as elementwise traffic."""
    hardware, t, p = s.hardware, s.cfg.training, s.cfg.parallelism
    efficiency, elementwise_efficiency, _ = hardware.mode_constants(graph=s.graph)
    share = cpu_share(s)
    peak_flops = hardware.peak_flops / share
    fp8_flops = fp8["flops"] if fp8 else 0.0
    stretch = 1.0
    if s.schedule is not None:  # the bubble stretches a stage's block work, not the head's (run on every stage's share)
        head = head_flops_device(s.args, tokens_device=s.tokens * t.grad_accum_steps / s.ranks_per_batch)
        ahead = ahead_flops_device(s.model_args, s.schedule, seq_len=t.seq_len,
                                   tokens_device=s.tokens * t.grad_accum_steps * p.pp / s.ranks_per_batch)
        stretched = stage_compute_flops(executed_device=executed_rank, head_device=head, schedule=s.schedule,
                                        ahead_device=ahead)
        stretch = 1.0 / (1.0 - s.schedule.bubble)
        executed_rank = stretched
    compute_s = (executed_rank - fp8_flops) / (peak_flops * efficiency) + \
        (fp8_flops / (fp8["peak_flops"] / share * efficiency) if fp8 else 0.0)
    if s.hf is not None:
        none_acts = s.hf.activations(rows=s.tokens // t.seq_len, ac_mode="none", traced=False)
    else:
        none_acts = activation_bytes(s.args, tokens=s.tokens // p.cp, ac_mode="none",
                                     dtype_bytes=s.layout.compute_bytes, ep=p.ep, tp=p.tp,
                                     padded_values=s.padded_values)
    # Every intermediate is written in the forward and read and written in the backward (again when
    # recomputed); AdamW and clipping stream parameters, gradients and moments about twelve times.
    # A pipeline stage's activation work waits in the bubble like its matmuls (`stretch`).
    elementwise_bytes = 3 * (none_acts.saved + (none_acts.saved if s.ac != "none" else 0)) * t.grad_accum_steps \
        * stretch + 12 * s.stored * s.layout.master_bytes() + (fp8["cast_bytes"] if fp8 else 0.0)
    elementwise_s = elementwise_bytes / (hardware.memory_bandwidth / share * elementwise_efficiency)
    comm_s = sum(c.bytes_per_step / rates[c.axis].bandwidth for c in collectives) + \
        sum(c.calls for c in collectives) * hardware.collective_latency
    no_overlap = compute_s + elementwise_s + comm_s
    overlap = compute_s + elementwise_s + max(0.0, comm_s - compute_s)
    # Eager runs have no scheduler to overlap collectives with compute; graph mode does.
    return {"compute_s": compute_s, "elementwise_s": elementwise_s, "collectives_s": comm_s,
            "step_s_no_overlap": no_overlap, "step_s_overlap": overlap,
            "step_s": overlap if s.graph else no_overlap, "overlap_assumed": s.graph, "efficiency": efficiency,
            "elementwise_efficiency": elementwise_efficiency,
            **({"pipeline_bubble": s.schedule.bubble} if s.schedule is not None else {}),
            **({"fp8_peak_flops": fp8["peak_flops"], "fp8_cast_bytes": fp8["cast_bytes"]} if fp8 else {})}


def speed_basis(s: Setting, efficiency: float) -> str | None:
    """What the predicted step time rests on, or None where nothing does: TorchTPU's eager mode runs
    the step op by op for debugging, and no eager TPU step has been measured, so the planner gives no
    eager TPU speed rather than one that looks as good as graph mode's."""
    if s.hardware.name == "cpu":
        return "fitted to this project's CPU runs (titan-tpu plan --calibrate)"
    if s.hardware.name in TPU_NAMES and not s.graph:
        return None
    return f"an assumption: matmul work at {efficiency:.0%} of peak (never measured on {s.hardware.name})"


def cpu_share(s: Setting) -> int:
    """On this CPU the ranks share the cores: each gets 1 / devices of the peak."""
    return s.devices if s.hardware.name == "cpu" else 1


def checkpoint_time(s: Setting, *, step_s: float | None, storage_gbps: float, local_gbps: float) -> dict:
    """How long a save takes and whether checkpoint.grace_seconds holds it (train/local_tier.py).

    The persistent checkpoint holds every parameter once (DCP writes one copy of replicated shards)
    and the AdamW moments of the trained ones, at master precision, through the storage's aggregate
    bandwidth; the local tier is each device's own shards, all devices writing at once. On SIGTERM
    the step in flight ends first, so the budget must hold a step and the local tier."""
    mb = s.layout.master_bytes()
    stored = s.whole_base_params + s.adapter_params
    total = (stored + 2 * s.whole_trained) * mb
    per_device = (s.stored + 2 * s.trained) * mb
    persistent_s, local_s = total / (storage_gbps * 1e9), per_device / (local_gbps * 1e9)
    grace, step = s.cfg.checkpoint.grace_seconds, step_s or 0.0
    if not grace:
        verdict = "no grace budget set (checkpoint.grace_seconds): SIGTERM writes the persistent checkpoint"
    elif step + persistent_s <= grace:
        verdict = f"the {grace:g} s grace budget holds a full save"
    elif step + local_s <= grace:
        verdict = (f"the {grace:g} s grace budget needs the local tier (a step and the local tier take "
                   f"{step + local_s:.3g} s; the persistent checkpoint follows at the next start)")
    else:
        verdict = (f"the {grace:g} s grace budget is too short even for the local tier (a step and the local tier "
                   f"take {step + local_s:.3g} s)")
    return {"bytes_total": total, "bytes_per_device": per_device, "storage_gbps": storage_gbps,
            "local_gbps": local_gbps, "persistent_s": persistent_s, "local_s": local_s, "grace_seconds": grace,
            "verdict": verdict}
