"""Preference pairs for DPO: rows of prompt / chosen / rejected, tokenized into padded pairs.

Columns as TRL and Hugging Face preference datasets name them: ``prompt``, ``chosen``,
``rejected``, in jsonl(.gz/.zst), parquet or arrow files (any path data/sources.py reads). A row is

* plain text: three strings; the completions are the text after the prompt, and each ends in the
  EOS token (TRL appends it to both completions): the eos_token of the tokenizer's
  tokenizer_config.json where there is one, else the tokenizer's end-of-text;
* chat messages: ``prompt`` a list of ``{role, content}`` messages (the user's turns), ``chosen``
  and ``rejected`` lists holding the assistant's reply; rendered with the tokenizer's chat
  template, the prompt with the generation prompt, each completion as the text that the whole
  conversation adds to it.

As TRL does, a completion starts where the tokenized prompt and the tokenized prompt + completion
part (the merge of tokens across the boundary stays in the prompt), and a pair longer than
``seq_len + 1`` tokens keeps its start (the completion is cut). Each side becomes one row of
``seq_len + 1`` tokens, right-padded with the end-of-text token: inputs its first ``seq_len``
tokens, labels its last ``seq_len``, IGNORE_INDEX wherever the target is a prompt token or
padding, so the loss sums exactly the completion's log-probabilities.

Mistakes are one line naming the file, the row and the column: a row without one of the three
columns, a chosen completion identical to the rejected one (nothing to prefer), a prompt longer
than seq_len (no completion token would be trained).

`PreferenceLoader` serves `PreferenceBatch`es: the last ``val_fraction`` of rows held out, the
others visited in a seeded permutation per epoch, each data-parallel rank its own rows of the
global batch, the position (epoch, pairs consumed) in its state dict as TokenLoader's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from titan_tpu.data.batch import IGNORE_INDEX, PreferenceBatch, TokenBatch
from titan_tpu.data.sources import json_line_problem, resolve_files

__all__ = ["COLUMNS", "PreferenceLoader", "PreferencePairs", "load_preference_pairs", "read_preference_rows",
           "read_rows"]

COLUMNS = ("prompt", "chosen", "rejected")
_STATE_VERSION = 1


def read_preference_rows(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of the source's files, in order; `where` names the file and row.
    A row lacking a column is a one-line ValueError naming the file, the row and the column."""
    return read_rows(source, columns=COLUMNS, what="preference data")


def read_rows(source: str, *, columns: tuple[str, ...], what: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of the jsonl / parquet / arrow files of `source`, each holding
    `columns` (a one-line error naming the file, the row and the column otherwise); `what` names
    the data in errors (GRPO's prompts read their rows here too)."""
    for path in resolve_files(source):
        if path.name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
            rows = _jsonl_rows(path, what)
        else:
            rows = _table_rows(path)
        for index, row in enumerate(rows, start=1):
            where = f"{path} row {index}"
            missing = [c for c in columns if c not in row or row[c] is None]
            if missing:
                raise ValueError(f"{what} {where} has no column {missing[0]!r} (columns present: "
                                 f"{', '.join(k for k, v in row.items() if v is not None) or 'none'}); every row "
                                 f"needs {', '.join(columns)}")
            yield where, row


def _jsonl_rows(path: Path, what: str) -> Iterator[dict[str, Any]]:
    for line, record in enumerate(_iter_jsonl_records(path, what), start=1):
        if not isinstance(record, dict):
            raise ValueError(f"{what} {path} row {line} is not a JSON object; write one object per line")
        yield record


def _iter_jsonl_records(path: Path, what: str) -> Iterator[Any]:
    """Whole records of a jsonl file (data/sources.py reads one field; here every column)."""
    import gzip
    import io

    if path.name.endswith(".gz"):
        f: io.TextIOBase = gzip.open(path, "rt", encoding="utf-8")
    elif path.name.endswith(".zst"):
        import pyarrow as pa

        f = io.TextIOWrapper(pa.input_stream(str(path), compression="zstd"), encoding="utf-8")
    else:
        f = path.open("r", encoding="utf-8")
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what} {path} line {lineno} is not valid JSON ({json_line_problem(e)}); fix or "
                                 "remove that line") from None


def _table_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        table = pq.read_table(path)
    else:
        import pyarrow as pa

        from titan_tpu.data.sources import _arrow_batches

        _, batches = _arrow_batches(path)
        table = pa.Table.from_batches(list(batches))
    yield from table.to_pylist()


@dataclass
class PreferencePairs:
    """Tokenized pairs: chosen and rejected rows of seq_len + 1 tokens (right-padded), and how
    many leading tokens of each row are the prompt."""

    chosen_NT: np.ndarray  # int64 [pairs, seq_len + 1]
    rejected_NT: np.ndarray
    chosen_len_N: np.ndarray  # tokens of each row before padding
    rejected_len_N: np.ndarray
    prompt_len_N: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_len_N)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Encoder:
    """Turns one row into (prompt ids, chosen ids, rejected ids), plain or chat."""

    def __init__(self, tokenizer, chat_template: tuple[str, dict[str, str]] | None):
        self.tokenizer = tokenizer
        # The end of a completion: the tokenizer configuration's eos_token where it names one (what
        # TRL appends), else the tokenizer's end-of-text.
        eos = (chat_template or ("", {}))[1].get("eos_token")
        eos_id = tokenizer._tok.token_to_id(eos) if eos else None
        self.eos_id = tokenizer.eos_id if eos_id is None else eos_id
        self.chat = None
        if chat_template is not None:
            from titan_tpu.data.chat import ChatRenderer

            self.chat = ChatRenderer(chat_template[0], tokenizer, special_tokens=chat_template[1])

    def texts(self, row: dict[str, Any], where: str) -> tuple[str, str, str, bool]:
        """(prompt text, prompt + chosen text, prompt + rejected text, whether EOS is appended)."""
        prompt, chosen, rejected = (row[c] for c in COLUMNS)
        if all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            return prompt, prompt + chosen, prompt + rejected, True
        if all(isinstance(v, list) for v in (prompt, chosen, rejected)):
            if self.chat is None:
                raise ValueError(f"preference data {where} holds chat messages and the tokenizer has no chat template; "
                                 "set data.tokenizer_path to an HF model directory of a chat model")
            from titan_tpu.data.chat import check_messages

            for column in ("chosen", "rejected"):
                check_messages(prompt + row[column], where=f"{where} ({column})")
            return (self._render(prompt, add_generation_prompt=True), self._render(prompt + chosen),
                    self._render(prompt + rejected), False)
        raise ValueError(f"preference data {where}: prompt, chosen and rejected must all be strings or all be lists "
                         "of {role, content} messages")

    def _render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as the template renders it (its {% generation %} marks dropped: here the
        completion is what follows the prompt, as TRL takes it)."""
        from titan_tpu.data.chat import _CLOSE, _OPEN

        text = self.chat._render(messages, add_generation_prompt=add_generation_prompt)
        return text.replace(_OPEN, "").replace(_CLOSE, "")

    def encode(self, row: dict[str, Any], where: str) -> tuple[list[int], list[int], list[int]]:
        if row["chosen"] == row["rejected"]:
            raise ValueError(f"preference data {where}: chosen and rejected are identical, so there is nothing to "
                             "prefer; remove the row")
        prompt, with_chosen, with_rejected, eos = self.texts(row, where)
        # A rendered chat's markers (<|im_start|>) are special tokens, as transformers reads them;
        # plain rows are data (a special token's text in them is ordinary bytes) and end in EOS.
        enc = self.tokenizer.encode if eos else (lambda text: self.tokenizer.encode_with_offsets(text)[0])
        p, c, r = enc(prompt), enc(with_chosen), enc(with_rejected)
        if eos:
            c, r = c + [self.eos_id], r + [self.eos_id]
        n = min(_common_prefix(p, c), _common_prefix(p, r))
        return p[:n], c[n:], r[n:]


def load_preference_pairs(source: str, *, tokenizer, seq_len: int,
                          chat_template: tuple[str, dict[str, str]] | None = None) -> PreferencePairs:
    """Every row of `source` tokenized into padded pairs (see the module docstring)."""
    width = seq_len + 1
    pad = tokenizer.eos_id
    encoder = _Encoder(tokenizer, chat_template)
    chosen, rejected, lengths = [], [], []
    for where, row in read_preference_rows(source):
        prompt, good, bad = encoder.encode(row, where)
        if len(prompt) > seq_len:
            raise ValueError(f"preference data {where}: the prompt is {len(prompt)} tokens, longer than "
                             f"training.seq_len = {seq_len}, so no completion token would be trained; raise "
                             "training.seq_len or shorten the prompt")
        rows = []
        for completion in (good, bad):
            ids = (prompt + completion)[:width]
            rows.append((np.asarray(ids + [pad] * (width - len(ids)), dtype=np.int64), len(ids)))
        chosen.append(rows[0])
        rejected.append(rows[1])
        lengths.append(len(prompt))
    if not lengths:
        raise ValueError(f"preference data {source} holds no rows; give a file with prompt, chosen and rejected rows")
    return PreferencePairs(chosen_NT=np.stack([c[0] for c in chosen]), rejected_NT=np.stack([r[0] for r in rejected]),
                           chosen_len_N=np.asarray([c[1] for c in chosen]),
                           rejected_len_N=np.asarray([r[1] for r in rejected]), prompt_len_N=np.asarray(lengths))


def side_batch(rows_NT: np.ndarray, lengths_N: np.ndarray, prompt_len_N: np.ndarray) -> TokenBatch:
    """One side of the pairs as a TokenBatch: inputs the first seq_len tokens, labels the next token
    of each position, IGNORE_INDEX where that token is the prompt's or padding."""
    tokens_NT = torch.from_numpy(rows_NT)
    target_T = torch.arange(1, rows_NT.shape[1])  # the position of each label's token in the row
    prompt_N1, length_N1 = torch.from_numpy(prompt_len_N)[:, None], torch.from_numpy(lengths_N)[:, None]
    trained_NS = (target_T >= prompt_N1) & (target_T < length_N1)
    labels_NS = torch.where(trained_NS, tokens_NT[:, 1:], IGNORE_INDEX)
    return TokenBatch(tokens_NT[:, :-1].contiguous(), labels_NS.contiguous())


def pair_batch(pairs: PreferencePairs, index_N: np.ndarray) -> PreferenceBatch:
    return PreferenceBatch(
        chosen=side_batch(pairs.chosen_NT[index_N], pairs.chosen_len_N[index_N], pairs.prompt_len_N[index_N]),
        rejected=side_batch(pairs.rejected_NT[index_N], pairs.rejected_len_N[index_N], pairs.prompt_len_N[index_N]))


class PreferenceLoader:
    """Batches of `batch_size` pairs per data-parallel rank (module docstring)."""

    def __init__(self, pairs: PreferencePairs, *, batch_size: int, seed: int, dp_rank: int = 0,
                 dp_world_size: int = 1, val_fraction: float = 0.0):
        self.pairs, self.batch_size, self.seed = pairs, batch_size, seed
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        global_batch = batch_size * dp_world_size
        # At least one global batch held out when validating, so every rank has a batch to score.
        self.num_val = max(global_batch, int(len(pairs) * val_fraction)) if val_fraction > 0 else 0
        self.num_train = len(pairs) - self.num_val
        if self.num_train < global_batch:
            raise ValueError(f"preference data has {self.num_train} training pairs, fewer than one global batch of "
                             f"{global_batch} (training.batch_size {batch_size} x {dp_world_size} data-parallel "
                             "ranks); use more pairs or a smaller training.batch_size")
        self.epoch, self.consumed = 0, 0

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_train)

    def next_batch(self) -> PreferenceBatch:
        global_batch = self.batch_size * self.dp_world_size
        if self.consumed + global_batch > self.num_train:  # the partial global batch at an epoch's end is skipped
            self.epoch, self.consumed = self.epoch + 1, 0
        start = self.consumed + self.dp_rank * self.batch_size
        index_N = self._permutation()[start:start + self.batch_size]
        self.consumed += global_batch
        return pair_batch(self.pairs, index_N)

    def val_batches(self, steps: int) -> Iterator[PreferenceBatch]:
        """Up to `steps` batches of the held-out pairs, this rank's rows of each global batch."""
        index_V = np.arange(self.num_train, len(self.pairs))
        global_batch = self.batch_size * self.dp_world_size
        for k in range(min(steps, len(index_V) // global_batch)):
            start = k * global_batch + self.dp_rank * self.batch_size
            yield pair_batch(self.pairs, index_V[start:start + self.batch_size])

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION, "kind": "preference", "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "preference":
            raise ValueError("the checkpoint's data position is not a preference loader's; resume it with the "
                             "training.objective it was written with")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
