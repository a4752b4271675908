"""One device's captured training step for an N-device run, captured on one process.

`titan-tpu compile` and the parity tests need the graph that rank r of an N-rank run captures,
without N processes. torch.distributed's fake backend (`FakeStore` + ``init_process_group("fake")``)
gives a process group of any size whose collectives do nothing: DTensor and the functional
collectives trace on it exactly as on a real group (the graph holds the same `_c10d_functional`
nodes), and `materialize_and_init` gives rank r's real local shards without communication.

`DeviceStep` (graph/spmd.py) carries what the JAX lowering needs besides the graph: the mesh axes
(our names and sizes) and, per process group the graph's collectives name, the axes it spans.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from titan_tpu.config import Config
from titan_tpu.data.batch import TokenBatch
from titan_tpu.graph.capture import capture_train_step
from titan_tpu.graph.spmd import DeviceStep, device_step, mesh_axis_sizes
from titan_tpu.kinds import kind_of
from titan_tpu.kinds.record import builds_reference_copy
from titan_tpu.models.spec import model_spec
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.parallel.simple_fsdp import MixedPrecision
from titan_tpu.train.optim import AdamW

__all__ = ["DeviceStep", "build_device_model", "capture_device_step", "fake_world"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank `rank` of a fake `world_size`-rank default process group (no-op
    collectives), torn down on exit. A world of 1 needs no group."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise ValueError("a device step is captured in a process without a process group; "
                         "run titan-tpu compile as one plain process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parallel_dims(cfg: Config, world_size: int) -> ParallelDims:
    return ParallelDims.from_config(cfg.parallelism, world_size=world_size)


def build_device_model(cfg: Config, world_size: int, *, dtype: torch.dtype | None = None, fake_mode=None,
                       reshard_after_forward: bool | None = None, documents: bool = False,
                       per_tensor: bool | None = None):
    """(model, AdamW, ParallelDims, mesh) as the trainer builds them on the current rank of a
    (fake) `world_size` group: models/spec.py `build` (tensor/context/expert parallel, sharded,
    rank-local real weights), the trainer's AdamW. dtype: the compute dtype (default the config's
    model.dtype; "auto" is bfloat16, the TPU's). reshard_after_forward: what the trainer resolved
    parallelism.reshard_after_forward auto to (planner.reshard_decision); None takes the config's.
    documents: attention kept within documents (the trainer's data.document_mask or chat data)."""
    from titan_tpu.models.spec import build

    dims = parallel_dims(cfg, world_size)
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    compute = dtype or _DTYPES.get(cfg.model.dtype, torch.bfloat16)
    # Gradients reduced in parallelism.reduce_dtype, as the trainer does (float32 by default); a
    # caller naming the dtype (a parity test) computes and reduces in it.
    reduce = compute if dtype is not None else _DTYPES[cfg.parallelism.reduce_dtype]
    # Collectives per tensor as the trainer has them on a TPU (components/build.py); per_tensor=False
    # keeps the flat buckets of a CPU or CUDA run (a parity test of that form).
    per_tensor = cfg.training.device == "tpu" if per_tensor is None else per_tensor
    model = build(model_spec(cfg.model), cfg, device=torch.device("meta" if fake_mode else "cpu"),
                  seed=cfg.training.seed, mesh=mesh, parallel_dims=dims, expert_mesh=expert_mesh,
                  mp=MixedPrecision(param_dtype=compute, reduce_dtype=reduce, per_tensor=per_tensor),
                  documents=documents, own_weights=False,
                  reshard_after_forward=reshard_after_forward)
    if fake_mode is not None:
        _to_fake(model, fake_mode)
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    optimizer = AdamW.from_config(trained, cfg.optimizer, layer_stacked=model.stacked_parameter_names())
    return model, optimizer, dims, mesh


def _fake_like(t: torch.Tensor, fake_mode) -> torch.Tensor:
    """A CPU fake tensor of `t`'s local shape, dtype and strides, in `fake_mode` (no storage);
    a DTensor keeps its mesh, placements and global shape around it."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    with fake_mode:
        fake = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    if isinstance(t, DTensor):
        return DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return fake


def _to_fake(model: torch.nn.Module, fake_mode) -> None:
    """Every parameter and buffer of a model built on the meta device replaced, in place, by a CPU
    fake tensor of the same (local) shape: the capture traces on these, nothing is allocated."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(_fake_like(p, fake_mode), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = _fake_like(b, fake_mode)


def _objective(cfg: Config, world_size: int, *, reshard_after_forward: bool | None, documents: bool):
    """The run's objective as the trainer assembles it (components/build.py, from the kind's record),
    on fake tensors: None for a kind of token rows (the capture's default: next-token); a kind with a frozen
    reference copy gets it built and sharded as the trained model (none with LoRA and the initial
    reference: the trained model with its adapters off is it)."""
    kind = kind_of(cfg)
    if "graph" not in kind.modes:
        raise ValueError(f"training.objective = {kind.name} runs in training.mode = {' or '.join(kind.modes)}: it is "
                         "not captured for XLA")
    if kind.batch is TokenBatch:  # token rows: the capture's default objective and example batch
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode

    reference = None
    if builds_reference_copy(kind, cfg):
        view = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=False))
        reference, *_ = build_device_model(view, world_size, reshard_after_forward=reshard_after_forward,
                                           documents=documents, fake_mode=FakeTensorMode(allow_fallback_kernels=True))
        reference.requires_grad_(False)
        reference.eval()
    return kind.objective(cfg, reference)


def capture_device_step(cfg: Config, *, world_size: int, batch_size: int, seq_len: int,
                        scalar_dtype: torch.dtype = torch.float32, rank: int = 0,
                        reshard_after_forward: bool | None = None, documents: bool = False,
                        grad_accum_steps: int = 1, example_batch=None) -> DeviceStep | tuple[DeviceStep, DeviceStep]:
    """Rank `rank`'s captured step of a `world_size`-rank run of `cfg`, with per-rank batches of
    batch_size x seq_len. Inside a fake process group (see the module docstring).
    reshard_after_forward: as `build_device_model`. documents: the batch carries positions
    (document masking, as the trainer's loader gives them). grad_accum_steps > 1: the trainer's
    two programs (graph/capture.py capture_accumulating_step), (micro-batch, update).
    example_batch: the data's own batch where the trainer captures with it (images: a
    vision-language model's rows, tools/jax_capture.py trainer_example_data); None: token rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_tpu.graph.capture import capture_accumulating_step

    with fake_world(world_size, rank):
        # No ShapeEnv, as the capture's own fake mode (graph/capture.py): static shapes.
        model, optimizer, dims, mesh = build_device_model(cfg, world_size, reshard_after_forward=reshard_after_forward,
                                                          documents=documents,
                                                          fake_mode=FakeTensorMode(allow_fallback_kernels=True))
        objective = _objective(cfg, world_size, reshard_after_forward=reshard_after_forward, documents=documents)
        if objective is None and example_batch is not None:
            batch = example_batch
        elif objective is None:
            example = torch.zeros(batch_size, seq_len, dtype=torch.long)
            batch = (example, example.clone(), example.clone()) if documents else (example, example.clone())
        else:
            batch = objective.example_batch(batch_size=batch_size, seq_len=seq_len, documents=documents,
                                            device=torch.device("cpu"))
        kwargs = dict(max_norm=cfg.training.max_norm, adamw_hparams=optimizer.hparams, decay=optimizer.decay,
                      example_batch=batch, scalar_dtype=scalar_dtype, objective=objective)
        if grad_accum_steps > 1:
            programs = capture_accumulating_step(model, grad_accum_steps=grad_accum_steps, **kwargs)
        else:
            programs = (capture_train_step(model, **kwargs),)
        axis_sizes = mesh_axis_sizes(mesh, dims)
        steps = [device_step(captured, axis_sizes) for captured in programs]
        return steps[0] if len(steps) == 1 else tuple(steps)
