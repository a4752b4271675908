"""A Hugging Face checkpoint read lazily, block by block: every native weight as a `TensorSource`
whose `read(index)` returns just the block `index` selects (a tuple of slices, one per dimension),
read from the safetensors files with `get_slice` and put in the native layout on the way.

Why: one process per chip of a 70B run holds 1/256 of each weight; reading every tensor whole into
every process (140 GB of bf16 each, four processes per host) cannot fit a host. Here each process
reads the rows (or columns, or experts) of the block it keeps, plus at most a head's rows either
side where the RoPE layout permutes rows within heads: its share, and a buffer the size of the
largest block it holds of one weight.

The sources, composed per weight by `native_sources` from the files' headers alone (no tensor is
read before every name and shape is checked):

* `FileTensor`: one tensor of one file, as stored (`InMemory`: one already in memory).
* `RowsPermuted`: HF's rotate-half row order within each head made the native interleaved one
  (wq, wk, the q/k norms; models/hub/adapter.py says why).
* `Stacked`: per-expert tensors stacked on a new first dimension (the hub's MoE layout); `Selected`,
  one of them again (an export).
* `Narrowed`: a range of one dimension of a source (the gate half of transformers 5.x's fused
  `gate_up_proj`).
* `MergedLoRA`: a base weight with its LoRA pair folded in (an export of a LoRA run).
* `BlockDequantized`: an fp8 weight times its per-block scale, `weight_scale_inv` (DeepSeek-V3's
  released checkpoints: e4m3 weights in 128 x 128 blocks), dequantised to float32 on the way in.

Files are opened one at a time and closed when a read needs another or a few hundred MB have
been read through one (`ShardFiles`), so the pages a process touched of a file are released.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["BlockDequantized", "FileTensor", "InMemory", "MergedLoRA", "Narrowed", "RowsPermuted", "Selected",
           "ShardFiles", "Stacked", "TensorSource", "full_index", "interleaved_to_rotate_half", "read_block_",
           "rotate_half_to_interleaved", "row_blocks"]


class TensorSource(Protocol):
    shape: tuple[int, ...]

    def read(self, index: tuple[slice, ...]) -> Tensor:
        """The block of the (native) tensor that `index` selects: one slice of step 1 per dimension."""
        ...


def full_index(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


class ShardFiles:
    """The checkpoint's safetensors files, at most one open at a time, and reopened once
    `MAPPED_BYTES` have been read through it: a file is read through a memory map, and the pages a
    read touched stay in this process's resident set until the map is dropped."""

    MAPPED_BYTES = 256 * 2**20

    def __init__(self):
        self._path: Path | None = None
        self._handle = None
        self._read = 0

    def slice(self, path: Path, key: str, index: tuple[slice, ...]) -> Tensor:
        if path != self._path:
            from safetensors import safe_open

            self.close()
            self._handle, self._path = safe_open(str(path), framework="pt"), path
        block = self._handle.get_slice(key)[index]
        self._read += block.nbytes
        if self._read >= self.MAPPED_BYTES:
            self.close()
        return block

    def close(self) -> None:
        self._handle, self._path, self._read = None, None, 0  # dropping the handle unmaps the file


@dataclasses.dataclass
class FileTensor:
    files: ShardFiles
    path: Path
    key: str
    shape: tuple[int, ...]

    def read(self, index: tuple[slice, ...]) -> Tensor:
        if not self.shape:  # a 0-dim tensor: nothing to slice
            return self.files.slice(self.path, self.key, ())
        return self.files.slice(self.path, self.key, index)


@dataclasses.dataclass
class InMemory:
    """A tensor already in memory, as a source (a state dict converted whole)."""

    tensor: Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, index: tuple[slice, ...]) -> Tensor:
        return self.tensor[index]


def rotate_half_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """HF's RoPE row order within each head, [first halves of pairs | second halves], made the
    native interleaved one; for 2-D projection weights [n_heads * hd, dim] and 1-D norm weights [hd]
    (models/hub/adapter.py says why the layouts differ)."""
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(w.shape).contiguous()


def interleaved_to_rotate_half(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of `rotate_half_to_interleaved` (an export)."""
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).reshape(w.shape).contiguous()


@dataclasses.dataclass
class RowsPermuted:
    """Rows of each of `n_heads` heads in HF's rotate-half order, read in the native interleaved
    order (to_native; the other way round for an export): the heads a block's rows fall in are
    read whole, permuted, and cut to the block."""

    source: TensorSource
    n_heads: int
    to_native: bool = True

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    def read(self, index: tuple[slice, ...]) -> Tensor:
        rows = index[0]
        head_rows = self.shape[0] // self.n_heads
        first, last = rows.start // head_rows, math.ceil(rows.stop / head_rows)
        covered = self.source.read((slice(first * head_rows, last * head_rows), *index[1:]))
        permute = rotate_half_to_interleaved if self.to_native else interleaved_to_rotate_half
        return permute(covered, last - first)[rows.start - first * head_rows: rows.stop - first * head_rows]


@dataclasses.dataclass
class Selected:
    """One index of a source's first dimension (one expert of a stack, on export)."""

    source: TensorSource
    position: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape[1:]

    def read(self, index: tuple[slice, ...]) -> Tensor:
        return self.source.read((slice(self.position, self.position + 1), *index))[0]


@dataclasses.dataclass
class Stacked:
    parts: list[TensorSource]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def read(self, index: tuple[slice, ...]) -> Tensor:
        return torch.stack([self.parts[j].read(index[1:]) for j in range(index[0].start, index[0].stop)])


@dataclasses.dataclass
class Narrowed:
    source: TensorSource
    dim: int
    start: int
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def read(self, index: tuple[slice, ...]) -> Tensor:
        index = list(index)
        index[self.dim] = slice(index[self.dim].start + self.start, index[self.dim].stop + self.start)
        return self.source.read(tuple(index))


@dataclasses.dataclass
class BlockDequantized:
    """A float8 weight [out, in] times its scale [ceil(out / b0), ceil(in / b1)], one per block of
    b0 x b1 values (DeepSeek-V3's `weight_scale_inv`: what the stored value is multiplied by), in
    float32. A block of the weight reads only the scales of the blocks it touches."""

    weight: TensorSource
    scale: TensorSource
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def read(self, index: tuple[slice, ...]) -> Tensor:
        rows, cols = index
        (b0, b1) = self.block
        r0, c0 = rows.start // b0, cols.start // b1
        scale = self.scale.read((slice(r0, math.ceil(rows.stop / b0)), slice(c0, math.ceil(cols.stop / b1))))
        scale = scale.float().repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
        scale = scale[rows.start - r0 * b0: rows.stop - r0 * b0, cols.start - c0 * b1: cols.stop - c0 * b1]
        return self.weight.read(index).float() * scale


@dataclasses.dataclass
class MergedLoRA:
    """A base weight [out, in] with its LoRA pair folded in, W + (B @ A) * scaling, block by block:
    rows of B, columns of A."""

    weight: TensorSource
    lora_a: TensorSource  # [rank, in]
    lora_b: TensorSource  # [out, rank]
    scaling: float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def read(self, index: tuple[slice, ...]) -> Tensor:
        rows, cols = index
        rank = self.lora_a.shape[0]
        a = self.lora_a.read((slice(0, rank), cols)).float()
        b = self.lora_b.read((rows, slice(0, rank))).float()
        weight = self.weight.read(index)
        return (weight.float() + (b @ a) * self.scaling).to(weight.dtype)


# The most one read of an export or an import asks for (in float32): an embedding of 128k x 4096 goes in a few
# blocks of rows, so neither its float32 copy nor the conversion to the export's dtype is whole.
READ_BYTES = 512 * 2**20


def row_blocks(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The blocks of consecutive rows (first dimension) a tensor of `shape` is read in: whole when
    it is at most READ_BYTES in float32; rows laid end to end, so their bytes are the tensor's."""
    if len(shape) == 0:
        return [()]
    row_bytes = max(1, math.prod(shape[1:]) * 4)
    rows = max(1, READ_BYTES // row_bytes)
    rest = tuple(slice(0, n) for n in shape[1:])
    return [(slice(start, min(start + rows, shape[0])), *rest) for start in range(0, max(shape[0], 1), rows)]


def read_block_(target: Tensor, source: TensorSource) -> None:
    """Write into `target` (a plain tensor, or a DTensor: then only this rank's block) its values
    from `source`, cast to the target's dtype: the block this process holds, and nothing else, is read."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"a weight of shape {tuple(source.shape)} does not fit a parameter of shape "
                         f"{tuple(target.shape)}")
    if isinstance(target, DTensor):
        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        assert tuple(shape) == tuple(local.shape), (tuple(shape), tuple(local.shape))
    else:
        local, shape, offset = target, tuple(target.shape), (0,) * target.dim()
    if local.numel() == 0:
        return
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    with torch.no_grad():
        local.copy_(source.read(index).to(device=local.device, dtype=local.dtype))
