"""The planner: a config (and hardware) -> per-device memory, FLOPs, communication, step time,
tokens/s and MFU. `plan_run` adds up terms that live in rooms of their own, each a pure function of
the config resolved for planning (setting.py `Setting`: the run setup, its hardware and mesh, the
kernels `auto` picks), the terms themselves beside the code they describe:

* memory.py: bytes per device by term, and the moments of a step whose largest is the peak (the
  model's activations, scan's own autograd, the loss kernel, the parallel layout, AdamW);
* step_time.py: FLOPs, collectives at the rate of the fabric each crosses, step time with and
  without overlap and what it rests on, and the checkpoint's save times;
* fp8.py: what running the blocks' linears as fp8 matmuls changes (the config's [fp8], or a what-if);
* text.py: the report `titan-tpu plan` prints, and what to change when a plan does not fit.

Here: the `Plan` they add up to, and parallelism.reshard_after_forward auto decided by the memory
terms of the run with the gathered weights kept (`reshard_choice`, which a run and `titan-tpu compile`
ask through components/resolve.py; `with_reshard_resolved` for a plan).
"""

from __future__ import annotations

import copy
import dataclasses

from titan_tpu.config import Config
from titan_tpu.models.registry import num_active_params, num_expert_params, num_params
from titan_tpu.parallel.plan_terms import Layout
from titan_tpu.plan.fabric import axis_rates
from titan_tpu.plan.fp8 import fp8_experts_on, fp8_setting, fp8_terms
from titan_tpu.plan.hardware import Hardware
from titan_tpu.plan.memory import StepMemory, step_memory
from titan_tpu.plan.pipeline_terms import ahead_layers
from titan_tpu.plan.result import Plan
from titan_tpu.plan.setting import Setting, default_hardware, loss_impl, resolve_setting
from titan_tpu.plan.step_time import (
    LOCAL_GBPS,
    STORAGE_GBPS,
    checkpoint_time,
    cpu_share,
    speed_basis,
    step_collectives,
    step_flops,
    step_time,
)
from titan_tpu.plan.text import advice
from titan_tpu.run.resolved import Reshard, ResolvedRun
from titan_tpu.run.setup import RunSetup

__all__ = ["plan_config", "plan_run", "planned_memory", "reshard_choice", "with_reshard_resolved"]


def plan_config(cfg: Config, hardware: Hardware | None = None, *, chips: int | None = None,
                measure: bool = True, gather: str | None = None, model_args=None, as_compiled: bool = False,
                fp8: bool | None = None) -> Plan:
    """`plan_run` of a config whose model is resolved here (`RunSetup.resolved`): a what-if that
    changes the config (a search's candidates, calibration, verify) plans through this."""
    return plan_run(RunSetup.resolved(cfg), hardware, chips=chips, measure=measure, gather=gather,
                    model_args=model_args, as_compiled=as_compiled, fp8=fp8)


def plan_run(setup: RunSetup, hardware: Hardware | None = None, *, chips: int | None = None,
             measure: bool = True, gather: str | None = None, model_args=None, as_compiled: bool = False,
             storage_gbps: float = STORAGE_GBPS, local_gbps: float = LOCAL_GBPS, fp8: bool | None = None) -> Plan:
    """The plan of a resolved run (run/setup.py: its config and model spec, not resolved again)
    on `hardware` (default: what the config names, see `default_hardware`)
    with `chips` chips (default: the config's mesh, or the chip count the recipe names).
    gather: None for what the code does with this config (`code_gather`), or "model" / "layer"
    as a what-if (parallel/plan_terms.py Layout.gather). model_args: the model's TransformerArgs when
    they are not a flavor of the table (titan-tpu verify of an HF directory); default: the config's.
    storage_gbps, local_gbps: write bandwidths (GB/s) of the checkpoint storage (the whole job) and
    of each device's local tier, for the checkpoint times (step_time.py `checkpoint_time`).

    Composes the terms of the rooms (the module docstring), each a pure function of the resolved
    `Setting` (and of terms computed before it) returning one named quantity.
    parallelism.reshard_after_forward auto is planned as what the trainer resolves it to
    (`with_reshard_resolved`).

    as_compiled: plan the program `titan-tpu compile` hands XLA rather than the one TorchTPU runs
    (docs/planner.md "The compiled program"; always for compile.backend jax, which runs it): the
    parameters and moments donated and updated in place (planned out of place otherwise, as
    torch-tpu's Dynamo backend writes them, until a TPU run shows the trainer's donation taking
    effect: plan/torchtpu.py), and tokamax's loss in its plain-XLA form (its Mosaic kernel cannot be
    traced without a chip), which holds the bf16 logits.

    fp8: plan the blocks' linears as fp8 matmuls (True) or in the compute dtype (False), a what-if;
    None: as the config's [fp8] section says (`fp8_setting`). See fp8.py `fp8_terms`."""
    s = _planned_setting(setup, hardware, chips=chips, measure=measure, gather=gather, model_args=model_args,
                         as_compiled=as_compiled, fp8=fp8)
    memory, fp8_cost = planned_memory(s)
    flops = step_flops(s)
    if s.fp8:
        _add_fp8_flops(fp8_cost, flops=flops)
    phases = memory.terms["phases"]
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    collectives = step_collectives(s)
    rates = axis_rates(s.hardware, s.layout, slices=s.cfg.parallelism.slices)
    timing = step_time(s, executed_rank=flops["executed_per_step_per_device"], collectives=collectives,
                       rates=rates, fp8=fp8_cost if s.fp8 else None)
    tokens_step_rank = s.tokens * s.cfg.training.grad_accum_steps
    step_s = timing["step_s"]
    basis = speed_basis(s, timing["efficiency"])
    plan = Plan(
        model=s.label, hardware=s.hardware.as_dict(), devices=s.devices, mesh=_mesh_summary(s),
        batch=_batch_summary(s, tokens_step_rank=tokens_step_rank),
        params=_params_summary(s),
        memory=memory.terms, peak_bytes=peak, peak_phase=peak_phase, capacity_bytes=s.hardware.memory_bytes,
        fits=peak <= s.hardware.memory_bytes, flops=flops,
        communication=[{**dataclasses.asdict(c), **rates[c.axis].as_dict()} for c in collectives], time=timing,
        tokens_per_s=tokens_step_rank * s.devices / s.ranks_per_batch / step_s if basis else None,
        mfu=100.0 * flops["model_per_step_per_device"] / step_s / (s.hardware.peak_flops / cpu_share(s))
        if basis else None, speed_basis=basis, pipeline=_pipeline_summary(s))
    plan.advice = advice(plan, s.cfg, acts_share=memory.activations_held / peak if peak else 0.0)
    plan.checkpoint = checkpoint_time(s, step_s=step_s if basis else None, storage_gbps=storage_gbps,
                                      local_gbps=local_gbps)
    return plan


def _planned_setting(setup: RunSetup, hardware: Hardware | None, *, chips: int | None, measure: bool,
                     gather: str | None, model_args, as_compiled: bool, fp8: bool | None) -> Setting:
    """The setting `plan_run` plans (see there for the arguments): re-sharding auto resolved as the
    trainer resolves it, the program compiled or run, fp8 as asked or as the config says."""
    if setup.cfg.parallelism.reshard_after_forward == "auto":
        setup = dataclasses.replace(setup, cfg=with_reshard_resolved(setup, hardware, chips=chips, measure=measure,
                                                                     model_args=model_args))
    s = resolve_setting(setup, hardware, chips=chips, measure=measure, gather=gather, model_args=model_args)
    enabled, scaling = fp8_setting(s.cfg)
    # The JAX path runs the program titan-tpu compile hands XLA: its plan is always that program's.
    as_compiled = as_compiled or setup.cfg.compile.backend == "jax" and setup.cfg.training.mode == "graph"
    fp8 = enabled if fp8 is None else fp8
    if fp8 and s.hf is not None:
        raise ValueError("the planner's fp8 terms count a native model's block linears; plan an hf model with "
                         "fp8.enabled false")
    return dataclasses.replace(s, as_compiled=as_compiled, fp8=fp8, fp8_scaling=scaling,
                               fp8_experts=fp8 and fp8_experts_on(s.cfg))


def _params_summary(s: Setting) -> dict:
    """The plan's `params`: parameter elements of the whole model (LoRA's adapters apart) and what a
    device stores; an hf model's by part too, as measured (plan/hf_terms.py)."""
    if s.hf is not None:  # a token runs top_k of the stacked experts (plan/hf_terms.py)
        experts = s.expert_params
        active = s.whole_base_params - experts + experts * s.hf.top_k // max(s.hf.num_experts, 1)
        return {"total": s.whole_base_params, "active": active, "experts": experts,
                "stored_per_device": s.stored, "parts": s.hf.params.parts()}
    return {"total": num_params(s.model_args), "active": num_active_params(s.model_args),
            "experts": num_expert_params(s.model_args), "stored_per_device": s.stored}


def planned_memory(s: Setting) -> tuple[StepMemory, dict[str, float] | None]:
    """(the step's memory terms, fp8's terms or None): memory.py's terms with fp8's copies and scales
    added (fp8.py `fp8_terms`). Those are transient within a layer's matmuls: alive in the backward
    moment (a layer's backward), not at the forward's end (the loss, outside the layers)."""
    memory = step_memory(s)
    if not s.fp8:
        return memory, None
    cost = fp8_terms(s)
    memory.terms["fp8_copies"] = cost["copies_bytes"]
    memory.terms["fp8_scales"] = cost["scales_bytes"]
    memory.terms["phases"]["backward"] += cost["copies_bytes"] + cost["scales_bytes"]
    return memory, cost


def _add_fp8_flops(cost: dict[str, float], *, flops: dict) -> None:
    flops["fp8_executed_per_step_per_device"] = cost["flops"]
    if "expert_flops" in cost:  # fp8.experts: the experts' share of them
        flops["fp8_expert_executed_per_step_per_device"] = cost["expert_flops"]


def _mesh_summary(s: Setting) -> dict:
    """The plan's `mesh`: the layout's sizes, its data-parallel mode and how gathered weights are kept."""
    p, layout = s.cfg.parallelism, s.layout
    return {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "ep": p.ep, "tp": p.tp, "cp": p.cp,
            "pp": p.pp, "slices": p.slices, "mode": _mode(layout), "gather": s.gather, "code_gather": s.code_gather}


def _pipeline_summary(s: Setting) -> dict:
    """The plan's `pipeline`: the schedule and what the plan counts for it (plan/pipeline_terms.py);
    empty without stages."""
    schedule = s.schedule
    if schedule is None:
        return {}
    return {"stages": schedule.stages, "micro_batches": schedule.micro_batches, "repeats": schedule.repeats,
            "iterations": schedule.iterations, "bubble": schedule.bubble, "padding": schedule.padding,
            "layers_per_stage": schedule.rows // schedule.stages, "layers_per_chunk": schedule.layers_per_chunk,
            "layers_ahead": ahead_layers(s.model_args, schedule),
            "micro_batch_rows": s.cfg.training.batch_size // schedule.micro_batches}


def _batch_summary(s: Setting, *, tokens_step_rank: int) -> dict:
    """The plan's `batch`: what one step trains on, and the choices that shape its memory and time."""
    t = s.cfg.training
    return {"batch_size": t.batch_size, "seq_len": t.seq_len, "grad_accum_steps": t.grad_accum_steps,
            "tokens_per_step": tokens_step_rank * s.devices // s.ranks_per_batch, "dtype": s.dtype,
            "activation_checkpoint": s.ac, "scan_layers": s.scanned,
            "loss": loss_impl(s.cfg.kernels.loss, s.hardware.name), "mode": t.mode,
            **({"fp8": s.fp8_scaling} if s.fp8 else {}),
            # the program titan-tpu compile hands XLA: donated update, tokamax's plain-XLA form
            **({"as_compiled": True} if s.as_compiled else {})}


def with_reshard_resolved(setup: RunSetup | Config, hardware: Hardware | None = None, *, chips: int | None = None,
                          measure: bool = True, model_args=None) -> Config:
    """`cfg` with parallelism.reshard_after_forward auto resolved as a run resolves it (`reshard_choice`):
    "false" where the gathered block weights kept from the forward to the backward fit the device, else
    "true". Other values: `cfg` itself."""
    setup = setup if isinstance(setup, RunSetup) else RunSetup.resolved(setup)
    cfg = setup.cfg
    if cfg.parallelism.reshard_after_forward != "auto":
        return cfg
    keep = _kept_weights_fit(setup, hardware, chips=chips, measure=measure, model_args=model_args)
    resolved = copy.copy(cfg)
    resolved.parallelism = dataclasses.replace(cfg.parallelism, reshard_after_forward="false" if keep else "true")
    return resolved


def _kept_weights_fit(setup: RunSetup, hardware: Hardware | None, *, chips: int | None, measure: bool,
                      model_args=None) -> bool:
    """Whether the step's peak with the gathered block weights kept from the forward to the backward
    (re-sharding off) fits the device: memory terms only (`planned_memory`)."""
    kept = copy.copy(setup.cfg)
    kept.parallelism = dataclasses.replace(setup.cfg.parallelism, reshard_after_forward="false")
    s = _planned_setting(dataclasses.replace(setup, cfg=kept), hardware, chips=chips, measure=measure, gather=None,
                         model_args=model_args, as_compiled=False, fp8=None)
    phases = planned_memory(s)[0].terms["phases"]
    return max(phases.values()) <= s.hardware.memory_bytes


def reshard_choice(run: ResolvedRun, hardware: Hardware | None = None) -> Reshard:
    """parallelism.reshard_after_forward auto for a resolved run (run/resolved.py): keep the gathered block
    weights from the forward to the backward where the plan that keeps them fits the device (re-sharding
    would only add an all-gather per block to the backward), on the hardware the config names (or
    `hardware`); re-shard where the planner cannot plan the run (an unnamed GPU). Read off the memory
    terms alone: nothing of the plan's time or advice is computed."""
    try:
        if hardware is None:
            hardware, _ = default_hardware(run.cfg, measure=False)
        chips = max(run.world_size // hardware.devices_per_chip, 1)
        keep = _kept_weights_fit(run.setup, hardware, chips=chips, measure=False)
    except ValueError as e:
        return Reshard(True, f"the planner cannot plan this run ({str(e).split(';')[0]})")
    return Reshard(False, "the plan that keeps them fits") if keep else \
        Reshard(True, "the plan that keeps them does not fit")


def _mode(layout: Layout) -> str:
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return "hybrid_shard"
    if layout.dp_shard > 1:
        return "fully_shard"
    return "replicate" if layout.dp_replicate > 1 else "none"
