"""Several sources mixed by weight, and chat rows: one exactly resumable, rank-aware loader.

A source gives numbered rows of ``seq_len`` tokens: ``TextRows`` cuts its token stream into
windows as ``TokenLoader`` does; ``ChatRows`` packs whole conversations into rows (in order,
greedily; a conversation longer than ``seq_len`` is dropped and counted, or truncated), pads the
rest, and labels only assistant tokens (-100 elsewhere). The last ``val_fraction`` of each
source's rows are held out for validation.

Global row ``g`` (the ``g``-th row of all training batches, all ranks; rank ``r`` takes rows
``[r*B, (r+1)*B)`` of each global batch, as ``TokenLoader`` does) comes from the source that
``u_g`` falls in, over the normalised weights of the sources still active, where ``u_g`` is a
Weyl sequence: ``u_g = frac(g * phi + offset(seed))``. Its first n points fill every interval of
[0, 1) to within O(log n / n) of its length, so each source's realised share of rows (and of
tokens: every row is ``seq_len`` tokens) tracks its weight closely from the first steps, and the
choice depends on (seed, g) alone. The ``k``-th row taken from source ``i`` is row
``perm(seed, i, k // n_i)[k % n_i]``, a seeded permutation per epoch, so a source that runs out
starts its next epoch; with ``repeat = false`` it leaves the mixture instead.

The position is (rows consumed, rows taken per source): independent of the number of ranks, so
a run resumes on another world size at the same place, as with ``TokenLoader``.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np
import torch

from titan_tpu.data.loader import _num_val_windows, document_positions
from titan_tpu.data.shards import TokenShards

IGNORE = -100
_STATE_VERSION = 1
_PHI64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: the Weyl step
_MASK64 = (1 << 64) - 1


class RowSource(Protocol):
    num_train: int
    num_val: int

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs_S, labels_S, positions_S), int64; rows >= num_train are validation rows."""


class TextRows:
    """Windows of a token stream (documents joined by eos), as TokenLoader cuts them."""

    def __init__(self, shards: TokenShards, *, seq_len: int, val_fraction: float, all_val: bool = False):
        self.shards, self.seq_len = shards, seq_len
        windows = (shards.num_tokens - 1) // seq_len
        self.num_val = windows if all_val else _num_val_windows(windows, val_fraction)
        self.num_train = windows - self.num_val

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens = self.shards.read(index * self.seq_len, self.seq_len + 1).astype(np.int64)
        inputs = tokens[:-1]
        return inputs, tokens[1:], document_positions(inputs[None], self.shards.eos_id)[0]


def pack_bounds(lengths: list[int], images: list[int] | None = None, *, seq_len: int, max_images: int = 0
                ) -> list[int]:
    """Greedy packing in stored order: row r holds conversations [bounds[r], bounds[r+1]). A
    conversation starts a new row when the row's tokens (or, with `images`, each conversation's
    image count, its image slots) would not hold it."""
    images = images if images is not None else [0] * len(lengths)
    bounds, tokens, slots = [0], 0, 0
    for j, (n, k) in enumerate(zip(lengths, images)):
        if j > bounds[-1] and (tokens + n > seq_len or slots + k > max_images):
            bounds.append(j)
            tokens, slots = 0, 0
        tokens += n
        slots += k
    if lengths:
        bounds.append(len(lengths))
    return bounds


class ChatRows:
    """Whole conversations packed into rows, loss on assistant tokens only."""

    def __init__(self, chat, *, seq_len: int, val_fraction: float, overlong: str = "drop", all_val: bool = False):
        self.chat, self.seq_len = chat, seq_len
        lengths = chat.lengths
        too_long = lengths > seq_len
        self.num_dropped = int(too_long.sum()) if overlong == "drop" else 0
        self.num_truncated = int(too_long.sum()) if overlong == "truncate" else 0
        keep = np.flatnonzero(~too_long) if overlong == "drop" else np.arange(len(lengths))
        self.conv = keep
        self.used = np.minimum(lengths[keep], seq_len)
        # Row b holds conversations conv[bounds[b]:bounds[b+1]].
        self.bounds = np.asarray(pack_bounds(self.used.tolist(), seq_len=seq_len), dtype=np.int64)
        rows = len(self.bounds) - 1
        self.num_val = rows if all_val else _num_val_windows(rows, val_fraction)
        self.num_train = rows - self.num_val

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        S = self.seq_len
        eos = self.chat.tokens.eos_id
        inputs = np.full(S, eos, dtype=np.int64)
        labels = np.full(S, IGNORE, dtype=np.int64)
        positions = np.zeros(S, dtype=np.int64)
        at = 0
        for j in range(self.bounds[index], self.bounds[index + 1]):
            c, n = self.conv[j], int(self.used[j])
            start = int(self.chat.starts[c])
            tokens = self.chat.tokens.read(start, n).astype(np.int64)
            trained = self.chat.mask[start : start + n].astype(bool)
            inputs[at : at + n] = tokens
            labels[at : at + n - 1] = np.where(trained[1:], tokens[1:], IGNORE)
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(S - at)  # padding: a document of its own, never trained
        return inputs, labels, positions


def _weyl(seed: int, g: int) -> float:
    offset = (seed * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    return ((g * _PHI64 + offset) & _MASK64) / 2.0**64


class MixtureLoader:
    """Batches over weighted row sources (one source works too), exactly resumable."""

    def __init__(self, sources: list[RowSource], *, names: list[str], weights: list[float], repeat: list[bool],
                 seq_len: int, batch_size: int, seed: int, dp_rank: int = 0, dp_world_size: int = 1,
                 document_mask: bool = True, split: str = "train"):
        if dp_world_size <= 0 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
        if len(set(names)) != len(names):
            raise ValueError(f"data source names {names} repeat; give each [[data.sources]] entry its own name")
        total = sum(weights)
        self.sources, self.names = sources, names
        self.weights = np.array([w / total for w in weights])
        self.repeat = repeat
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.global_batch = batch_size * dp_world_size
        self.document_mask = document_mask
        for name, s, w in zip(names, sources, self.weights):
            if split == "train" and w > 0 and s.num_train == 0:
                raise ValueError(f"data source {name!r} has no training row of {seq_len} tokens (after the validation "
                                 f"split); use more data, a smaller training.seq_len, or weight 0")
        self.rows_consumed = 0
        self.taken = [0] * len(sources)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    # -- which row ------------------------------------------------------------------------------

    def _active(self, taken: list[int]) -> np.ndarray:
        return np.array([w > 0 and (r or k < s.num_train)
                         for w, r, k, s in zip(self.weights, self.repeat, taken, self.sources)])

    def _choose(self, g: int, taken: list[int]) -> int:
        active = self._active(taken)
        if not active.any():
            raise ValueError(f"every data source is exhausted after {g:,} rows (repeat = false); set repeat = true "
                             f"on a source or lower training.steps")
        cum = np.cumsum(np.where(active, self.weights, 0.0))
        return int(min(np.searchsorted(cum, _weyl(self.seed, g) * cum[-1], side="right"), len(cum) - 1))

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(source)
        if cached is None or cached[0] != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, source, epoch]))
            cached = (epoch, rng.permutation(self.sources[source].num_train))
            self._perms[source] = cached
        return cached[1]

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """This rank's (inputs_BS, labels_BS[, positions_BS]) int64; labels -100 where untrained."""
        picks, taken = [], list(self.taken)
        for j in range(self.global_batch):
            i = self._choose(self.rows_consumed + j, taken)
            picks.append((i, taken[i]))
            taken[i] += 1
        self.taken = taken  # only a whole global batch moves the position
        self.rows_consumed += self.global_batch
        mine = picks[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        rows = []
        for i, k in mine:
            n = self.sources[i].num_train
            rows.append(self.sources[i].row(int(self._permutation(i, k // n)[k % n])))
        return self._stack(rows)

    def _stack(self, rows) -> tuple[torch.Tensor, ...]:
        batch = tuple(torch.from_numpy(np.stack(parts)) for parts in zip(*rows))
        return batch if self.document_mask else batch[:2]

    def val_batches(self, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every source's validation rows in fixed order, ``batch_size`` per rank at a time (at
        least one batch, wrapping around; the same count on every rank)."""
        index = [(s, s.num_train + v) for s in self.sources for v in range(s.num_val)]
        if not index:
            return
        num_batches = max(1, len(index) // self.global_batch)
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            start = b * self.global_batch + self.dp_rank * self.batch_size
            yield self._stack([index[p % len(index)][0].row(index[p % len(index)][1])
                               for p in range(start, start + self.batch_size)])

    # -- what was read --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Realised token share and epochs started per source, since the start of training."""
        total = max(sum(self.taken), 1)
        out = {}
        for name, k, s in zip(self.names, self.taken, self.sources):
            out[f"data/{name}/share"] = k / total
            out[f"data/{name}/epochs"] = k // max(s.num_train, 1)
        return out

    # -- checkpointing --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "kind": "mixture", "seed": self.seed, "seq_len": self.seq_len,
                "rows_consumed": self.rows_consumed, "taken": dict(zip(self.names, self.taken)),
                "num_rows": {n: s.num_train for n, s in zip(self.names, self.sources)}}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "mixture":
            raise ValueError("checkpointed data position is from a single-source run, this run mixes sources; resume "
                             "with the same data.source / data.sources")
        if sd["seq_len"] != self.seq_len:
            raise ValueError(f"checkpointed data position is for seq_len {sd['seq_len']}, this run uses "
                             f"{self.seq_len}; set --training.seq_len {sd['seq_len']} to resume")
        rows = {n: s.num_train for n, s in zip(self.names, self.sources)}
        if sd["num_rows"] != rows:
            raise ValueError(f"checkpointed data position is for sources {sd['num_rows']} (rows each), this run has "
                             f"{rows}; resume with the same data.sources, max_bytes, tokenizer and val_fraction")
        self.seed = int(sd["seed"])
        self.rows_consumed = int(sd["rows_consumed"])
        self.taken = [int(sd["taken"][n]) for n in self.names]
        self._perms = {}
