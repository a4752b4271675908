"""Bucketed SimpleFSDP collectives: one all-gather and one gradient reduction per bucket.

Plain SimpleFSDP (simple_fsdp.py) gathers every parameter on its own when the module reads it:
one collective per parameter in the forward and one per gradient in the backward, each a round
trip through DTensor's Python dispatch. A bucket is the parameters of one piece of the model (an
embedding, one block, the final norm and output projection; the model's `init_plan` pieces) cut
into runs of at most `bucket_mb`. The first read of any of its parameters in a forward gathers
the whole bucket:

    local shards --pad to equal size, flatten, concatenate--> one flat local buffer
    flat buffer as a DTensor sharded on dim 0 --redistribute to Replicate--> [world * flat] (1 all-gather)
    slice each parameter's [world, padded shard] columns, merge the rank axis into its shard dim

and hands out the full tensors. All of it is ordinary differentiable ops, so autograd's backward
is the mirror image with one reduce-scatter (and/or all-reduce on a replicate axis) of one flat
gradient buffer per bucket, and a traced step (graph/capture.py) holds exactly one collective per
bucket in each direction. The arithmetic is unchanged: each gradient element is still the sum of
the same per-rank values, so losses equal the per-parameter path's bitwise.

Gathered tensors live from the first read until the forward of the root module ends (a forward
pre-hook and hook on the root start and end each "gathering window"), or, for a block re-sharded
after the forward (parallel/reshard.py), until the block's own forward ends; autograd then keeps
tokens that gather the bucket again in the backward. Outside a root forward (a submodule called
directly) parameters are gathered one by one as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_tpu.model_contract import TrainableModel
from titan_tpu.parallel.axes import gathered_for_compute

__all__ = ["Bucket", "build_buckets", "bucket_owners", "bucketable", "group_into_buckets", "gather_per_tensor",
           "DEFAULT_BUCKET_MB"]

# Default cap on one bucket's gathered bytes (in the compute dtype). Large enough that a block of
# any model up to the 8B class is one or a few buckets (one collective per block, FSDP2's unit),
# small enough that one bucket's flat gather buffer stays a small slice of device memory.
DEFAULT_BUCKET_MB = 256.0

K = TypeVar("K")  # what group_into_buckets hands back for each parameter


class Bucket:
    """Parameters gathered together. members: (module, parameter name) pairs in read order; the
    same Parameter registered on two modules (tied weights) occupies one slot."""

    def __init__(self, members: list[tuple[nn.Module, str]], mp, *, owner: nn.Module | None = None) -> None:
        self.members = members
        self.mp = mp
        self.owner = owner  # the model piece whose parameters these are
        self._gathered: dict[tuple[int, str], Tensor] | None = None
        self.open = False  # inside a root forward (the gathering window)
        # Set by simple_fsdp when the bucket re-shards after the forward (parallel/reshard.py): its
        # gathers are registered there, so autograd saves tokens instead of the gathered tensors.
        self.reshard_hooks = None

    def set_open(self, value: bool) -> None:
        self.open = value
        self._gathered = None

    def release(self) -> None:
        """Drop the gathered tensors (the owner's forward is done; a later read gathers again)."""
        self._gathered = None

    def get(self, module: nn.Module, name: str) -> Tensor:
        if self._gathered is None:
            self._gathered = self._gather()
        return self._gathered[(id(module), name)]

    def _gather(self) -> dict[tuple[int, str], Tensor]:
        params, slot_of = [], {}
        for module, name in self.members:
            p = module._parameters[name]  # the live DTensor (functional_call swaps these)
            if id(p) not in slot_of:
                slot_of[id(p)] = len(params)
                params.append(p)
        full = gather_flat(params, self.mp)
        if self.reshard_hooks is not None:
            self.reshard_hooks.register(full, params, self._regather)
        return {(id(m), n): full[slot_of[id(m._parameters[n])]] for m, n in self.members}


    def _regather(self, params: list[DTensor]) -> list[Tensor]:
        return gather_flat(params, self.mp)


def _shard_axis(param: DTensor) -> tuple[int | None, int | None]:
    """(mesh dim, tensor dim) of the parameter's one Shard placement, or (None, None)."""
    shards = [(i, p.dim) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    return shards[0] if shards else (None, None)


def gather_flat(params: list[DTensor], mp) -> list[Tensor]:
    """The full tensors of `params` (same mesh and placements) through one collective per mesh
    axis; their gradients reduce through one collective per mesh axis too."""
    first = params[0]
    mesh, placements = first.device_mesh, tuple(first.placements)
    if mp.per_tensor and all(_shard_axis(p)[1] == 0 for p in params):
        return gather_per_tensor([p.to_local() for p in params], full_shapes=[p.shape for p in params],
                                 shard_dims=[0] * len(params), mesh=mesh, placements=placements, mp=mp)
    mesh_dim, _ = _shard_axis(first)
    world = mesh.size(mesh_dim) if mesh_dim is not None else 1
    # to_local is differentiable: its gradient becomes the parameter's sharded gradient.
    flat_local, layout = _flatten_shards([p.to_local() for p in params], [p.shape for p in params],
                                         [_shard_axis(p)[1] for p in params], world)
    flat_placements = [Shard(0) if isinstance(pl, Shard) else pl for pl in placements]
    flat = DTensor.from_local(flat_local, mesh, flat_placements, run_check=False)
    gathered = flat.redistribute(placements=[Replicate()] * mesh.ndim, forward_dtype=mp.param_dtype,
                                 backward_dtype=mp.reduce_dtype)
    # Every rank's gradient of a gathered weight covers its own micro-batch: a partial sum.
    gathered = gathered.to_local(grad_placements=[Partial()] * mesh.ndim)
    return list(_CopyOut.apply(gathered.view(world, flat_local.numel()), layout))


def gather_flat_local(locals_: list[Tensor], *, full_shapes: list, shard_dims: list, mesh, placements, mp,
                      keep: tuple[bool, ...] | None = None) -> list[Tensor]:
    """`gather_flat` for plain local shards (no DTensor): the same buffer, collectives and
    arithmetic, through an autograd Function that torch.func transforms accept (DTensor.from_local
    is not one), for a scanned layer's weights gathered inside the loop body (parallel/reshard.py).
    keep: per mesh axis, True where the shard stays (expert parallelism's ep axis); full_shapes
    are then the shapes computed with (this rank's experts, whole)."""
    keep = keep or (False,) * len(placements)
    if mp.per_tensor and all(dim == 0 for dim in shard_dims):
        return gather_per_tensor(locals_, full_shapes=full_shapes, shard_dims=shard_dims, mesh=mesh,
                                 placements=placements, mp=mp, keep=keep)
    mesh_dim = next((i for i, p in enumerate(placements) if isinstance(p, Shard) and not keep[i]), None)
    world = mesh.size(mesh_dim) if mesh_dim is not None else 1
    flat_local, layout = _flatten_shards(locals_, full_shapes, shard_dims, world, cat=_CatOwnGradients.apply)
    gathered = _FlatAllGather.apply(flat_local, mesh, tuple(placements), tuple(keep), mp)
    return list(_CopyOut.apply(gathered.view(world, flat_local.numel()), layout))


def gather_per_tensor(locals_: list[Tensor], *, full_shapes: list, shard_dims: list, mesh, placements, mp,
                      keep: tuple[bool, ...] | None = None) -> list[Tensor]:
    """`gather_flat_local`'s result (the full tensors, their gradients reduced as a bucket's) with
    one all-gather per tensor along its own shard dimension and one reduce-scatter per gradient
    (MixedPrecision.per_tensor): no flat buffer, so no reshape between it and the parameters.
    Taken where every tensor of the bucket is sharded on its first dimension (a layer's weights
    gathered inside the scan, unstacked parameters): a whole stack kept gathered is sharded on its
    second, and the reduce-scatter of its gradient moved to the front is one libtpu 0.0.52 refuses
    ("No feasible span count for single input all reduce scatter fusion"), so those keep the flat
    buffer."""
    keep = tuple(keep or (False,) * len(placements))
    return [_AllGatherAlong.apply(local, tuple(full), dim, mesh, tuple(placements), keep, mp)
            for local, full, dim in zip(locals_, full_shapes, shard_dims)]


class _AllGatherAlong(torch.autograd.Function):
    """One local shard -> its full tensor in the compute dtype: padded to the even shard size on
    its shard dim, moved to dim 0 (where an all-gather concatenates), gathered over the Shard mesh
    axis, cut back to the full size. Backward: the gradient in the reduce dtype, reduce-scattered
    over that axis and all-reduced over Replicate axes (sums), as `_FlatAllGather` does for a
    bucket. A tensor with no shard dim (whole on every rank) is only cast, its gradient all-reduced."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        local, full, dim, mesh, placements, keep, mp = inputs
        ctx.local_shape, ctx.full, ctx.dim, ctx.dtype = tuple(local.shape), full, dim, local.dtype
        ctx.mesh, ctx.placements, ctx.keep, ctx.mp = mesh, placements, keep, mp

    @staticmethod
    def forward(local: Tensor, full, dim, mesh, placements, keep, mp) -> Tensor:
        c10d = torch.ops._c10d_functional
        x = local.to(mp.param_dtype)
        if dim is None:
            return x.clone() if x is local else x
        axes = [a for a, p in enumerate(placements) if isinstance(p, Shard) and not keep[a]]
        assert len(axes) == 1, "a parameter sharded on one gathered mesh axis"
        group = mesh.get_group(axes[0])
        rows = math.ceil(full[dim] / group.size())
        x = x.movedim(dim, 0)
        if x.shape[0] < rows:  # the last ranks of an uneven split
            x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, rows - x.shape[0]])
        x = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), group.size(), group.group_name))
        return x.narrow(0, 0, full[dim]).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        c10d = torch.ops._c10d_functional
        g = grad.to(ctx.mp.reduce_dtype)
        dim = ctx.dim
        if dim is not None:
            g = g.movedim(dim, 0)
        for axis in reversed(range(len(ctx.placements))):
            if ctx.keep[axis]:
                continue  # the ep shard: each rank's gradient is its own experts' already
            group = ctx.mesh.get_group(axis)
            if isinstance(ctx.placements[axis], Shard) and dim is not None:
                rows = math.ceil(ctx.full[dim] / group.size())
                if g.shape[0] < rows * group.size():
                    g = F.pad(g, [0, 0] * (g.dim() - 1) + [0, rows * group.size() - g.shape[0]])
                g = c10d.wait_tensor(c10d.reduce_scatter_tensor(g.contiguous(), "sum", group.size(),
                                                                group.group_name))
                g = g.narrow(0, 0, ctx.local_shape[dim])
            else:
                g = c10d.wait_tensor(c10d.all_reduce(g.contiguous(), "sum", group.group_name))
        if dim is not None:
            g = g.movedim(0, dim)
        return g.contiguous().to(ctx.dtype), None, None, None, None, None, None


class _FlatAllGather(torch.autograd.Function):
    """flat local shard -> [world * flat] in the compute dtype (all-gather over the Shard mesh
    axis); backward: the gradient in the reduce dtype, reduce-scattered over the Shard axis and
    all-reduced over Replicate axes (sums), as DTensor's Partial -> placements reduction does."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        flat_local, mesh, placements, keep, mp = inputs
        ctx.mesh, ctx.placements, ctx.keep, ctx.mp, ctx.dtype = mesh, placements, keep, mp, flat_local.dtype

    @staticmethod
    def forward(flat_local: Tensor, mesh, placements, keep, mp) -> Tensor:
        c10d = torch.ops._c10d_functional
        x = flat_local.to(mp.param_dtype)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and not keep[axis]:
                group = mesh.get_group(axis)
                x = c10d.wait_tensor(c10d.all_gather_into_tensor(x, group.size(), group.group_name))
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        c10d = torch.ops._c10d_functional
        g = grad.to(ctx.mp.reduce_dtype)
        for axis in reversed(range(len(ctx.placements))):
            if ctx.keep[axis]:
                continue  # the ep shard: each rank's gradient is its own experts' already
            group = ctx.mesh.get_group(axis)
            if isinstance(ctx.placements[axis], Shard):
                g = c10d.wait_tensor(c10d.reduce_scatter_tensor(g.contiguous(), "sum", group.size(), group.group_name))
            else:
                g = c10d.wait_tensor(c10d.all_reduce(g, "sum", group.group_name))
        return g.to(ctx.dtype), None, None, None, None


class _CatOwnGradients(torch.autograd.Function):
    """torch.cat whose backward hands each input a gradient of its own (a copy), not a view of one
    buffer: gradients leaving a scan body must not alias each other (Inductor's scan refuses it)."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.sizes = [t.numel() for t in inputs]

    @staticmethod
    def forward(*pieces: Tensor) -> Tensor:
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return tuple(g.clone() for g in grad.split(ctx.sizes))


def _flatten_shards(locals_: list[Tensor], full_shapes: list, shard_dims: list, world: int, *,
                    cat=lambda *pieces: torch.cat(pieces)) -> tuple[Tensor, list]:
    """Local shards padded to equal size along their shard dim, flattened and concatenated; with
    the layout _CopyOut needs to cut the gathered buffer back into full tensors."""
    pieces, layout = [], []
    for local, full_shape, dim in zip(locals_, full_shapes, shard_dims):
        if dim is not None:
            rows = math.ceil(full_shape[dim] / world)  # torch.chunk's split: rank r holds [r*rows, (r+1)*rows)
            missing = rows - local.shape[dim]
            if missing:
                pad = [0, 0] * (local.dim() - 1 - dim) + [0, missing]
                local = F.pad(local, pad)
        layout.append((local.shape, dim, full_shape))
        pieces.append(local.reshape(-1))
    return cat(*pieces), layout


class _CopyOut(torch.autograd.Function):
    """[world, flat] gathered buffer -> each parameter's full tensor (a copy: the buffer is
    rank-major, a parameter is not), and in the backward the mirror: every gradient copied into
    one [world, flat] buffer. Written out because autograd's own backward of the slices would
    build one zero-filled buffer-sized tensor per parameter and add them all up."""

    # forward without ctx plus setup_context: the form torch.func transforms accept (a scanned
    # layer's backward takes the vjp of a body that gathers, models/common/scan.py).
    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        by_rank, layout = inputs
        ctx.layout, ctx.shape = layout, by_rank.shape

    @staticmethod
    def forward(by_rank: Tensor, layout: list) -> tuple[Tensor, ...]:
        out, offset = [], 0
        for local_shape, dim, full_shape in layout:
            numel = math.prod(local_shape)
            block = by_rank[:, offset:offset + numel].view(by_rank.shape[0], *local_shape)
            offset += numel
            if dim is None:
                out.append(block[0].clone())
                continue
            merged_shape = (*local_shape[:dim], by_rank.shape[0] * local_shape[dim], *local_shape[dim + 1:])
            merged = block.movedim(0, dim).reshape(merged_shape)  # the copy, usually
            full = merged.narrow(dim, 0, full_shape[dim]).contiguous()
            # reshape is a view where the layout allows (one rank; the buffer's only tensor, split
            # on dim 0): copy then too. An output aliasing the buffer breaks scan's
            # functionalisation (the body's saved weight is rebuilt as a strided view of a
            # different buffer) and would let one parameter's gradient view another's.
            out.append(full.clone() if full._is_view() else full)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        world = ctx.shape[0]
        padded = any(dim is not None and world * local[dim] != full[dim] for local, dim, full in ctx.layout)
        some = next(g for g in grads if g is not None)
        buffer = (some.new_zeros if padded or any(g is None for g in grads) else some.new_empty)(ctx.shape)
        offset = 0
        for g, (local_shape, dim, full_shape) in zip(grads, ctx.layout):
            numel = math.prod(local_shape)
            target = buffer[:, offset:offset + numel].view(world, *local_shape)
            offset += numel
            if g is None:
                continue
            if dim is None:
                target[0].copy_(g)
                continue
            rows = local_shape[dim]
            if world * rows != full_shape[dim]:
                # Uneven shards: the gradient covers full_shape[dim] of the world * rows slots.
                g = F.pad(g, [0, 0] * (g.dim() - 1 - dim) + [0, world * rows - full_shape[dim]])
            target.copy_(g.unflatten(dim, (world, rows)).movedim(dim, 0))
        return buffer, None


def bucket_owners(model: nn.Module) -> list[nn.Module]:
    """The pieces whose parameters are bucketed together: the model's init_plan pieces (embedding,
    each block or the whole stack of scanned blocks, final norm, output), else its children."""
    if isinstance(model, TrainableModel):
        return [piece for _, piece, _ in model.init_plan()]
    return list(model.children())


def bucketable(p) -> bool:
    """Whether a parameter is gathered whole, so it can share a flat buffer with others: a DTensor
    on no axis that compute reads sharded (parallel/axes.py: ep, tp). Expert weights keep their
    expert-parallel shard when read
    (simple_fsdp._replicate_for_compute) and tensor-parallel weights their tp shard: not a full
    gather, so they stay on the per-parameter path."""
    return isinstance(p, DTensor) and all(gathered_for_compute(p.device_mesh.mesh_dim_names or ()))


def _layout_key(p: DTensor) -> tuple:
    # The mesh by equality, not identity: parameters of one piece can hold equal but distinct
    # DeviceMesh objects (seen after another model was built in the same process), and splitting
    # a block's bucket on that would add a collective.
    return (p.device_mesh, tuple(p.placements), p.dtype)


def group_into_buckets(items: Iterable[tuple[K, DTensor]], *, mp, bucket_mb: float) -> list[list[K]]:
    """The bucketing rule, for one model piece: `items` ((key, bucketable parameter) in read order)
    grouped by layout (mesh, placements, dtype: one flat buffer needs one), each group cut into
    runs of at most `bucket_mb` MB gathered in `mp.param_dtype` (a parameter larger than that is a
    run of its own). Returns the runs' keys: a layout's runs in order, layouts in first-seen order.
    The order is the order of the collectives, so both users (build_buckets for attribute reads,
    simple_fsdp.BlockGather inside checkpointed blocks) issue the same ones."""
    cap = bucket_mb * 2**20
    groups: dict[tuple, list[list[K]]] = {}
    sizes: dict[tuple, float] = {}
    for key, p in items:
        layout = _layout_key(p)
        nbytes = p.numel() * mp.param_dtype.itemsize
        if layout not in groups or (sizes[layout] + nbytes > cap and groups[layout][-1]):
            groups.setdefault(layout, []).append([])
            sizes[layout] = 0.0
        groups[layout][-1].append(key)
        sizes[layout] += nbytes
    return [run for runs in groups.values() for run in runs]


def build_buckets(model: nn.Module, *, mp, bucket_mb: float, skip: set[int] = frozenset()) -> list[Bucket]:
    """Buckets of `model`'s DTensor parameters (see the module docstring), piece by piece
    (`bucket_owners`), by `group_into_buckets`. Parameters of a piece that live on another mesh or
    with other placements (expert weights under expert parallelism) get their own buckets.
    skip: ids of parameters gathered another way (a scanned stack gathered per layer)."""
    buckets, seen = [], set()
    for owner in bucket_owners(model):
        items = []
        for module in owner.modules():
            for name, p in module._parameters.items():
                if not bucketable(p) or (id(module), name) in seen or id(p) in skip:
                    continue
                seen.add((id(module), name))
                items.append(((module, name), p))
        buckets.extend(Bucket(members, mp, owner=owner)
                       for members in group_into_buckets(items, mp=mp, bucket_mb=bucket_mb))
    return buckets
