"""The run resolved for the world it runs on: every value derived from a checked config (setup.py)
and that world, derived here once, in a frozen record the trainer, the planner and `titan-tpu
compile` read.

    setup = prepare_run(cfg)                                         # the config checked
    run = resolve_run(setup, Target.of_backend(backend, world_size=4))
    run.dims, run.grad_accum_steps, run.step_tokens, run.mixed_precision, run.kernels, run.pipeline

Where a run goes is its `Target`: how many ranks, and what their device asks of the program (the
dtype `model.dtype = auto` computes in, whose kernels model code takes, one collective per tensor
where XLA combines them, the JAX path's platform). A training run's target is its backend's
(device.py); `titan-tpu compile`'s is the JAX path's backend on the slice it compiles for; the
planner's is the hardware it plans (plan/setting.py).

What the record holds beside the config's own keys: the mesh's sizes (dp_shard -1 resolved), the
rows' split and the accumulation (training.global_batch_tokens), a step's rows and tokens (from the
kind's record: a DPO pair is two rows), the compute dtype and the gradients' reduction (mixed
precision), whether batches carry document positions, the kernels (what the data needs: a loss that
skips ignored labels; the JAX path's names), the pipeline schedule and what it implies (no buckets,
nothing re-sharded), and the re-shard choice.

The re-shard choice (parallelism.reshard_after_forward auto) is the planner's memory terms' answer
for this resolved run (plan/reshard.py); until a caller sets it (`with_reshard`, components/resolve.py)
`ResolvedRun.reshard` is None. Nothing here writes into the config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan_tpu.kinds import TrainingKind, kind_of
from titan_tpu.parallel.mesh import BatchSplit, ParallelDims
from titan_tpu.parallel.pipeline import PipelineSchedule, pipelined_layers
from titan_tpu.parallel.simple_fsdp import MixedPrecision, default_mixed_precision
from titan_tpu.run.setup import RunSetup, accumulation, data_split

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.device import Backend
    from titan_tpu.kernels import KernelConfig

__all__ = ["DTYPES", "Reshard", "ResolvedRun", "Target", "resolve_run"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """Where a run goes: its ranks and what their device asks of the program (device.py Backend's
    facts, which this copies so that a target needs no started device)."""

    world_size: int | None  # None: the ranks the mesh names (a plan of a run on this CPU)
    compute_device_type: str = "cpu"  # where the math runs: cpu, cuda or tpu (a TPU through JAX too)
    kernel_device_type: str = "cpu"  # whose kernels model code takes: cpu, cuda, tpu, or jax (the TPU's JAX kernels)
    collective_per_tensor: bool = False  # SimpleFSDP's collectives one per tensor (XLA combines them)
    jax_platform: str | None = None  # "tpu" or "cpu" on the JAX path (compile.backend jax); None otherwise

    @classmethod
    def of_backend(cls, backend: Backend, world_size: int | None) -> Target:
        return cls(world_size=world_size, compute_device_type=backend.compute_device_type,
                   kernel_device_type=backend.kernel_device_type,
                   collective_per_tensor=backend.collective_per_tensor, jax_platform=backend.jax_platform)

    @classmethod
    def for_jax(cls, platform: str, world_size: int) -> Target:
        """The JAX path's target on `platform` ("tpu" or "cpu"; device.py `jax_backend`), without JAX
        started (or installed: a capture for the CPU runs no JAX)."""
        from titan_tpu.device import jax_backend

        return cls.of_backend(jax_backend(platform, require_jax=False), world_size)


@dataclass(frozen=True)
class Reshard:
    """parallelism.reshard_after_forward as the run applies it, and why (one line for the log)."""

    after_forward: bool
    why: str


@dataclass(frozen=True)
class ResolvedRun:
    """A run's values for its target (the module docstring); built by `resolve_run`."""

    setup: RunSetup
    kind: TrainingKind  # training.objective's record (kinds/)
    target: Target
    dims: ParallelDims  # the mesh's sizes on the target's ranks, dp_shard -1 resolved
    grad_accum_steps: int  # micro-batches per optimizer step (training.global_batch_tokens derived)
    compute_dtype: torch.dtype  # model.dtype, auto resolved for the target's device
    mixed_precision: MixedPrecision  # compute and gradient-reduction dtypes, collectives per tensor or bucketed
    documents: bool  # batches carry positions: attention kept within documents
    image_rows: bool  # a vision-language model's chat rows: the step is captured with the data's own batch
    pipeline: PipelineSchedule | None  # pipeline stages (parallelism.pp > 1), else None
    bucket_mb: float  # SimpleFSDP's bucket size: parallelism.bucket_mb, 0 under pipeline stages
    reshard: Reshard | None  # None: auto, not decided yet (`with_reshard`)
    # Kernels `titan-tpu compile` replaced because they cannot take the shapes (`without_kernel`):
    # (op, the kernel in its place, why); a run on the device refuses them instead.
    replaced_kernels: tuple[tuple[str, str, str], ...] = ()

    @property
    def cfg(self) -> Config:
        return self.setup.cfg

    @property
    def spec(self):
        return self.setup.spec

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def batch_split(self, rank: int = 0) -> BatchSplit:
        """The ranks of this job that share `rank`'s batch (its collectives: the loss's sums, the gradients)."""
        return self.dims.batch_split(rank)

    def data_split(self, rank: int = 0) -> BatchSplit:
        """Who reads which rows of the global batch (run/setup.py `data_split`)."""
        return data_split(self.cfg, self.dims, rank)

    @property
    def micro_batch_rows(self) -> int:
        """Rows of one rank's micro-batch: training.batch_size samples of the kind's rows each."""
        return self.cfg.training.batch_size * self.kind.rows_per_sample(self.cfg)

    @property
    def step_rows(self) -> int:
        """Rows of one optimizer step over every data-parallel rank (or replica group)."""
        return self.micro_batch_rows * self.data_split().dp_size * self.grad_accum_steps

    @property
    def global_batch_tokens(self) -> int:
        """A step's tokens as training.global_batch_tokens counts them: training.batch_size samples of
        training.seq_len tokens per micro-batch, over the rows' split and the accumulation (a sample's
        rows, a DPO pair's two, apart). What checkpoints record of the global batch."""
        t = self.cfg.training
        return t.batch_size * t.seq_len * self.data_split().dp_size * self.grad_accum_steps

    @property
    def step_tokens(self) -> int:
        """Tokens of one optimizer step: `step_rows` of training.seq_len tokens."""
        return self.step_rows * self.cfg.training.seq_len

    @property
    def reshard_after_forward(self) -> bool:
        assert self.reshard is not None, "resolve the re-shard choice first (components/resolve.py)"
        return self.reshard.after_forward

    def with_reshard(self, reshard: Reshard) -> ResolvedRun:
        return dataclasses.replace(self, reshard=reshard)

    def without_kernel(self, kernel: str, why: str) -> ResolvedRun:
        """This run with every op that runs `kernel` given the op's CPU pick instead, traced as the ATen
        ops it runs (`titan-tpu compile` of a config whose shapes the kernel cannot take); itself
        where no op runs it."""
        from titan_tpu.kernels import OPS

        replaced = tuple((field, op.resolve("auto", "cpu").name, why) for field, op in OPS.items()
                         if getattr(self.kernels, field) == kernel)
        return dataclasses.replace(self, replaced_kernels=self.replaced_kernels + replaced) if replaced else self

    @functools.cached_property
    def _kernels(self) -> tuple[KernelConfig, dict[str, str]]:
        # Resolved on first use, in the process that runs (or compiles) the step: the planner plans
        # kernels by hardware name (plan/setting.py) and never needs a device's registry.
        kernels, device = self.cfg.kernels, self.target.kernel_device_type
        if self.kind.ignores_labels or any(source.format == "chat" for source in self.setup.sources):
            kernels = kernels.for_ignored_labels(device)  # labels IGNORE_INDEX outside the trained tokens
        notes: dict[str, str] = {}
        if self.target.jax_platform is not None:
            kernels, notes = kernels.on_jax(self.target.jax_platform, tp=self.dims.tp)
        for field, name, why in self.replaced_kernels:
            notes[field] = f"{name} (in place of {getattr(kernels, field)}: {why})"
            kernels = dataclasses.replace(kernels, **{field: name})
        return kernels, notes

    @property
    def kernels(self) -> KernelConfig:
        """The [kernels] choices as this run's model is built with them: a loss kernel that skips
        ignored labels where the data has them (chat rows, preference pairs; auto picks one, a named
        kernel without it is a one-line error), and on the JAX path each op's kernel named for the
        platform (kernels/__init__.py `KernelConfig.on_jax`)."""
        return self._kernels[0]

    @property
    def kernel_notes(self) -> dict[str, str]:
        """On the JAX path: what each op runs as, and what replaced a choice with no form there ({} elsewhere)."""
        return self._kernels[1]


def resolve_run(setup: RunSetup, target: Target, *, runnable: bool = True, args=None) -> ResolvedRun:
    """`setup` resolved for `target` (the module docstring). runnable: False for a plan of a layout the
    trainer does not run yet (parallel/mesh.py ParallelDims). args: the model's args where they are
    not the spec's (the planner's what-if of an HF directory), for the pipeline schedule."""
    cfg = setup.cfg
    p = cfg.parallelism
    dims = ParallelDims.from_config(p, world_size=target.world_size, runnable=runnable)
    grad_accum_steps = accumulation(cfg, dims)
    kind = kind_of(cfg)
    pipeline = (PipelineSchedule.from_config(p, n_layers=pipelined_layers(args or setup.spec.args)) if p.pp > 1
                else None)
    compute = (default_mixed_precision(target.compute_device_type).param_dtype if cfg.model.dtype == "auto"
               else DTYPES[cfg.model.dtype])
    image_dir = setup.spec.image_model_dir()
    image_rows = image_dir is not None and any(source.format == "chat" for source in setup.sources)
    return ResolvedRun(
        setup=setup, kind=kind, target=target, dims=dims, grad_accum_steps=grad_accum_steps,
        compute_dtype=compute,
        mixed_precision=MixedPrecision(param_dtype=compute, reduce_dtype=DTYPES[p.reduce_dtype],
                                       per_tensor=target.collective_per_tensor),
        documents=kind.documents(cfg, setup.sources, image_rows=image_rows), image_rows=image_rows,
        # A pipeline stage reads its rows once per step and keeps them: no buckets, nothing re-sharded.
        pipeline=pipeline, bucket_mb=0 if pipeline is not None else p.bucket_mb,
        reshard=_given_reshard(cfg, dims, pipeline, setup))


def _given_reshard(cfg: Config, dims: ParallelDims, pipeline: PipelineSchedule | None,
                   setup: RunSetup) -> Reshard | None:
    """parallelism.reshard_after_forward where no plan is needed to decide it; None for auto where one is."""
    value = cfg.parallelism.reshard_after_forward
    if pipeline is not None:  # without buckets nothing is re-sharded (parallel/simple_fsdp.py)
        return Reshard(False, "pipeline stages keep their rows gathered for the step")
    if value != "auto":
        return Reshard(value == "true", "set in the config")
    if dims.world_size == 1:
        return Reshard(False, "one device: nothing is sharded")
    if not setup.spec.plannable:
        # Measured terms (plan/hf_terms.py) would be spent on a choice that does nothing.
        return Reshard(True, "an hf model is one piece: nothing is re-sharded after a layer")
    return None
