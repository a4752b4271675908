"""A training checkpoint's model weights read lazily, block by block, for an export that never
holds the whole model (`CheckpointTensors`), and written lazily, tensor by tensor, for an import
(`SourcesSavePlanner`). Each weight is a `TensorSource` (models/hub/sources.py) whose
`read(index)` asks DCP for just that block of the tensor.

Why not `load_full_state_dict`: it holds every weight at once in fp32 (1.6 TB for 405B). Here one
block is in memory at a time, plus the one chunk DCP deserialises to serve it (a chunk is what one
rank saved of that tensor, so a checkpoint of many ranks has small chunks), plus a small cache of
whole tensors for the exports that read one tensor in many pieces (one expert at a time of a
stacked expert weight).

The block read is DCP's own resharding load, planned for one block: `_BlockLoadPlanner` asks
`create_read_items_for_chunk_list` (the function DCP plans a rank's shard with) for the reads that
cover the block, and DCP's reader does the rest (file layout, transforms, versions).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from titan_tpu.models.hub.sources import TensorSource, row_blocks

__all__ = ["CheckpointTensors", "SavedTensor", "SourcesSavePlanner", "placeholder"]

# Whole tensors kept for reads of one piece at a time (experts exported one by one from their
# stack): at most this many bytes; larger tensors are read block by block, uncached.
CACHE_BYTES = 2**30


class _BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for one block (`offsets`, `sizes`) of one saved tensor `fqn`."""

    def __init__(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.block = (fqn, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))

    def create_local_plan(self) -> LoadPlan:
        fqn, chunk = self.block
        return LoadPlan(create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk]))

    def lookup_tensor(self, index) -> Tensor:
        # The block's buffer, whatever offset DCP names it by (a plain tensor has no shards to look up).
        return self.state_dict[index.fqn]


class CheckpointTensors:
    """The tensors a checkpoint saved under `key` ("model"), by their names there, as sources."""

    def __init__(self, step_dir: str | Path, *, key: str = "model", cache_bytes: int = CACHE_BYTES):
        self.path = Path(step_dir)
        self.prefix = key + "."
        saved = FileSystemReader(self.path).read_metadata().state_dict_metadata
        self.tensors = {fqn[len(self.prefix):]: md for fqn, md in saved.items()
                        if fqn.startswith(self.prefix) and isinstance(md, TensorStorageMetadata)}
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, Tensor] = OrderedDict()

    def sources(self) -> dict[str, SavedTensor]:
        return {name: SavedTensor(self, name, tuple(md.size), md.properties.dtype) for name, md in self.tensors.items()}

    def read(self, name: str, index: tuple[slice, ...]) -> Tensor:
        md = self.tensors[name]
        shape = tuple(md.size)
        whole = all(s.start == 0 and s.stop == n for s, n in zip(index, shape))
        nbytes = math.prod(shape) * md.properties.dtype.itemsize
        if whole or nbytes > self.cache_bytes:
            self._cache.clear()  # one large read at a time: the cache does not stack on it
            return self._load(name, index)
        if name not in self._cache:
            while self._cache and sum(t.nbytes for t in self._cache.values()) + nbytes > self.cache_bytes:
                self._cache.popitem(last=False)
            self._cache[name] = self._load(name, tuple(slice(0, n) for n in shape))
        self._cache.move_to_end(name)
        return self._cache[name][index]

    def _load(self, name: str, index: tuple[slice, ...]) -> Tensor:
        md = self.tensors[name]
        offsets = tuple(s.start for s in index)
        sizes = tuple(s.stop - s.start for s in index)
        block = torch.empty(sizes, dtype=md.properties.dtype)
        if block.numel():
            fqn = self.prefix + name
            dcp.load({fqn: block}, storage_reader=FileSystemReader(self.path),
                     planner=_BlockLoadPlanner(fqn, offsets, sizes), no_dist=True)
        return block


@dataclasses.dataclass
class SavedTensor:
    checkpoint: CheckpointTensors
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, index: tuple[slice, ...]) -> Tensor:
        return self.checkpoint.read(self.name, index)


class SourcesSavePlanner(DefaultSavePlanner):
    """DCP's save planner for a state whose tensors are placeholders on the meta device (their
    shapes and dtypes plan the files): each is read from its source (`sources`, by DCP's flattened
    name, "model.<name>") when the writer comes to it, so one tensor is in memory at a time."""

    def __init__(self, sources: dict[str, TensorSource]):
        super().__init__()
        self.sources = sources
        self._written: Tensor | None = None

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if fqn not in self.sources:
            return super().resolve_data(write_item)
        # DCP's file writer (torch 2.13, filesystem.py) keeps every tensor it wrote to a file in a
        # dict until the file is closed (for its safetensors format only): a training save holds
        # the live model anyway, but here each tensor was read for this write alone. The writer
        # asks for the next tensor only once the previous one is in the file, so its storage is
        # released here, and one tensor is in memory at a time.
        if self._written is not None:
            self._written.untyped_storage().resize_(0)
        placeholder = self.lookup_object(write_item.index)
        source = self.sources[fqn]
        self._written = torch.empty(source.shape, dtype=placeholder.dtype)  # a storage of its own: resizable
        for index in row_blocks(source.shape):  # the source's copy (another dtype) a block at a time
            self._written[index] = source.read(index)
        return self._written


def placeholder(source: TensorSource) -> Tensor:
    """A meta tensor of the source's shape and dtype (that of a one-element read) for
    `SourcesSavePlanner` to plan with."""
    corner = source.read(tuple(slice(0, min(n, 1)) for n in source.shape))
    return torch.empty(source.shape, dtype=corner.dtype, device="meta")
