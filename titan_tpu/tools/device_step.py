"""One device's captured training step for an N-device run, captured on one process.

`titan-tpu compile` and the parity tests need the graph that rank r of an N-rank run captures,
without N processes. torch.distributed's fake backend (`FakeStore` + ``init_process_group("fake")``)
gives a process group of any size whose collectives do nothing: DTensor and the functional
collectives trace on it exactly as on a real group (the graph holds the same `_c10d_functional`
nodes), and `materialize_and_init` gives rank r's real local shards without communication.

`DeviceStep` carries what the JAX lowering needs besides the graph: the mesh axes (our names and
sizes) and, per process group the graph's collectives name, the axes it spans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx

from titan_tpu.config import Config
from titan_tpu.graph.capture import CapturedStep, capture_train_step
from titan_tpu.models.spec import model_spec
from titan_tpu.parallel.mesh import ParallelDims
from titan_tpu.parallel.simple_fsdp import MixedPrecision, materialize_and_init
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
    p = cfg.parallelism
    return ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, world_size=world_size, ep=p.ep, tp=p.tp,
                        cp=p.cp)


def build_device_model(cfg: Config, world_size: int, *, dtype: torch.dtype | None = None):
    """(model, AdamW, ParallelDims, mesh) as the trainer builds them on the current rank of a
    (fake) `world_size` group: the spec's model, sharded, with rank-local real weights.
    dtype: the compute dtype (default the config's model.dtype; "auto" is bfloat16, the TPU's)."""
    dims = parallel_dims(cfg, world_size)
    mesh = dims.build_mesh("cpu")
    if dims.ep > 1:
        raise ValueError("titan-tpu compile: expert parallelism (parallelism.ep > 1) is not lowered to JAX yet; "
                         "set --parallelism.ep 1")
    compute = dtype or _DTYPES.get(cfg.model.dtype, torch.bfloat16)
    model = model_spec(cfg.model).build_on_meta(cfg, mesh=mesh, parallel_dims=dims, documents=False)
    mode = dims.mode if mesh is not None else "none"
    model = materialize_and_init(model, mesh, mode=mode, mp=MixedPrecision(param_dtype=compute, reduce_dtype=compute),
                                 device=torch.device("cpu"), seed=cfg.training.seed,
                                 bucket_mb=cfg.parallelism.bucket_mb,
                                 reshard_after_forward=cfg.parallelism.reshard_after_forward)
    optimizer = AdamW.from_config(dict(model.named_parameters()), cfg.optimizer,
                                  layer_stacked=model.stacked_parameter_names())
    return model, optimizer, dims, mesh


@dataclass
class DeviceStep:
    """One device's step: the captured step, its mesh and the mesh axes of its process groups."""

    captured: CapturedStep
    axis_sizes: dict[str, int]  # mesh axis name -> size, in mesh order ({} on one device)
    group_axes: dict[str, tuple[str, ...]]  # process group name -> the mesh axes it spans

    @property
    def num_devices(self) -> int:
        n = 1
        for size in self.axis_sizes.values():
            n *= size
        return n


def _group_axes(mesh) -> dict[str, tuple[str, ...]]:
    """Each mesh axis's process group, and the default (world) group spanning them all."""
    if mesh is None:
        return {}
    names = tuple(mesh.mesh_dim_names)
    out = {mesh.get_group(name).group_name: (name,) for name in names}
    out[dist.group.WORLD.group_name] = names
    return out


def capture_device_step(cfg: Config, *, world_size: int, batch_size: int, seq_len: int,
                        scalar_dtype: torch.dtype = torch.float32) -> DeviceStep:
    """Rank 0's captured step of a `world_size`-rank run of `cfg`, with per-rank batches of
    batch_size x seq_len. Inside a fake process group (see the module docstring)."""
    with fake_world(world_size):
        model, optimizer, dims, mesh = build_device_model(cfg, world_size)
        example = torch.zeros(batch_size, seq_len, dtype=torch.long)
        captured = capture_train_step(model, max_norm=cfg.training.max_norm, adamw_hparams=optimizer.hparams,
                                      decay=optimizer.decay, example_batch=(example, example.clone()),
                                      scalar_dtype=scalar_dtype)
        axis_sizes = dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else {}
        return DeviceStep(captured=captured, axis_sizes=axis_sizes, group_axes=_group_axes(mesh))
