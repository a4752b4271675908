"""The planner: a config (and hardware) -> per-device memory, FLOPs, communication, step time,
tokens/s and MFU. It adds up terms that live beside the code they describe:

* the model: parameter counts and FLOPs per token (models/registry.py, the same `flops_per_token`
  the trainer logs MFU with), activations per layer per activation-checkpointing mode
  (models/common/activation_memory.py `activation_bytes` and the per-module functions it calls);
* scanned layers in graph mode without full checkpointing: what scan's own autograd holds (the
  modules' partitioned counts, models/common/scan.py `scan_autograd_memory`);
* the loss kernel: what it keeps and its peak (kernels/loss.py `loss_memory_bytes`);
* the parallel layout: stored shards, gathered weights, full-size gradients and collective bytes
  (parallel/plan_terms.py);
* AdamW: two moments like each parameter, and one temporary like the parameters during its update
  (train/optim.py: the foreach sqrt of the second moment).

Memory is the largest of the moments of a step (rank 0's view; every rank is alike):
forward end (all activations kept, the loss kernel at its peak), backward (activations of the
layers below and gradients of the layers above, plus one recomputed layer and the largest
full-size gradient), under XLA the backward's end (`_xla_backward_end`) and the optimizer update
(gradients and the AdamW temporary).

Time: compute = executed FLOPs (the model's, plus the recomputed forward under full activation
checkpointing) / (peak x efficiency); elementwise work = memory traffic of the activations and of
the optimizer / (memory bandwidth x elementwise efficiency, fitted on the CPU's eager runs);
collectives = bytes / the rate of the fabric each one's mesh axis crosses (plan/fabric.py: NVLink or
ICI inside a node or slice, InfiniBand or DCN between them). Step time without overlap sums them; with overlap,
collectives hide behind compute and only the excess shows.
Eager runs (no scheduler to overlap) use the first, graph mode the second.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field

from titan_tpu.config import Config, grad_accum_from_tokens
from titan_tpu.kernels.loss import loss_memory_bytes
from titan_tpu.models.common.activation_memory import ActivationBytes, activation_bytes
from titan_tpu.models.common.rope import rope_real_saved_per_position
from titan_tpu.models.common.scan import ScanAutogradMemory, scan_autograd_memory
from titan_tpu.models.registry import (
    MODEL_NAMES,
    flops_per_token,
    largest_param,
    num_active_params,
    num_expert_params,
    num_params,
    recomputed_flops_per_token,
)
from titan_tpu.parallel.context_parallel import check_context_parallel, cp_attention_saved_bytes
from titan_tpu.parallel.mesh import check_cp_with_ep
from titan_tpu.parallel.plan_terms import Layout, collective_calls, cp_collectives
from titan_tpu.parallel.tensor_parallel import check_tensor_parallel
from titan_tpu.plan.fabric import axis_rates
from titan_tpu.plan.hardware import Hardware, resolve_hardware
from titan_tpu.run_setup import RunSetup
from titan_tpu.train.optim import update_buffers

__all__ = ["Plan", "TPU_NAMES", "plan_config", "plan_run", "format_plan", "default_hardware", "for_planning",
           "setup_for_planning", "reshard_decision", "fp8_beside", "fp8_linear_params", "fp8_note", "fp8_setting"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Stated defaults for the checkpoint times: a job's aggregate write rate to object storage or a
# network filesystem, and one device's copy to host memory (the local tier). Pass measured ones.
STORAGE_GBPS = 1.0
LOCAL_GBPS = 5.0


@dataclass
class Plan:
    model: str
    hardware: dict
    devices: int
    mesh: dict
    batch: dict
    params: dict
    memory: dict  # bytes per device, by term
    peak_bytes: float
    peak_phase: str
    capacity_bytes: float
    fits: bool
    flops: dict
    communication: list
    time: dict
    tokens_per_s: float | None  # None where nothing grounds a step time (`speed_basis`)
    mfu: float | None  # percent, model FLOPs over peak, as the trainer logs it; None as tokens_per_s
    speed_basis: str | None = None  # what the step time rests on; None: no basis (eager mode on a TPU)
    advice: list = field(default_factory=list)
    checkpoint: dict = field(default_factory=dict)  # `_checkpoint_time`: save times and the grace budget

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


@contextlib.contextmanager
def planning_machine():
    """Config checks as the machine a config is written for would run them. Planning runs
    nothing, so the one check that needs that machine's software (compile.backend tpu wants
    TorchTPU installed) is answered yes; every other check runs as usual."""
    from titan_tpu import device

    saved = device._tpu_installed
    device._tpu_installed = lambda: True
    try:
        yield
    finally:
        device._tpu_installed = saved


def setup_for_planning(toml_path, overrides: list[str] | None = None) -> RunSetup:
    """The run setup as the machine the config is written for would make it (`planning_machine`)."""
    from titan_tpu.config import build_config
    from titan_tpu.run_setup import prepare_run

    with planning_machine():
        return prepare_run(build_config(toml_path, overrides))


def for_planning(toml_path, overrides: list[str] | None = None) -> Config:
    """The config as the machine it is written for would load it (`planning_machine`)."""
    return setup_for_planning(toml_path, overrides).cfg


def default_hardware(cfg: Config, *, measure: bool = True) -> tuple[Hardware, int | None]:
    """The hardware a config names: training.device cpu (or auto here) is this machine; a TPU
    recipe names its slice in job.description ("TPU v5p-2048: 1,024 chips")."""
    t = cfg.training.device
    if t in ("cpu", "auto"):
        return resolve_hardware("cpu", measure=measure, dtype=cfg.model.dtype)
    if t == "tpu":
        from titan_tpu.device import tpu_generation

        gen = tpu_generation(cfg.job.description)
        chips = re.search(r"([\d,]+) chips", cfg.job.description)
        if gen is None or chips is None:
            raise ValueError("training.device = tpu: name the hardware with --hardware (e.g. v5p-1024) or write "
                             "'TPU v5p-1024: 512 chips' into job.description")
        hw, _ = resolve_hardware(gen, measure=measure)
        return hw, int(chips.group(1).replace(",", ""))
    gpu = re.search(r"\b(h100|h200|b200)\b", cfg.job.description, re.IGNORECASE)
    gpus = re.search(r"([\d,]+) GPUs", cfg.job.description)
    if t == "cuda" and gpu is not None and gpus is not None:  # a GPU recipe: "... 32 H100 ...: 32 GPUs"
        hw, _ = resolve_hardware(gpu.group(1).lower(), measure=measure)
        return hw, int(gpus.group(1).replace(",", ""))
    raise ValueError(f"training.device = {t}: name the GPU with --hardware (one of h100, h200, b200) or write "
                     "'H100: 32 GPUs' into job.description")


def _mesh(cfg: Config, devices: int | None) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, devices) with dp_shard = -1 resolved, or a one-line error."""
    p = cfg.parallelism
    others = p.dp_replicate * p.cp * p.tp
    if devices is None:  # a CPU run: the mesh says how many ranks
        devices = others * (p.dp_shard if p.dp_shard > 0 else 1)
    if p.dp_shard == -1:
        if devices % others:
            raise ValueError(f"parallelism.dp_replicate x cp x tp = {others} does not divide the {devices} devices; "
                             "choose a divisor")
        return p.dp_replicate, devices // others, devices
    if others * p.dp_shard != devices:
        raise ValueError(f"the mesh dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard}"
                         f"{f' x cp {p.cp}' if p.cp > 1 else ''}{f' x tp {p.tp}' if p.tp > 1 else ''} = "
                         f"{others * p.dp_shard} devices does not match the {devices} devices of the "
                         "hardware; change the mesh (or dp_shard = -1) or the slice")
    return p.dp_replicate, p.dp_shard, devices


def code_gather(cfg: Config) -> str:
    """How long the code keeps gathered block weights with this config (parallel/plan_terms.py,
    Layout.gather): "layer" when re-sharded after the forward, "model" when kept: re-sharding off,
    per-parameter collectives (bucket_mb 0), or scanned layers in graph mode without full
    checkpointing (scan's partitioner saves each layer's gathered weights), or tensor parallelism
    without activation checkpointing (parameters gathered one by one) or with scanned layers."""
    p = cfg.parallelism
    assert p.reshard_after_forward != "auto", "plan_config resolves auto first (with_reshard_resolved)"
    if p.reshard_after_forward == "false" or p.bucket_mb <= 0:
        return "model"
    if p.tp > 1 and cfg.activation_checkpoint.mode == "none":
        # Tensor-parallel weights are gathered per parameter, outside buckets: autograd keeps them,
        # unless a checkpointed block gathers them again in its recomputation.
        return "model"
    if cfg.model.scan_layers and cfg.training.mode == "graph" and cfg.activation_checkpoint.mode != "full":
        return "model"
    if cfg.model.scan_layers and p.tp > 1:
        return "model"  # a tensor-parallel stack is gathered whole before the loop (simple_fsdp._reshard_pieces)
    return "layer"


@dataclass(frozen=True)
class _Setting:
    """A config resolved for planning: what every term below reads. Built once by `_resolve`."""

    cfg: Config
    label: str  # how the plan names the model (the spec's label, e.g. llama3/8B)
    args: object  # the model's TransformerArgs
    hardware: Hardware
    devices: int
    layout: Layout
    dtype: str  # the compute dtype's name (model.dtype with auto resolved for the hardware)
    gather: str  # "model" or "layer": what the plan assumes (parallel/plan_terms.py Layout.gather)
    code_gather: str  # what the code does with this config (`code_gather`)
    adapter_params: int = 0  # LoRA's adapter elements (the trained ones under LoRA); 0 without LoRA
    adapted: tuple[tuple[str, int], ...] = ()  # LoRA's adapted linears: (unrolled name, in_features)
    as_compiled: bool = False  # plan `titan-tpu compile`'s program (`plan_run`'s as_compiled)
    fp8: bool = False  # the blocks' linears as fp8 matmuls (the config's [fp8], or `plan_run`'s fp8 what-if)
    fp8_scaling: str = "tensorwise"  # tensorwise | rowwise (kernels/fp8.py)

    @property
    def ac(self) -> str:
        return self.cfg.activation_checkpoint.mode

    @property
    def scanned(self) -> bool:
        return self.cfg.model.scan_layers

    @property
    def graph(self) -> bool:
        return self.cfg.training.mode == "graph"

    @property
    def padded_values(self) -> bool:
        """Multi-head latent attention's values padded by the CPU attention kernel (kernels/attention.py)."""
        from titan_tpu.kernels.attention import pads_values

        mla = self.args.mla
        return (mla is not None and self.hardware.name == "cpu" and self.cfg.kernels.attention in ("auto", "sdpa")
                and pads_values("cpu", mla.qk_head_dim, mla.v_head_dim))

    @property
    def traced(self) -> bool:
        # Traced checkpointed blocks keep the attention output too (activation_checkpoint.py); the
        # scanned full mode is its own autograd function that keeps only the layer inputs.
        return self.graph and not (self.scanned and self.ac == "full")

    @property
    def partitioned(self) -> bool:
        # Scanned layers in graph mode without full checkpointing: scan's own autograd (scan.py).
        return self.scanned and self.graph and self.ac != "full"

    @property
    def dpo(self) -> bool:
        return self.cfg.training.objective == "dpo"

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch of one data-parallel rank (its tp and cp ranks share them);
        under DPO a micro-batch holds batch_size pairs, a chosen and a rejected row each."""
        return self.cfg.training.batch_size * self.cfg.training.seq_len * (2 if self.dpo else 1)

    @property
    def reference_stored(self) -> float:
        """Parameter elements a device stores for DPO's frozen reference copy (sharded as the
        model's); none under LoRA, whose reference is the base model with its adapters off, and
        none without DPO (components/dpo.py)."""
        copy = self.dpo and not (self.lora and self.cfg.dpo.reference == "initial")
        return self.layout.stored_elements(num_params(self.args)) if copy else 0.0

    @property
    def per_layer_stack(self) -> bool:
        """A scanned stack gathered per layer (re-sharding on, bucketed) reduce-scatters per layer
        too; a what-if other than the code's stands for re-sharding on (layer) or off (model)."""
        if self.gather != self.code_gather:
            return self.gather == "layer"
        return self.cfg.parallelism.reshard_after_forward == "true" and self.cfg.parallelism.bucket_mb > 0

    @property
    def block_params(self) -> int:
        args = self.args
        return num_params(args) - (args.dim + args.vocab_size * args.dim * (1 if args.tie_embeddings else 2))

    @property
    def stored(self) -> float:
        """Parameter elements a device stores (LoRA's adapters beside the base weights)."""
        return self.layout.stored_elements(num_params(self.args) + self.adapter_params)

    @property
    def lora(self) -> bool:
        return self.cfg.lora.enabled

    @property
    def trained(self) -> float:
        """Parameter elements a device keeps gradients and AdamW moments for: all it stores, or
        under LoRA the adapters only (the base is frozen)."""
        return self.layout.stored_elements(self.adapter_params) if self.lora else self.stored


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
    """The plan of a resolved run (run_setup.py: its config and model spec, not resolved again)
    on `hardware` (default: what the config names, see `default_hardware`)
    with `chips` chips (default: the config's mesh, or the chip count the recipe names).
    gather: None for what the code does with this config (`code_gather`), or "model" / "layer"
    as a what-if (parallel/plan_terms.py Layout.gather). model_args: the model's TransformerArgs when
    they are not a flavor of the table (titan-tpu verify of an HF directory); default: the config's.
    storage_gbps, local_gbps: write bandwidths (GB/s) of the checkpoint storage (the whole job) and
    of each device's local tier, for the checkpoint times (`_checkpoint_time`).

    Composes the terms below, each a pure function of the resolved `_Setting` (and of terms
    computed before it) returning one named quantity. parallelism.reshard_after_forward auto is
    planned as what the trainer resolves it to (`with_reshard_resolved`).

    as_compiled: plan the program `titan-tpu compile` hands XLA rather than the one TorchTPU runs
    (docs/planner.md "The compiled program"; always for compile.backend jax, which runs it): the
    parameters and moments donated and updated in place (planned out of place otherwise, as
    torch-tpu's Dynamo backend writes them, until a TPU run shows the trainer's donation taking
    effect: plan/torchtpu.py), and tokamax's loss in its plain-XLA form (its Mosaic kernel cannot be
    traced without a chip), which holds the bf16 logits.

    fp8: plan the blocks' linears as fp8 matmuls (True) or in the compute dtype (False), a what-if;
    None: as the config's [fp8] section says (`fp8_setting`). See `_fp8_terms`."""
    if setup.cfg.parallelism.reshard_after_forward == "auto":
        setup = dataclasses.replace(setup, cfg=with_reshard_resolved(setup, hardware, chips=chips, measure=measure,
                                                                     model_args=model_args))
    s = _resolve(setup, hardware, chips=chips, measure=measure, gather=gather, model_args=model_args)
    enabled, scaling = fp8_setting(s.cfg)
    # The JAX path runs the program titan-tpu compile hands XLA: its plan is always that program's.
    as_compiled = as_compiled or setup.cfg.compile.backend == "jax" and setup.cfg.training.mode == "graph"
    s = dataclasses.replace(s, as_compiled=as_compiled, fp8=enabled if fp8 is None else fp8, fp8_scaling=scaling)
    cfg = s.cfg
    args, t, layout, mb = s.args, cfg.training, s.layout, s.layout.master_bytes()
    acts = _activations(s)
    loss_kept, loss_peak = _loss_bytes(s)
    gathered = _gathered_bytes(s)
    full_grad = 0.0 if s.lora else _full_gradient_bytes(s)  # LoRA: only the small adapters have gradients
    scan = _scan_memory(s, acts, full_grad)
    phases = _memory_phases(s, acts=acts, loss_kept=loss_kept, loss_peak=loss_peak, gathered=gathered,
                            full_grad=full_grad, scan=scan)
    peak_phase = max(phases, key=phases.get)
    peak = phases[peak_phase]
    memory = {
        "parameters": s.stored * mb, "gradients": s.trained * mb, "optimizer_state": 2 * s.trained * mb,
        **({"reference": s.reference_stored * mb} if s.dpo else {}),
        "activations": acts.saved + acts.head, "activation_recompute": acts.recompute,
        "gathered_weights": gathered, "full_size_gradient": full_grad,
        # scan's weight copies beyond the gathered weights they are when sharded, and the RoPE copies
        "scan_saved_copies": (scan.weight_copies - _copies_gathered(s, gathered, scan) + scan.shared if scan else 0.0),
        "scan_flipped": (scan.flipped if scan else 0.0), "scan_gradient_stack": (scan.gradients if scan else 0.0),
        "loss_kept": loss_kept, "loss_peak": loss_peak, "optimizer_temporary": _optimizer_temporary_bytes(s),
        "runtime": _runtime_bytes(s), "phases": phases,
    }
    if args.moe is not None:
        memory["moe_dispatch"] = _moe_dispatch_bytes(s, acts)
    flops = _flops(s)
    fp8_terms = _fp8_terms(s)
    if s.fp8:
        flops["fp8_executed_per_step_per_device"] = fp8_terms["flops"]
        memory["fp8_copies"] = fp8_terms["copies_bytes"]
        memory["fp8_scales"] = fp8_terms["scales_bytes"]
        # transient within a layer's matmuls: alive in the backward moment (a layer's backward), not at
        # the forward's end (the loss, outside the layers)
        phases["backward"] += fp8_terms["copies_bytes"] + fp8_terms["scales_bytes"]
        peak_phase = max(phases, key=phases.get)
        peak = phases[peak_phase]
    collectives = _collectives(s)
    rates = axis_rates(s.hardware, layout, slices=cfg.parallelism.slices)
    step_time = _step_time(s, executed_rank=flops["executed_per_step_per_device"], collectives=collectives,
                           rates=rates, fp8=fp8_terms if s.fp8 else None)
    tokens_step_rank = s.tokens * t.grad_accum_steps
    tp, cp = cfg.parallelism.tp, cfg.parallelism.cp
    step_s = step_time["step_s"]
    basis = _speed_basis(s, step_time["efficiency"])
    plan = Plan(
        model=s.label, hardware=s.hardware.as_dict(), devices=s.devices,
        mesh={"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "ep": cfg.parallelism.ep, "tp": tp,
              "cp": cp, "slices": cfg.parallelism.slices, "mode": _mode(layout), "gather": s.gather,
              "code_gather": s.code_gather},
        batch={"batch_size": t.batch_size, "seq_len": t.seq_len, "grad_accum_steps": t.grad_accum_steps,
               "tokens_per_step": tokens_step_rank * s.devices // (tp * cp), "dtype": s.dtype,
               "activation_checkpoint": s.ac, "scan_layers": s.scanned,
               "loss": _loss_impl(cfg.kernels.loss, s.hardware.name), "mode": t.mode,
               **({"fp8": s.fp8_scaling} if s.fp8 else {}),
               # the program titan-tpu compile hands XLA: donated update, tokamax's plain-XLA form
               **({"as_compiled": True} if as_compiled else {})},
        params={"total": num_params(args), "active": num_active_params(args), "experts": num_expert_params(args),
                "stored_per_device": s.stored},
        memory=memory, peak_bytes=peak, peak_phase=peak_phase, capacity_bytes=s.hardware.memory_bytes,
        fits=peak <= s.hardware.memory_bytes, flops=flops,
        communication=[{**dataclasses.asdict(c), **rates[c.axis].as_dict()} for c in collectives], time=step_time,
        tokens_per_s=tokens_step_rank * s.devices / (tp * cp) / step_s if basis else None,
        mfu=100.0 * flops["model_per_step_per_device"] / step_s / (s.hardware.peak_flops / _cpu_share(s))
        if basis else None, speed_basis=basis)
    # Scan's autograd holds its saved stacks twice and the gradient stack: activation memory too,
    # which full checkpointing removes (the scanned full mode keeps only the layer inputs).
    scan_held = scan.at_backward_start - scan.activations if scan else 0.0
    plan.advice = _advice(plan, cfg, acts_share=(acts.saved + loss_peak + scan_held) / peak if peak else 0.0)
    plan.checkpoint = _checkpoint_time(s, step_s=step_s if basis else None, storage_gbps=storage_gbps,
                                       local_gbps=local_gbps)
    return plan


def _checkpoint_time(s: _Setting, *, step_s: float | None, storage_gbps: float, local_gbps: float) -> dict:
    """How long a save takes and whether checkpoint.grace_seconds holds it (train/local_tier.py).

    The persistent checkpoint holds every parameter once (DCP writes one copy of replicated shards)
    and the AdamW moments of the trained ones, at master precision, through the storage's aggregate
    bandwidth; the local tier is each device's own shards, all devices writing at once. On SIGTERM
    the step in flight ends first, so the budget must hold a step and the local tier."""
    mb = s.layout.master_bytes()
    stored = num_params(s.args) + s.adapter_params
    trained = s.adapter_params if s.lora else stored
    total = (stored + 2 * trained) * mb
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


def with_reshard_resolved(setup: RunSetup | Config, hardware: Hardware | None = None, *, chips: int | None = None,
                          measure: bool = True, model_args=None) -> Config:
    """`cfg` with parallelism.reshard_after_forward auto resolved: "false" where the plan that keeps
    the gathered block weights from the forward to the backward fits the device (re-sharding would
    only add an all-gather per block to the backward), else "true". Other values: `cfg` itself.
    The run's assembly runs this too (components/build.py), so the plan and the run agree."""
    setup = setup if isinstance(setup, RunSetup) else RunSetup.resolved(setup)
    cfg = setup.cfg
    if cfg.parallelism.reshard_after_forward != "auto":
        return cfg
    resolved = copy.copy(cfg)
    resolved.parallelism = dataclasses.replace(cfg.parallelism, reshard_after_forward="false")
    if not plan_run(dataclasses.replace(setup, cfg=resolved), hardware, chips=chips, measure=measure,
                    model_args=model_args).fits:
        resolved.parallelism = dataclasses.replace(cfg.parallelism, reshard_after_forward="true")
    return resolved


def reshard_decision(setup: RunSetup | Config, *, world_size: int,
                     hardware: Hardware | None = None) -> tuple[bool, str]:
    """(re-shard after the forward?, why) for a run on `world_size` devices, as the run's assembly
    decides it (components/build.py) and `titan-tpu compile` compiles it: "true"/"false" as given;
    auto asks `with_reshard_resolved` on the hardware the config names (or `hardware`), and
    re-shards where the planner has no terms for the run (an hf model, an unnamed GPU)."""
    cfg = setup.cfg if isinstance(setup, RunSetup) else setup
    value = cfg.parallelism.reshard_after_forward
    if value != "auto":
        return value == "true", "set in the config"
    try:
        if hardware is None:
            hardware, _ = default_hardware(cfg, measure=False)
        chips = max(world_size // hardware.devices_per_chip, 1)
        resolved = with_reshard_resolved(setup, hardware, chips=chips, measure=False)
    except ValueError as e:
        return True, f"the planner cannot plan this run ({str(e).split(';')[0]})"
    if resolved.parallelism.reshard_after_forward == "true":
        return True, "the plan that keeps them does not fit"
    return False, "the plan that keeps them fits"


def _resolve(setup: RunSetup, hardware: Hardware | None, *, chips: int | None, measure: bool, gather: str | None,
             model_args) -> _Setting:
    """The run setup resolved for planning (see `plan_run` for the arguments)."""
    cfg, spec = setup.cfg, setup.spec
    code = code_gather(cfg)
    gather = gather or code
    if not spec.plannable:
        raise ValueError(f"titan-tpu plan covers the native models ({', '.join(MODEL_NAMES)}); an hf model's "
                         "layers are transformers' own code, which the planner has no terms for")
    if hardware is None:
        hardware, named_chips = default_hardware(cfg, measure=measure)
        chips = chips if chips is not None else named_chips
    devices = chips * hardware.devices_per_chip if chips is not None else None
    dp_replicate, dp_shard, devices = _mesh(cfg, devices)
    if cfg.training.global_batch_tokens:  # the accumulation the trainer derives on this mesh
        training = dataclasses.replace(cfg.training, global_batch_tokens=0,
                                       grad_accum_steps=grad_accum_from_tokens(cfg.training, dp_replicate * dp_shard))
        cfg = dataclasses.replace(cfg, training=training)
    args = model_args if model_args is not None else spec.args
    _check_parallel_support(cfg, args)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if hardware.name == "cpu" else "bfloat16")
    p = cfg.parallelism
    layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, ep=p.ep, tp=p.tp, cp=p.cp,
                    compute_bytes=_DTYPE_BYTES[dtype], reduce_bytes=_DTYPE_BYTES[p.reduce_dtype], gather=gather,
                    ep_dispatch=p.ep_dispatch,
                    # captured CPU/CUDA steps send the all-to-all's static buffer whole; TPU's is ragged
                    ep_padded=cfg.training.mode == "graph" and hardware.name not in TPU_NAMES)
    return _Setting(cfg=cfg, label=spec.label, args=args, hardware=hardware, devices=devices, layout=layout,
                    dtype=dtype, gather=gather, code_gather=code, **_adapters(cfg, args))


def _adapters(cfg: Config, args) -> dict:
    """LoRA's adapter elements and adapted linears, read off the unrolled model built on the meta
    device (no memory); nothing without LoRA."""
    if not cfg.lora.enabled:
        return {}
    # A search plans the same model and adapters for every candidate: build the meta model once.
    key = (repr(args), repr(cfg.lora))
    if key not in _ADAPTERS:
        _ADAPTERS[key] = _count_adapters(cfg, args)
    return _ADAPTERS[key]


_ADAPTERS: dict[tuple[str, str], dict] = {}


def _count_adapters(cfg: Config, args) -> dict:
    import torch

    from titan_tpu.models.common.transformer import Transformer
    from titan_tpu.models.lora import apply_lora, is_adapter_key, lora_modules

    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=cfg.training.seq_len))
        apply_lora(model, cfg.lora)
    return {"adapter_params": sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n)),
            "adapted": tuple((name, m.in_features) for name, m in lora_modules(model).items())}


def _check_parallel_support(cfg: Config, args) -> None:
    """The tensor- and context-parallel combinations the code runs, or a one-line error."""
    tp, cp = cfg.parallelism.tp, cfg.parallelism.cp
    if tp > 1:
        check_tensor_parallel(args, tp, seq_len=cfg.training.seq_len)
    if cp > 1:
        check_context_parallel(cp, seq_len=cfg.training.seq_len, tp=tp)
        check_cp_with_ep(cp, cfg.parallelism.ep)


def attention_widths(args, tp: int = 1) -> tuple[int, int, int]:
    """Per token, on one of tp ranks: the widths of the queries, keys and values the attention
    kernel reads (what context parallelism gathers: keys and values). Multi-head latent attention
    expands its keys per head to qk_nope_head_dim + qk_rope_head_dim and its values to
    v_head_dim (models/common/mla.py)."""
    if args.mla is not None:
        heads = args.n_heads // tp
        return heads * args.mla.qk_head_dim, heads * args.mla.qk_head_dim, heads * args.mla.v_head_dim
    return args.n_heads * args.hd // tp, args.n_kv_heads * args.hd // tp, args.n_kv_heads * args.hd // tp


def _activations(s: _Setting) -> ActivationBytes:
    """Activations of one micro-batch on one rank: under context parallelism its 1 / cp of the
    tokens, and attention keeps every rank's keys and values (of its kv heads: 1 / tp of them)."""
    cfg, args, cp, tp = s.cfg, s.args, s.cfg.parallelism.cp, s.cfg.parallelism.tp
    acts = activation_bytes(args, tokens=s.tokens // cp, ac_mode=s.ac, dtype_bytes=s.layout.compute_bytes,
                            ep=cfg.parallelism.ep, traced=s.traced, partitioned=s.partitioned, tp=tp,
                            padded_values=s.padded_values)
    if cp > 1 and s.ac == "none":
        t = cfg.training
        mask = _chunk_attention_impl(cfg.kernels.chunk_attention, s.hardware.name) in ("sdpa", "reference")
        q_dim, k_dim, v_dim = attention_widths(args, tp)
        extra = cp_attention_saved_bytes(batch_size=t.batch_size, seq_len=t.seq_len, cp=cp,
                                         dtype_bytes=s.layout.compute_bytes, q_dim=q_dim, kv_dim=k_dim, v_dim=v_dim,
                                         documents=cfg.data.document_mask, mask=mask, padded_values=s.padded_values)
        acts = dataclasses.replace(acts, saved_per_layer=tuple(saved + extra for saved in acts.saved_per_layer))
    return _with_lora_activations(s, acts) if s.lora else acts


def _with_lora_activations(s: _Setting, acts: ActivationBytes) -> ActivationBytes:
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


def _loss_bytes(s: _Setting) -> tuple[float, float]:
    """(kept, peak) of the loss kernel. Under tensor parallelism it sees every token and its rank's
    1 / tp of the vocabulary (the vocabulary-parallel form, with its own temporaries), under
    context parallelism the rank's tokens."""
    k, p = s.cfg.kernels, s.cfg.parallelism
    impl = _loss_impl(k.loss, s.hardware.name)
    if s.as_compiled and impl == "tokamax":
        impl = "tokamax_xla"
    return loss_memory_bytes(impl, tokens=s.tokens // p.cp,
                             vocab_size=s.args.vocab_size // p.tp, dim=s.args.dim,
                             dtype_bytes=s.layout.compute_bytes, chunk_tokens=k.loss_chunk_tokens,
                             vocab_parallel=p.tp > 1)


def _gathered_bytes(s: _Setting) -> float:
    """Gathered block weights alive at once (parallel/plan_terms.py); with the weights kept
    gathered (gather "model") the embedding's and the output projection's gathered copies too,
    kept from the forward to the backward like the blocks' (XLA's live ranges of
    qwen3_8b_lora_chat_tpu: the gathered bf16 [vocab, dim] beside the gathered stacks)."""
    blocks = s.layout.gathered_bytes(block_params=s.block_params, expert_params=num_expert_params(s.args),
                                     n_layers=s.args.n_layers)
    if s.gather != "model" or not s.layout.sharded:
        return blocks
    args = s.args
    head = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2) / s.cfg.parallelism.tp
    return blocks + head * s.layout.compute_bytes


def _full_gradient_bytes(s: _Setting) -> float:
    """The largest full-size gradient alive before its reduce-scatter. A scanned stack gathered per
    layer has one layer's, also where the gathered weights are kept (scan's autograd without full
    checkpointing: gather "model", the gradients still per layer)."""
    args, layout = s.args, s.layout
    grad_layout = dataclasses.replace(layout, gather="layer") if s.scanned and s.per_layer_stack else layout
    return grad_layout.full_gradient_bytes(largest_param=largest_param(args), block_params=s.block_params,
                                           expert_params=num_expert_params(args), n_layers=args.n_layers,
                                           scanned=s.scanned and not s.per_layer_stack)


def _scan_memory(s: _Setting, acts: ActivationBytes, full_grad: float) -> ScanAutogradMemory | None:
    """What scan's own autograd holds (scanned layers in graph mode without full checkpointing),
    else None."""
    if not s.partitioned:
        return None
    k = s.cfg.kernels
    return scanned_autograd_memory(s.args, layout=s.layout, acts=acts, seq_len=s.cfg.training.seq_len,
                                   gradient_stack=not full_grad or s.per_layer_stack,
                                   gathered_in_body=s.layout.sharded and s.per_layer_stack,
                                   experts_copied=_grouped_mm_impl(k.grouped_mm, s.hardware.name) != "torch",
                                   flipped=s.cfg.compile.backend not in ("inductor", *XLA_BACKENDS))


def _runtime_bytes(s: _Setting) -> float:
    """What the runtime holds beside the model (hardware.mode_constants), and on each rank of a
    multi-process run its process group's state."""
    distributed = s.hardware.distributed_runtime_bytes if s.devices > 1 else 0.0
    return s.hardware.mode_constants(graph=s.graph)[2] + distributed


def _optimizer_temporary_bytes(s: _Setting) -> float:
    """AdamW's sqrt(v) temporary; the traced step's out-of-place update also writes fresh
    parameters and moments (train/optim.py update_buffers). The compiled program (as_compiled)
    updates its donated buffers in place, each in one fusion: nothing parameter-sized beside them."""
    if s.as_compiled:
        return 0.0
    return update_buffers(out_of_place=s.graph) * s.trained * s.layout.master_bytes()


def _memory_phases(s: _Setting, *, acts: ActivationBytes, loss_kept: float, loss_peak: float, gathered: float,
                   full_grad: float, scan: ScanAutogradMemory | None) -> dict[str, float]:
    """Memory at the three moments of a step (the module docstring): forward end, backward,
    optimizer update."""
    mb = s.layout.master_bytes()
    params_b = s.stored * mb
    moments_b = 2 * s.trained * mb
    grads_b = s.trained * mb
    accumulating = grads_b if s.cfg.training.grad_accum_steps > 1 else 0.0  # earlier micro-batches' gradients
    static = params_b + moments_b + _runtime_bytes(s) + s.reference_stored * mb
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
        forward_end += scan.at_backward_start - scan.activations - _copies_gathered(s, gathered, scan)
    # Backward, top layer first: layers below keep their activations, layers above have gradients.
    blocks = len(acts.saved_per_layer)  # the layers, then the multi-token-prediction blocks
    per_layer = [s.adapter_params / blocks] * blocks if s.lora else _layer_params(s.args)
    layer_grad = [g * mb / (s.layout.dp_shard * s.layout.tp) for g in per_layer]
    below, above, worst = acts.saved, 0.0, 0.0
    if _xla_scan_gradients_whole(s):  # the loop's gradient stack is allocated before its first trip
        above = sum(layer_grad)
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
    backward += _xla_loss_held_over_dcn(s, loss_peak)
    optimizer = update_static + grads_b + _optimizer_temporary_bytes(s)
    phases = {"forward_end": forward_end, "backward": backward, "optimizer": optimizer}
    if _xla_backward_end(s):
        phases["backward_end"] = static + grads_b + _xla_backward_end(s)
    return phases


# The compile backends whose step XLA compiles: TorchTPU's, and the JAX path's (our lowering).
XLA_BACKENDS = ("tpu", "jax")


def _xla_scan_gradients_whole(s: _Setting) -> bool:
    """Whether the backward loop's gradient stack is alive whole from its first trip: scanned
    layers compiled by XLA, whose while loop carries the stack it writes."""
    return s.cfg.compile.backend in XLA_BACKENDS and s.graph and s.scanned


def _xla_loss_held_over_dcn(s: _Setting, loss_peak: float) -> float:
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
    whole_logits = s.as_compiled and _loss_impl(k.loss, s.hardware.name) == "tokamax"
    if s.cfg.parallelism.slices <= 1 or s.cfg.parallelism.tp > 1 or not whole_logits or \
            not _xla_scan_gradients_whole(s):
        return 0.0
    return 2.0 * loss_peak


def _xla_loop_gradient_stack(s: _Setting, full_grad: float) -> float:
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
            or s.args.moe is not None:
        return full_grad
    return full_grad * s.layout.compute_bytes / s.layout.reduce_bytes


def _xla_per_layer_loop(s: _Setting) -> bool:
    """Scanned layers compiled by XLA, gathered and reduce-scattered per layer inside the loop (re-sharding
    on), under full checkpointing, every weight trained (not LoRA's frozen base): where `_xla_layer_loop`
    is the backward's full-size gradient."""
    return _xla_scan_gradients_whole(s) and s.ac == "full" and s.layout.sharded and s.per_layer_stack \
        and not s.lora


def _xla_layer_loop(s: _Setting) -> float:
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


def _xla_backward_end(s: _Setting) -> float:
    """What XLA's TPU program holds at the backward's end beside every gradient shard: three fp32
    [vocab, dim] matrices at once, the output projection's full-size gradient (computed first,
    its reduce-scatter scheduled late), the embedding's scatter-add gradient and its cast (XLA's
    live ranges of qwen3_8b_graph_tpu at its peak). Sharded, trained embeddings under XLA only."""
    if s.cfg.compile.backend not in XLA_BACKENDS or not s.graph or s.lora or \
            s.layout.dp_shard * s.layout.dp_replicate == 1:
        return 0.0
    return 3.0 * s.args.vocab_size * s.args.dim * s.layout.master_bytes() / s.cfg.parallelism.tp


def _copies_gathered(s: _Setting, gathered: float, scan: ScanAutogradMemory) -> float:
    """The part of scan's saved weight copies that are the gathered weights themselves, counted
    once: all of them when each layer is gathered inside the loop (the body's gathered weights are
    what it saves); none when the whole stack stays gathered, where the copies (MoE experts'
    transposed views for the grouped matmul) are buffers of their own beside the gathered stack
    (XLA's buffers for DeepSeek-V3 16B without checkpointing: each expert stack gathered and, beside
    it, transposed)."""
    return min(gathered, scan.weight_copies) if s.gather == "layer" else 0.0


def _moe_dispatch_bytes(s: _Setting, acts: ActivationBytes) -> float:
    """Part of the activations: what expert parallelism adds (each rank's experts see the ep
    group's tokens: ep times the dispatched rows)."""
    one_rank = activation_bytes(s.args, tokens=s.tokens, ac_mode=s.ac, dtype_bytes=s.layout.compute_bytes, ep=1,
                                traced=s.traced, padded_values=s.padded_values)
    return acts.saved - one_rank.saved + acts.recompute - one_rank.recompute


def _flops(s: _Setting) -> dict[str, float]:
    """The trainer's FLOPs count, and what runs (recomputed forwards under full checkpointing)."""
    t, p = s.cfg.training, s.cfg.parallelism
    fpt = flops_per_token(s.args, t.seq_len)
    tokens_step_rank = s.tokens * t.grad_accum_steps  # tokens of one data-parallel rank (its tp ranks share them)
    model_flops_rank = fpt * tokens_step_rank / (p.tp * p.cp)
    # Full checkpointing reruns the blocks' forward in the backward; the output projection and the
    # loss are outside the checkpointed blocks and run once.
    recomputed = recomputed_flops_per_token(s.args, t.seq_len) if s.ac == "full" else 0.0
    if s.dpo:  # the reference's forward (no backward) over the same rows: a third of a trained token's
        reference = fpt / 3
        return {"per_token": fpt, "reference_per_token": reference,
                "model_per_step_per_device": (fpt + reference) * tokens_step_rank / (p.tp * p.cp),
                "executed_per_step_per_device": (fpt + recomputed + reference) * tokens_step_rank / (p.tp * p.cp)}
    return {"per_token": fpt, "model_per_step_per_device": model_flops_rank,
            "executed_per_step_per_device": (fpt + recomputed) * tokens_step_rank / (p.tp * p.cp)}


def fp8_setting(cfg: Config) -> tuple[bool, str]:
    """(fp8 on, its scaling) as the config's [fp8] section says; off for a config without one."""
    section = getattr(cfg, "fp8", None)
    return bool(getattr(section, "enabled", False)), str(getattr(section, "scaling", "tensorwise"))


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


def _fp8_terms(s: _Setting) -> dict[str, float]:
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
    return {"flops": flops, "peak_flops": peak, "cast_bytes": cast_bytes,
            "copies_bytes": layer_weights + tokens * largest_in, "scales_bytes": float(scales)}


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


def _collectives(s: _Setting) -> list:
    """The collectives of one step (parallel/plan_terms.py)."""
    args, t, p = s.args, s.cfg.training, s.cfg.parallelism
    cb = s.layout.compute_bytes
    gathers, regathers = collective_calls(
        tensors_per_layer=_layer_tensors(args), bytes_per_layer=[g * cb for g in _layer_params(args)],
        outside_tensors=2 if args.tie_embeddings else 3, bucket_bytes=p.bucket_mb * 2**20,
        scanned_whole=s.scanned and not s.per_layer_stack, regather=s.gather == "layer")
    collectives = s.layout.step_collectives(total_params=num_params(args), expert_params=num_expert_params(args),
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
                                      documents_tokens=s.tokens if s.cfg.data.document_mask else 0,
                                      recompute_blocks=s.ac != "none")
    return collectives


def _speed_basis(s: _Setting, efficiency: float) -> str | None:
    """What the predicted step time rests on, or None where nothing does: TorchTPU's eager mode runs
    the step op by op for debugging, and no eager TPU step has been measured, so the planner gives no
    eager TPU speed rather than one that looks as good as graph mode's."""
    if s.hardware.name == "cpu":
        return "fitted to this project's CPU runs (titan-tpu plan --calibrate)"
    if s.hardware.name in TPU_NAMES and not s.graph:
        return None
    return f"an assumption: matmul work at {efficiency:.0%} of peak (never measured on {s.hardware.name})"


def _cpu_share(s: _Setting) -> int:
    """On this CPU the ranks share the cores: each gets 1 / devices of the peak."""
    return s.devices if s.hardware.name == "cpu" else 1


def _step_time(s: _Setting, *, executed_rank: float, collectives: list, rates: dict, fp8: dict | None = None) -> dict:
    """Seconds per step: compute, elementwise work and collectives (the module docstring), each
    collective at the rate of the fabric its axis crosses (`rates`, plan/fabric.py). fp8:
    `_fp8_terms` when the blocks' linears run as fp8 matmuls: their FLOPs at the fp8 peak, their
    casts as elementwise traffic."""
    hardware, t, p = s.hardware, s.cfg.training, s.cfg.parallelism
    efficiency, elementwise_efficiency, _ = hardware.mode_constants(graph=s.graph)
    share = _cpu_share(s)
    peak_flops = hardware.peak_flops / share
    fp8_flops = fp8["flops"] if fp8 else 0.0
    compute_s = (executed_rank - fp8_flops) / (peak_flops * efficiency) + \
        (fp8_flops / (fp8["peak_flops"] / share * efficiency) if fp8 else 0.0)
    none_acts = activation_bytes(s.args, tokens=s.tokens // p.cp, ac_mode="none", dtype_bytes=s.layout.compute_bytes,
                                 ep=p.ep, tp=p.tp, padded_values=s.padded_values)
    # Every intermediate is written in the forward and read and written in the backward (again when
    # recomputed); AdamW and clipping stream parameters, gradients and moments about twelve times.
    elementwise_bytes = 3 * (none_acts.saved + (none_acts.saved if s.ac != "none" else 0)) * t.grad_accum_steps \
        + 12 * s.stored * s.layout.master_bytes() + (fp8["cast_bytes"] if fp8 else 0.0)
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
            **({"fp8_peak_flops": fp8["peak_flops"], "fp8_cast_bytes": fp8["cast_bytes"]} if fp8 else {})}


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


def _mode(layout: Layout) -> str:
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return "hybrid_shard"
    if layout.dp_shard > 1:
        return "fully_shard"
    return "replicate" if layout.dp_replicate > 1 else "none"


# Hardware names (hardware.py) of TPU generations: where `auto` picks the TPU kernels.
TPU_NAMES = ("v4", "v5e", "v5p", "v6e", "v7")


def _loss_impl(choice: str, hardware_name: str) -> str:
    """The loss kernel `auto` picks (kernels/__init__.py preference order), by device kind."""
    if choice != "auto":
        return choice
    return "tokamax" if hardware_name in TPU_NAMES else "chunked"


def _chunk_attention_impl(choice: str, hardware_name: str) -> str:
    """The chunk_attention kernel (context parallelism) `auto` picks, by device kind."""
    if choice != "auto":
        return choice
    if hardware_name in TPU_NAMES:
        return "splash"
    return "sdpa" if hardware_name == "cpu" else "flex"


def _grouped_mm_impl(choice: str, hardware_name: str) -> str:
    """The grouped_mm kernel `auto` picks (kernels/__init__.py preference order), by device kind."""
    if choice != "auto":
        return choice
    return "gmm" if hardware_name in TPU_NAMES else "torch"


def _layer_params(args) -> list[int]:
    from titan_tpu.models.registry import _attention_params

    out = []
    for layer_id in range(args.n_layers + args.mtp_num_layers):  # the layers, then the MTP blocks
        if args.is_moe_layer(layer_id):
            ffn = args.dim * args.moe.num_experts + args.moe.num_experts * 3 * args.dim * args.moe.hidden_dim
        else:
            ffn = 3 * args.dim * args.ffn_hidden_dim
        mtp = 3 * args.dim + 2 * args.dim * args.dim if layer_id >= args.n_layers else 0  # norms, eh_proj
        out.append(_attention_params(args) + ffn + 2 * args.dim + mtp)
    return out


def _layer_tensors(args) -> list[int]:
    """Parameter tensors of each block: wq wk wv wo, two norms (and q/k norms), then w1 w2 w3 or
    an MoE layer's router and three expert stacks."""
    attention = 4 + 2 + (2 if args.qk_norm else 0)
    return [attention + (4 if args.is_moe_layer(i) else 3) for i in range(args.n_layers)]


def _advice(plan: Plan, cfg: Config, *, acts_share: float) -> list[str]:
    """What to change when it does not fit, biggest lever first."""
    if plan.fits:
        return []
    m, out = plan.memory, []
    if m["gathered_weights"] + m["full_size_gradient"] > 0.25 * plan.peak_bytes and plan.mesh["gather"] == "model":
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
    state = m["parameters"] + m["gradients"] + m["optimizer_state"]
    if state > 0.3 * plan.peak_bytes:
        out.append(f"more --parallelism.dp_shard (parameters, gradients and moments are {state / 1e9:.1f} GB per "
                   "device, divided by dp_shard)")
    if cfg.kernels.loss == "reference":
        out.append("--kernels.loss chunked (never holds the whole logits)")
    return out or ["a device with more memory"]


def _batch_unit(mesh: dict) -> str:
    """Who holds a micro-batch: a device, or under cp / tp a group of devices that splits it."""
    split = mesh.get("cp", 1) * mesh.get("tp", 1)
    if split == 1:
        return "device"
    return f"data-parallel rank (its {split} cp x tp devices each hold 1/{mesh.get('cp', 1)} of every sequence)"


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
                        "(re-gathered per layer) or the whole model (kept from forward to backward)",
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
    reference = f" + {f['reference_per_token'] / 1e6:,.1f} of the DPO reference's forward" \
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
        lines.append(f"time per step: compute {t['compute_s']:.4g} s (at {t['efficiency']:.0%} of "
                     f"{hw['peak_flops'] / 1e12:.4g} TFLOP/s), elementwise {t['elementwise_s']:.4g} s, collectives "
                     f"{t['collectives_s']:.4g} s; {t['step_s_no_overlap']:.4g} s without overlap, "
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
