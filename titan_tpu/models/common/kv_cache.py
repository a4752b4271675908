"""A static-shape key/value cache for decoding with the native Transformer (titan_tpu/generate).

Each layer keeps what its attention needs of every earlier token in buffers of one fixed window,
[B, S, ...], allocated once: a decode step then has the same shapes at every position, so a
compiler builds it once. A call writes the new tokens' entries at their positions and each query
sees the cached positions up to its own.

Positions are per row: prompts of different lengths sit right-padded in the batch, every row
writes at its own position, and RoPE takes each token's true position. Entries past a row's
position (a shorter prompt's padding, or nothing yet) are never visible to that row's queries, and
decoding overwrites them as the row reaches them.

What a layer caches is the attention's own choice (`cache_entry_shapes`): grouped-query attention
its keys after RoPE and its values, [K, D] each per token; multi-head latent attention its
normalised latent [kv_lora_rank] and its RoPE key [1, qk_rope_head_dim], from which every head's
key and value are expanded at each step (models/common/mla.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LayerCache(NamedTuple):
    """One layer's cached tensors during one call, with the positions the call's tokens hold."""

    buffers: tuple[Tensor, ...]  # [B, S, ...] each, written in place
    positions_BQ: Tensor  # the position of each of the call's Q tokens (int64)
    visible_BQS: Tensor  # query (b, i) may attend to key j: j <= positions_BQ[b, i]

    def write(self, *entries: Tensor) -> tuple[Tensor, ...]:
        """Write each entry [B, Q, ...] at its tokens' positions; the whole buffers [B, S, ...] back."""
        for buffer, entry in zip(self.buffers, entries):
            index = self.positions_BQ.view(*self.positions_BQ.shape, *[1] * (entry.ndim - 2)).expand_as(entry)
            buffer.scatter_(1, index, entry.to(buffer.dtype))
        return self.buffers


class KVCache:
    """Every layer's buffers (`LayerCache.buffers`), in layer order."""

    def __init__(self, buffers: list[tuple[Tensor, ...]]):
        self.buffers = buffers

    @classmethod
    def empty(cls, entry_shapes: list[tuple[tuple[int, ...], ...]], *, batch: int, length: int,
              dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """Zeroed buffers [batch, length, *shape] for each layer's entry shapes."""
        return cls([tuple(torch.zeros(batch, length, *shape, dtype=dtype, device=device) for shape in shapes)
                    for shapes in entry_shapes])

    @property
    def length(self) -> int:
        return self.buffers[0][0].shape[1]

    def at(self, positions_BQ: Tensor) -> list[LayerCache]:
        """Each layer's view for a call whose tokens hold `positions_BQ`."""
        keys_S = torch.arange(self.length, device=positions_BQ.device)
        visible_BQS = keys_S <= positions_BQ.unsqueeze(-1)
        return [LayerCache(buffers, positions_BQ, visible_BQS) for buffers in self.buffers]
