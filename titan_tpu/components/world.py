"""Where a program is assembled (`Place`): this process's rank in a world of ranks, the mesh over
them and the device its tensors live on, in a real world or a fake one.

A training run's world is its process group (gloo, NCCL, TorchTPU's): real collectives, real
tensors. `titan-tpu compile` needs rank r's program of an N-rank run without N processes:
torch.distributed's fake backend (`fake_world`: ``init_process_group("fake")`` on a `FakeStore`) gives
a process group of any size whose collectives do nothing, on which DTensor and the functional
collectives trace exactly as on a real group (the graph holds the same `_c10d_functional` nodes);
the model is then built on the meta device and its tensors made fake (`to_fake`: shapes, dtypes
and strides, no storage), so a 671B model's rank is captured in a few GiB of host memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_tpu.run.resolved import ResolvedRun

__all__ = ["Place", "fake_world", "to_fake"]


@dataclass(frozen=True)
class Place:
    """One rank of a resolved run's world: the meshes over its ranks and where its tensors live."""

    rank: int
    device: torch.device  # where the run's torch tensors live (the host CPU on the JAX path)
    mesh: DeviceMesh | None  # the dense mesh (parallel/mesh.py), None on one process
    expert_mesh: DeviceMesh | None  # the MoE experts' (dp_shard / ep, ep) mesh, None without ep
    fake: bool = False  # the model's tensors fake (no storage): `titan-tpu compile`'s capture

    @classmethod
    def of(cls, run: ResolvedRun, *, rank: int, device: torch.device, fake: bool = False) -> Place:
        """This process's place in `run`'s world, its meshes built over the (real or fake) default
        process group."""
        dims = run.dims
        return cls(rank=rank, device=device, mesh=dims.build_mesh(device.type),
                   expert_mesh=dims.build_expert_mesh(device.type), fake=fake)


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
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions. A DeviceMesh hashes and compares by its ranks
    and names, not its process groups, so a mesh of the next fake world equals this one's, and a
    cached decision would hand the next capture this world's mesh, whose groups are gone ("could not
    resolve the process group"): rank 1 captured after rank 0 under dp_shard x tp."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python propagator's cache and the C++ fast path's


def to_fake(model: torch.nn.Module) -> None:
    """Every parameter and buffer of a model built on the meta device replaced, in place, by a CPU
    fake tensor of the same (local) shape, dtype and strides: the capture traces on these, nothing is
    allocated. A DTensor keeps its mesh, placements and global shape around its fake local tensor.
    No ShapeEnv, as the capture's own fake mode (graph/capture.py): static shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_fallback_kernels=True)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(_fake_like(p, fake_mode), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = _fake_like(b, fake_mode)


def _fake_like(t: torch.Tensor, fake_mode) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    with fake_mode:
        fake = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="cpu")
    if isinstance(t, DTensor):
        return DTensor.from_local(fake, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return fake
