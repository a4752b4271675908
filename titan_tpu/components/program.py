"""One program assembly: one rank's model, frozen reference, objective, optimizer and example batch,
built from a resolved run (run/resolved.py) by the code a training run and `titan-tpu compile` share.

    run = resolve(setup, target)                         # components/resolve.py
    program = assemble_program(run, place, log=log)      # this rank's parts (components/world.py Place)
    steps = capture_programs(run, program, place)        # the JAX path's programs: what XLA is handed

A training run assembles on its process group with real tensors (components/build.py
`Components`); `titan-tpu compile` on a fake group of the run's size with fake tensors
(`capture_fake_rank`, `capture_rank`). The calls and their arguments are the same; only the tensors' storage
differs, so the program compile certifies is built by the code that trains, by construction
(tests/tpu/test_one_assembly.py compares the two programs' fingerprints).

Choices that depend on real weights or on the device are made in this assembly, each logged in one
line: the kernels (the resolution's; on the JAX path what replaced a choice with no form there), the
re-shard choice (the resolution's), and a Transformers-backend model's chunked loss (its spec checks
it on the weights; on the meta device the model's structure answers, as the planner assumes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from titan_tpu.components.world import Place, fake_world, to_fake
from titan_tpu.data.batch import Batch, as_batch
from titan_tpu.files import is_hf_model_dir
from titan_tpu.kernels import device_type_as
from titan_tpu.kinds.record import DataRequest, builds_reference_copy, reference_flops
from titan_tpu.model_contract import TrainableModel
from titan_tpu.models.lora import is_adapter_key
from titan_tpu.models.registry import frozen_weight_gradient_flops_per_token
from titan_tpu.models.spec import build
from titan_tpu.run.resolved import ResolvedRun, Target
from titan_tpu.run.setup import RunSetup
from titan_tpu.train.checkpoint import load
from titan_tpu.train.objective import Objective
from titan_tpu.train.optim import AdamW, trained_parameters

if TYPE_CHECKING:
    from titan_tpu.config import Config

__all__ = ["Program", "assemble_program", "build_model", "capture_fake_rank", "capture_programs", "capture_rank",
           "data_request", "describe_run", "fake_rank", "flops_per_token", "load_weights"]

Log = Callable[[str], None]


@dataclass
class Program:
    """One rank's parts of a run's step."""

    model: TrainableModel
    reference: torch.nn.Module | None  # the kind's frozen reference copy (DPO's, GRPO's); None without one
    objective: Objective
    optimizer: AdamW  # the trained parameters' (under LoRA its adapters') moments and hyper-parameters
    example_batch: Batch  # one micro-batch of the run's shapes: what a captured step is traced with


def assemble_program(run: ResolvedRun, place: Place, *, example_batch: Batch | None = None,
                     log: Log = lambda message: None) -> Program:
    """`run`'s parts at `place` (the module docstring), in the trainer's order: the model (built and
    initialised from the seeded global RNG), the frozen reference (given its starting weights, on real
    tensors), the objective, the optimizer, the example batch (the data's own where its batches hold
    more than the objective's example has: a vision-language model's images)."""
    # Built asking for the kernels of the device that runs the program (a TPU through JAX: "jax"), where
    # the torch tensors live elsewhere (the host CPU): a choice checked at build answers for that device.
    with device_type_as(place.device.type, run.target.kernel_device_type):
        model = build_model(run, place, log=log)
        reference = _frozen_reference(run, place, log=log)
    objective = run.kind.objective(run.cfg, reference)
    optimizer = AdamW.from_config(trained_parameters(model), run.cfg.optimizer,
                                  layer_stacked=model.stacked_parameter_names())
    t = run.cfg.training
    batch = (example_batch.to(place.device) if example_batch is not None else
             objective.example_batch(batch_size=t.batch_size, seq_len=t.seq_len, documents=run.documents,
                                     device=place.device))
    return Program(model=model, reference=reference, objective=objective, optimizer=optimizer, example_batch=batch)


def build_model(run: ResolvedRun, place: Place, *, lora: bool = True, log: Log = lambda message: None
                ) -> TrainableModel:
    """The spec's model as the run resolved it (models/spec.py `build`): materialised and initialised
    piece by piece (sharded on the place's mesh), fp32 master parameters computed in the run's
    compute dtype, gradients reduced in its reduce dtype (docs/mixed_precision.md), with the run's
    kernels, buckets, re-shard choice and pipeline schedule. On a fake place: built on the meta
    device, its tensors then fake. lora False: without adapters (a frozen reference is never trained)."""
    cfg = run.cfg if lora else dataclasses.replace(run.cfg, lora=dataclasses.replace(run.cfg.lora, enabled=False))
    model = build(run.spec, cfg, device=torch.device("meta") if place.fake else place.device, seed=cfg.training.seed,
                  mesh=place.mesh, parallel_dims=run.dims, expert_mesh=place.expert_mesh, mp=run.mixed_precision,
                  documents=run.documents, own_weights=not place.fake,
                  reshard_after_forward=run.reshard_after_forward, bucket_mb=run.bucket_mb, pipeline=run.pipeline,
                  kernels=run.kernels, log=log)
    if place.fake:
        to_fake(model)
    return model


@torch.no_grad()
def _frozen_reference(run: ResolvedRun, place: Place, *, log: Log) -> torch.nn.Module | None:
    """The frozen reference the kind scores against (kinds/record.py `reference`): the run's starting
    weights ("initial") or a checkpoint or Hugging Face directory, built as the trained model without
    adapters. None without one, or where the trained model with its adapters off is it (LoRA from the
    starting weights): no second copy is built."""
    cfg, kind = run.cfg, run.kind
    if not builds_reference_copy(kind, cfg):
        return None
    reference = kind.reference(cfg)
    initial = reference == "initial"
    start = cfg.checkpoint.initial_load_path if initial else reference
    model = build_model(run, place, lora=False, log=log)
    if start and not place.fake:
        load_weights(run, model, start, log=log)
    model.requires_grad_(False)
    model.eval()
    log(f"{kind.reference_role} {'the starting weights' if initial else start}, a frozen copy")
    return model


@torch.no_grad()
def load_weights(run: ResolvedRun, model: torch.nn.Module, path: str | Path, *, log: Log) -> None:
    """The weights of a checkpoint or a Hugging Face directory into `model`, in place (each rank reads
    the blocks it holds): a fine-tuning start, or a frozen reference's weights."""
    from titan_tpu.convert import resolve_checkpoint

    path = Path(path)
    if is_hf_model_dir(path):  # a Hugging Face directory: the spec knows its layout
        run.spec.load_hf_weights(model, path)
    else:  # a training checkpoint: DCP loads (and shards) it
        # The base weights: a checkpoint of a full run has no adapters (LoRA's start at init).
        base = {k: v for k, v in model.state_dict().items() if not is_adapter_key(k)}
        load(resolve_checkpoint(path), {"model": base})
    log(f"initial weights loaded from {path}")


def data_request(run: ResolvedRun, *, rank: int, cache_dir: Path, log: Log) -> DataRequest:
    """What the kind's data builder (kinds/record.py) is given on `rank`: the run's sources and
    tokenizer, its rows' split (the data-parallel ranks, or the replica groups) and documents."""
    split = run.data_split(rank)
    setup = run.setup
    return DataRequest(cfg=run.cfg, sources=setup.sources, tokenizer_path=setup.tokenizer_path,
                       vocab_size=setup.spec.args.vocab_size, cache_dir=cache_dir, data_rank=split.dp_rank,
                       data_size=split.dp_size, documents=run.documents, log=log,
                       image_model_dir=setup.spec.image_model_dir())


def flops_per_token(run: ResolvedRun, model: torch.nn.Module | None, *, images=None) -> tuple[float, str]:
    """(model FLOPs per trained token, how they were counted): the spec's count on `model` (a native
    spec reads its args alone; an hf one counts its modules), `images` a batch's image slots (a
    vision-language model's rows), plus the kind's frozen reference's forwards (DPO's, GRPO's): MFU
    counts the work done per second. A native LoRA run's frozen base computes no weight gradients:
    2 of its 6 FLOPs per weight and token are not counted (the planner's count too, plan/step_time.py)."""
    policy, note = run.spec.flops_per_token(model, run.cfg.training.seq_len, images=images)
    if run.cfg.lora.enabled and run.spec.kind == "native":
        policy -= frozen_weight_gradient_flops_per_token(run.spec.args)
        note = "LoRA: the frozen base's weight gradients not counted" + (f"; {note}" if note else "")
    return policy + reference_flops(run.kind, run.cfg, policy), note


def capture_programs(run: ResolvedRun, program: Program, place: Place) -> dict:
    """The JAX path's programs of this rank (graph/spmd.py `DeviceStep`): "step", or with gradient
    accumulation "micro-batch" and "update" (graph/capture.py `capture_accumulating_step`), captured
    as one program for every rank with the platform's kernels (graph/spmd.py
    `capture_context`). What the trainer's JAX path lowers and runs (graph/jax_step.py) and `titan-tpu
    compile` lowers and compiles."""
    from titan_tpu.graph.capture import capture_accumulating_step, capture_train_step
    from titan_tpu.graph.spmd import capture_context, device_step, mesh_axis_sizes

    assert run.target.jax_platform is not None, "the JAX path's programs need a JAX target (run/resolved.py Target)"
    kwargs = dict(max_norm=run.cfg.training.max_norm, adamw_hparams=program.optimizer.hparams,
                  decay=program.optimizer.decay, example_batch=as_batch(program.example_batch),
                  dp_size=run.batch_split(place.rank).dp_size, scalar_dtype=torch.float32, objective=program.objective)
    with capture_context(run.target.jax_platform):
        if run.grad_accum_steps == 1:
            captured = {"step": capture_train_step(program.model, **kwargs)}
        else:
            captured = dict(zip(("micro-batch", "update"), capture_accumulating_step(
                program.model, grad_accum_steps=run.grad_accum_steps, **kwargs)))
    axis_sizes = mesh_axis_sizes(place.mesh, run.dims)
    return {name: device_step(step, axis_sizes) for name, step in captured.items()}


@contextlib.contextmanager
def fake_rank(run: ResolvedRun, *, rank: int = 0, example_batch: Batch | None = None,
              log: Log = lambda message: None) -> Iterator[tuple[Program, Place]]:
    """Rank `rank`'s program of `run`, assembled in this process on a fake world of the run's size
    (components/world.py), alive inside the block (its collectives name the fake group). Resolve the
    run first (components/resolve.py), outside the fake world."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError("titan-tpu compile captures a rank of the run on a fake world of its own; run it as one "
                         "plain process, not under torchrun")
    with fake_world(run.world_size, rank):
        place = Place.of(run, rank=rank, device=torch.device("cpu"), fake=True)
        yield assemble_program(run, place, example_batch=example_batch, log=log), place


def capture_fake_rank(run: ResolvedRun, *, rank: int = 0, example_batch: Batch | None = None,
                      log: Log = lambda message: None) -> dict:
    """Rank `rank`'s programs of `run` (`capture_programs`) from its `fake_rank` assembly: what
    `titan-tpu compile` certifies."""
    with fake_rank(run, rank=rank, example_batch=example_batch, log=log) as (program, place):
        return capture_programs(run, program, place)


def capture_rank(cfg: Config, target: Target, *, hardware=None, rank: int = 0, log: Log = lambda message: None
                 ) -> tuple[ResolvedRun, dict, Batch | None]:
    """(`cfg` resolved for `target` (a JAX path's: `Target.for_jax`), rank's programs, the data's example
    batch or None): the run's own resolution and assembly, captured on a fake world (`capture_fake_rank`);
    the re-shard choice on `hardware` (default the config's). The batch is the data's own where the run
    captures with it (a vision-language model's rows, through the run's own `data_request`). A kernel that
    cannot take the shapes (splash's blocks of 128, gmm's tiles), which a run on that device refuses in
    one line, is replaced by the op's CPU pick, traced as ATen ops, and `run.kernel_notes` says which
    and why (`titan-tpu compile` reports it)."""
    from titan_tpu.components.resolve import resolve
    from titan_tpu.files import default_cache_dir
    from titan_tpu.kernels.registry import KernelShapeError

    run = resolve(RunSetup.resolved(cfg), target, hardware=hardware)
    example = None
    if run.image_rows:
        request = data_request(run, rank=rank, cache_dir=Path(cfg.data.cache_dir or default_cache_dir()),
                               log=lambda message: None)
        example = run.kind.data(request).example_batch
    while True:
        try:
            return run, capture_fake_rank(run, rank=rank, example_batch=example, log=log), example
        except KernelShapeError as e:
            replaced = run.without_kernel(e.kernel, str(e).split(";")[0])
            if replaced is run:
                raise
            run = replaced


def describe_run(run: ResolvedRun) -> str:
    """One line of what the run resolved that the config does not say outright: the mesh, the
    accumulation, a step's rows and tokens, the dtypes and the kernels (on the JAX path, what each op
    runs as). The re-shard choice has a line of its own where it was auto (components/build.py), the
    pipeline schedule the model line (loops/base.py)."""
    dims, mp = run.dims, run.mixed_precision
    axes = [f"{axis} {size}" for axis, size in dims.mesh_sizes().items() if size > 1]
    mesh = " x ".join(axes + ([f"ep {dims.ep} (within dp_shard)"] if dims.ep > 1 else [])) or "one device"
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    accum = run.grad_accum_steps
    parts = [f"mesh {mesh}", f"{accum} micro-batch{'es' if accum > 1 else ''} of {run.micro_batch_rows} rows a "
             f"rank per step, {run.step_tokens:,} tokens", f"compute {name[mp.param_dtype]}, gradients reduced in "
             f"{name[mp.reduce_dtype]}"]
    notes = run.kernel_notes or {}
    kernels = ", ".join(f"{op} {notes.get(op, getattr(run.kernels, op))}" for op in ("attention", "loss", "grouped_mm"))
    return "run: " + "; ".join(parts) + f"; kernels: {kernels}"
