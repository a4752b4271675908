"""Packed, shuffled, rank-aware, exactly resumable batches over a token stream.

The token stream (documents joined by eos) is cut into windows of ``seq_len + 1`` tokens with
stride ``seq_len``; window ``i`` covers tokens ``[i * seq_len, i * seq_len + seq_len + 1)`` and
gives one sample: inputs = its first ``seq_len`` tokens, labels = its last ``seq_len``. Windows
pack across document boundaries, which wastes no tokens and keeps every batch the same shape
(what compiled, static-shape steps need).

The last ``val_fraction`` of windows form the validation split; the rest are training windows.
Training visits them in a seeded permutation per epoch. Step ``k`` of an epoch takes the global
batch = permutation entries ``[k*B*W, (k+1)*B*W)`` (B per-rank batch, W data-parallel ranks) and
rank ``r`` takes entries ``[r*B, (r+1)*B)`` of it, so ranks see disjoint windows and their union
is exactly the global batch.

The position is stored as (epoch, global windows consumed in this epoch), independent of W, so a
run can resume with another number of ranks and continue at the same place in the data.

Document boundaries: with ``document_mask=True`` every batch also carries ``positions_BS``, each
token's position within its document, restarting at 0 on the token after an eos (and at the
window start). The model derives document ids from them (a new document wherever the position is
0), restarts RoPE there and keeps attention within each document, so a packed document is
computed as if it were alone. The eos token itself belongs to the document it ends.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from titan_tpu.data.shards import TokenShards

_STATE_VERSION = 1


def document_positions(tokens_BS: np.ndarray, eos_id: int) -> np.ndarray:
    """Each token's position within its document: 0 at the window start and right after every
    eos, counting up in between (int64, the shape of `tokens_BS`)."""
    B, S = tokens_BS.shape
    starts_BS = np.zeros((B, S), dtype=bool)
    starts_BS[:, 0] = True
    starts_BS[:, 1:] = tokens_BS[:, :-1] == eos_id
    index_S = np.arange(S)
    last_start_BS = np.maximum.accumulate(np.where(starts_BS, index_S, 0), axis=1)
    return (index_S - last_start_BS).astype(np.int64)


def _num_val_windows(num_windows: int, val_fraction: float) -> int:
    if val_fraction == 0:
        return 0
    return max(1, int(num_windows * val_fraction))


class TokenLoader:
    def __init__(
        self,
        shards: TokenShards,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        split: str = "train",
        val_fraction: float = 0.01,
        document_mask: bool = False,
    ):
        if seq_len <= 0 or batch_size <= 0:
            raise ValueError(
                f"seq_len and batch_size must be positive, got seq_len={seq_len}, batch_size={batch_size}"
            )
        if dp_world_size <= 0 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.shards = shards
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.split = split
        self.global_batch = batch_size * dp_world_size
        self.document_mask = document_mask

        # Windows that fit entirely in the stream (the +1 is the last window's final label).
        self.num_windows = (shards.num_tokens - 1) // seq_len
        self.num_val_windows = _num_val_windows(self.num_windows, val_fraction)
        self.num_train_windows = self.num_windows - self.num_val_windows
        if self.num_train_windows < self.global_batch:
            raise ValueError(
                f"corpus has {shards.num_tokens:,} tokens, too few for one training batch of "
                f"{batch_size} x {dp_world_size} ranks x {seq_len + 1} tokens plus the validation split; "
                f"it needs at least {self._tokens_needed(val_fraction):,} tokens: use a bigger corpus "
                f"(--data.source, --data.max_bytes) or a smaller seq_len / batch size"
            )
        if split == "val" and self.num_val_windows == 0:
            raise ValueError("split='val' needs a validation split; set val_fraction > 0")
        self.steps_per_epoch = self.num_train_windows // self.global_batch

        # Position (all of the loader's mutable state).
        self.seed = seed
        self.epoch = 0
        self.epoch_offset = 0  # global windows consumed in the current epoch
        self.samples_consumed = 0  # global windows consumed since the start, all epochs
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def _tokens_needed(self, val_fraction: float) -> int:
        # Smallest window count whose training part holds one global batch, in tokens.
        n = self.global_batch
        while n - _num_val_windows(n, val_fraction) < self.global_batch:
            n += 1
        return n * self.seq_len + 1

    # -- window selection -------------------------------------------------------------------

    def _permutation(self, epoch: int) -> np.ndarray:
        # numpy Generator seeded per epoch: reproducible from (seed, epoch) alone, no hidden RNG.
        if self._perm_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64(self.seed + epoch))
            self._perm = rng.permutation(self.num_train_windows)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def _windows_to_batch(self, window_ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        span = self.seq_len + 1
        rows_BS1 = np.stack([self.shards.read(int(w) * self.seq_len, span) for w in window_ids]).astype(np.int64)
        tokens_BS1 = torch.from_numpy(rows_BS1)
        batch = (tokens_BS1[:, :-1].contiguous(), tokens_BS1[:, 1:].contiguous())
        if self.document_mask:
            batch += (torch.from_numpy(document_positions(rows_BS1[:, :-1], self.shards.eos_id)),)
        return batch

    def _rank_slice(self, global_offset: int) -> np.ndarray:
        """Positions (within an ordering) of this rank's B windows of the global batch at offset."""
        start = global_offset + self.dp_rank * self.batch_size
        return np.arange(start, start + self.batch_size)

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        """This rank's next (inputs_BS, labels_BS), int64, labels the inputs shifted by one; with
        document_mask also positions_BS (int64)."""
        if self.split == "train":
            if self.epoch_offset + self.global_batch > self.num_train_windows:
                # Not enough windows left for a full global batch: drop them, start the next epoch.
                self.epoch += 1
                self.epoch_offset = 0
            window_ids = self._permutation(self.epoch)[self._rank_slice(self.epoch_offset)]
            self.epoch_offset += self.global_batch
        else:
            # Validation windows in fixed order, cycling; wrap within a batch so shapes stay fixed.
            positions = self._rank_slice(self.epoch_offset) % self.num_val_windows
            window_ids = self.num_train_windows + positions
            self.epoch_offset += self.global_batch
            self.epoch += self.epoch_offset // self.num_val_windows
            self.epoch_offset %= self.num_val_windows
        self.samples_consumed += self.global_batch
        return self._windows_to_batch(window_ids)

    def val_batches(self, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        """This rank's share of the validation windows, in fixed order, ``batch_size`` at a time.

        Every rank yields the same number of full batches (needed when the eval loss is
        all-reduced): ``num_val_windows // (B*W)`` of them, but at least one, which wraps around
        the validation windows when there are fewer than one global batch. Does not touch the
        training position.
        """
        if self.num_val_windows == 0:
            return
        num_batches = max(1, self.num_val_windows // self.global_batch)
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        for b in range(num_batches):
            positions = self._rank_slice(b * self.global_batch) % self.num_val_windows
            yield self._windows_to_batch(self.num_train_windows + positions)

    def metrics(self) -> dict[str, float]:
        """Per-source metrics for the log: none for one source (MixtureLoader reports shares)."""
        return {}

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain ints/strings. Position is in global windows, so it is valid for any dp world size."""
        return {
            "version": _STATE_VERSION,
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "epoch": self.epoch,
            "epoch_offset": self.epoch_offset,
            "samples_consumed": self.samples_consumed,
            # Identify the data: resuming over a different stream would not be exact.
            "num_train_windows": self.num_train_windows,
            "num_val_windows": self.num_val_windows,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Continue exactly where ``sd`` was taken (any dp world size; the saved seed wins)."""
        required = ("seq_len", "seed", "epoch", "epoch_offset", "samples_consumed")
        missing = [k for k in required if k not in sd]
        if missing:
            raise ValueError(f"data loader state lacks {', '.join(missing)}; it is not from a TokenLoader")
        if sd["seq_len"] != self.seq_len:
            raise ValueError(
                f"checkpointed data position is for seq_len {sd['seq_len']}, this run uses {self.seq_len}; "
                f"set --training.seq_len {sd['seq_len']} to resume"
            )
        if sd.get("split", self.split) != self.split:
            raise ValueError(
                f"data loader state is for split {sd['split']!r}, this loader reads {self.split!r}"
            )
        for key in ("num_train_windows", "num_val_windows"):
            if key in sd and sd[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed data position is for a corpus with {key}={sd[key]}, this one has "
                    f"{getattr(self, key)}; resume with the same --data.source, --data.max_bytes, "
                    f"tokenizer and val_fraction"
                )
        # The saved seed wins: the point of resuming is to continue the same data order.
        self.seed = int(sd["seed"])
        self.epoch = int(sd["epoch"])
        self.epoch_offset = int(sd["epoch_offset"])
        self.samples_consumed = int(sd["samples_consumed"])
        self._perm_epoch = None  # the permutation cache may belong to another seed
