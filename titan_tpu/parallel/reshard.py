"""Re-sharding after the forward: gathered block weights are not kept for the backward.

Autograd keeps what each op needs for its backward; a matmul keeps its weight input. Under
SimpleFSDP that input is the all-gathered weight, so without this module every gathered block
weight stays alive from its forward use to its backward use: the whole model per rank in the
compute dtype (parallel/plan_terms.py). FSDP2 and TorchTitan's SimpleFSDP default to re-sharding
after the forward instead: the weights are gathered again in the backward when needed.

How: while the root module's forward runs, `ReshardHooks` is installed as autograd's
saved-tensor hooks. A gathered weight (or a view of one, such as the transpose a matmul keeps)
that autograd wants to save is packed as a small token (the gather it came from, its slot and
the view's size/stride/offset) instead of the tensor. Unpacking the first token of a gather in
the backward all-gathers that bucket once more (one collective, no autograd: the gradient still
flows through the forward's gather and its one reduce-scatter) and hands out the same view of the
new copy; the copy is dropped after the gather's last token is unpacked. So between its forward
and its backward a block holds only its local shards.

The same code runs eagerly and under the graph capture (graph/capture.py): make_fx records what
the hooks do, so the captured backward holds the re-gathers as ordinary all-gather nodes placed
where the backward first needs each bucket (checked in tests/test_buckets.py).

`LayerGather` gathers the weights of one layer of a scanned stack (models/common/scan.py) inside
the loop body: the stack is passed to the loop as local shards, each iteration gathers its own
layer (one all-gather) and, in the backward, reduce-scatters that layer's gradient (one
reduce-scatter), so neither the gathered stack nor its full-size gradient ever exists.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from titan_tpu.parallel.axes import EP_AXIS
from titan_tpu.parallel.buckets import gather_flat_local

__all__ = ["ReshardHooks", "LayerGather"]


class GatherRecord:
    """One gather of one forward: how to redo it (its source shards) and the backward's copy."""

    def __init__(self, sources: list, regather) -> None:
        self.sources = sources  # the DTensors (or local shards) gathered; alive anyway
        self.regather = regather  # sources -> list of full tensors (one collective)
        self.pending = 0  # tokens packed and not yet unpacked
        self.copy: list[Tensor] | None = None

    def unpack(self, slot: int, size, stride, offset) -> Tensor:
        full = self.copy
        if full is None:
            with torch.no_grad():  # a value for the backward only: its gradient path is the forward's gather
                full = self.regather(self.sources)
            self.copy = full
        self.pending -= 1
        if self.pending <= 0:
            self.copy = None  # the last use in this backward: the caller holds the view until it is done
        return full[slot].as_strided(size, stride, offset)


def _root(t: Tensor) -> Tensor:
    return t._base if t._base is not None else t


class ReshardHooks:
    """Saved-tensor hooks that turn registered gathered tensors (and views of them) into tokens.

    A gathered tensor is identified by its root storage tensor (a view's `_base`, e.g. the
    transpose `F.linear` saves); entries leave the registry when that tensor is freed, so a reused
    id never matches."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[GatherRecord, int]] = {}
        self._context = None

    def register(self, full: list[Tensor], sources: list, regather) -> None:
        """Pack `full` (the tensors one gather of `sources` produced) as tokens from now on;
        `regather(sources)` redoes that gather in the backward."""
        record = GatherRecord(sources, regather)
        for slot, t in enumerate(full):
            root = _root(t)
            key = id(root)
            self._records[key] = (record, slot)
            weakref.finalize(root, self._records.pop, key, None)

    def pack(self, t: Tensor):
        hit = self._records.get(id(_root(t)))
        if hit is None:
            return t
        record, slot = hit
        record.pending += 1
        return (record, slot, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(packed):
        if isinstance(packed, Tensor):
            return packed
        record, slot, size, stride, offset = packed
        return record.unpack(slot, size, stride, offset)

    # Entered and left by the root module's forward pre-hook and hook (simple_fsdp._install_buckets).
    def enter(self) -> None:
        assert self._context is None, "re-entrant root forward"
        self._context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._context.__enter__()

    def exit(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


class LayerGather:
    """Per-layer gathering of a scanned stack's weights (see the module docstring).

    Set by simple_fsdp on a StackedBlocks module as `per_layer_gather`; the model calls
    `local(stored)` once per forward (the stacked DTensor parameters -> their local shards
    [L, ...], differentiable: their gradients become the parameters' sharded gradients) and, in
    the loop body, `gather(layer_tensors)` on one layer's slices (full tensors out; buffers, which
    are not DTensors, pass through)."""

    def __init__(self, stored: list, *, mp, hooks: ReshardHooks | None) -> None:
        self.mp = mp
        self.hooks = hooks
        # Per stored entry: its group's key, or None (a buffer: passed through). A group is the
        # layer's tensors with one mesh and placements (the dense weights; expert weights under
        # expert parallelism, whose ep shard is kept: a rank computes with its own experts): one
        # all-gather each per layer.
        self.keys: list = []
        self.groups: dict = {}  # key -> (mesh, per-layer placements, keep per mesh axis, [(compute shape, shard dim)])
        for t in stored:
            if not isinstance(t, DTensor):
                self.keys.append(None)
                continue
            mesh = t.device_mesh
            placements = tuple(Shard(p.dim - 1) if isinstance(p, Shard) else p for p in t.placements)
            keep = tuple(name == EP_AXIS for name in (mesh.mesh_dim_names or ())) or (False,) * mesh.ndim
            shape = list(t.shape[1:])
            for axis, p in enumerate(placements):
                if keep[axis] and isinstance(p, Shard):
                    shape[p.dim] //= mesh.size(axis)  # this rank's experts, whole
            dims = [p.dim for axis, p in enumerate(placements) if isinstance(p, Shard) and not keep[axis]]
            key = (mesh, placements)
            members = self.groups.setdefault(key, (mesh, placements, keep, []))[3]
            members.append((tuple(shape), dims[0] if dims else None))
            self.keys.append(key)

    def local(self, stored: list[Tensor]) -> list[Tensor]:
        return [t.to_local() if isinstance(t, DTensor) else t for t in stored]

    def _full(self, key, sources: list[Tensor]) -> list[Tensor]:
        mesh, placements, keep, specs = self.groups[key]
        return gather_flat_local(sources, full_shapes=[s[0] for s in specs], shard_dims=[s[1] for s in specs],
                                 mesh=mesh, placements=placements, keep=keep, mp=self.mp)

    def gather(self, layer_tensors: list[Tensor]) -> list[Tensor]:
        out = list(layer_tensors)
        for key in self.groups:
            where = [i for i, k in enumerate(self.keys) if k == key]
            sources = [layer_tensors[i] for i in where]
            regather = functools.partial(self._full, key)
            full = regather(sources)
            if self.hooks is not None:
                self.hooks.register(full, sources, regather)
            for i, t in zip(where, full):
                out[i] = t
        return out
