"""Token shards: the corpus tokenized once, stored as flat binary arrays, read by memory map.

Layout of a shard directory::

    index.json          {"format", "version", "dtype", "vocab_size", "eos_id", "num_tokens",
                         "num_documents", "shards": [{"file", "num_tokens", "crc32"}, ...]}
    shard_00000.bin     raw little-endian uint16/uint32 token ids (np.memmap-able)
    ...

The stream is ``doc0 <eos> doc1 <eos> ...``: the loader packs it into fixed-length windows, so
document boundaries need no other bookkeeping. A directory is built under a temporary name and
renamed into place when complete, so an interrupted build never leaves something that opens.
Each shard's size and CRC-32 are checked when the cache is opened (a shard truncated or changed on
disk since it was written): ``prepare_dataset`` then rebuilds the cache, with a note. Indexes written
before the checksum existed have no "crc32" and are checked by size only.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from titan_tpu.data.corpus import corpus_fingerprint, iter_documents
from titan_tpu.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

INDEX_FILE = "index.json"
_FORMAT = "titan_tpu.token_shards"
_VERSION = 1
# Documents handed to the tokenizer per encode_batch call: large enough that the Rust thread pool
# keeps every core busy, small enough that the batch's token lists stay a few hundred MB at most.
_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_BYTES = 32 << 20

T = TypeVar("T")


def _token_dtype(vocab_size: int) -> np.dtype:
    # uint16 holds ids 0..65535, i.e. any vocab of at most 2**16 tokens; it halves disk and RAM.
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def chunks(values: Iterable[T], *, size: Callable[[T], int], max_items: int, max_size: int) -> Iterator[list[T]]:
    """Consecutive chunks of ``values``, each closed at ``max_items`` values or ``max_size`` in
    ``size`` units, whichever comes first: a deterministic function of the stream."""
    chunk: list[T] = []
    total = 0
    for value in values:
        chunk.append(value)
        total += size(value)
        if len(chunk) >= max_items or total >= max_size:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


def _doc_batches(documents: Iterable[str]) -> Iterator[list[str]]:
    # An empty document would only add a lone separator.
    return chunks((doc for doc in documents if doc), size=len, max_items=_ENCODE_BATCH_DOCS,
                  max_size=_ENCODE_BATCH_BYTES)


class _ShardWriter:
    """Accumulates token arrays and writes full shards of exactly ``shard_tokens`` tokens."""

    def __init__(self, out_dir: Path, *, shard_tokens: int):
        self.out_dir, self.shard_tokens = out_dir, shard_tokens
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        while self.pending_tokens >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> None:
        if self.pending_tokens:
            self._flush(self.pending_tokens)

    def _flush(self, n: int) -> None:
        joined = np.concatenate(self.pending)
        name = f"shard_{len(self.shards):05d}.bin"
        data = joined[:n].tobytes()
        (self.out_dir / name).write_bytes(data)
        self.shards.append({"file": name, "num_tokens": int(n), "crc32": zlib.crc32(data)})
        rest = joined[n:]
        self.pending = [rest] if len(rest) else []
        self.pending_tokens = len(rest)


def build_token_shards(
    documents: Iterable[str], tokenizer: Tokenizer, out_dir: str | Path, *, shard_tokens: int = 2**24
) -> TokenShards:
    """Tokenize ``documents`` (eos after each) into shard files under ``out_dir``; return them opened."""
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # pid in the name: ranks that build at the same time do not write into each other's files.
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    # Whatever is at out_dir now is stale or broken (the caller asked for a fresh build). Removed
    # up front, not at the end, so a concurrent identical build that lands first is kept below.
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    dtype = _token_dtype(tokenizer.vocab_size)
    writer = _ShardWriter(tmp_dir, shard_tokens=shard_tokens)
    num_docs = 0
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    try:
        for batch in _doc_batches(documents):
            for ids in tokenizer.encode_batch(batch):
                writer.add(np.asarray(ids, dtype=dtype))
                writer.add(eos)
            num_docs += len(batch)
        writer.close()
        if num_docs == 0:
            raise ValueError("no non-empty documents to tokenize; point --data.source at a corpus with text")
        index = {
            "format": _FORMAT,
            "version": _VERSION,
            "dtype": dtype.str,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "num_tokens": sum(s["num_tokens"] for s in writer.shards),
            "num_documents": num_docs,
            "shards": writer.shards,
        }
        # The index is written last: a directory without it is recognisably incomplete.
        (tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process renamed its identical build into place first: use theirs.
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return TokenShards.open(out_dir)


class TokenShards:
    """Read side: one global token stream over all shard files."""

    # Shards mapped at once, at most. A map per shard for the life of the reader would meet the
    # kernel's limit on one process's maps (vm.max_map_count, 65,530 by default) near 65,000
    # shards, i.e. some 250 GB of text at prepare-data's chunk size; the loader reads each rank's
    # stream forward, so a few recent maps serve nearly every read.
    MAX_OPEN_MAPS = 64

    def __init__(self, directory: Path, index: dict):
        self.directory = directory
        self.dtype = np.dtype(index["dtype"])
        self.vocab_size: int = index["vocab_size"]
        self.eos_id: int = index["eos_id"]
        self.num_tokens: int = index["num_tokens"]
        self.num_documents: int = index["num_documents"]
        self._files = [directory / shard["file"] for shard in index["shards"]]
        self._lengths = [shard["num_tokens"] for shard in index["shards"]]
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()  # shard index -> map, oldest first
        # _starts[i] = global position of shard i's first token, for bisecting a position to a shard.
        self._starts = np.cumsum([0] + self._lengths)[:-1].tolist()

    def _shard(self, i: int) -> np.memmap:
        """Shard ``i`` as an array, mapped on first use; the least recently used map is dropped."""
        if i in self._maps:
            self._maps.move_to_end(i)
            return self._maps[i]
        if len(self._maps) >= self.MAX_OPEN_MAPS:
            self._maps.popitem(last=False)
        self._maps[i] = np.memmap(self._files[i], dtype=self.dtype, mode="r", shape=(self._lengths[i],))
        return self._maps[i]

    @classmethod
    def open(cls, directory: str | Path) -> TokenShards:
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(
                f"token shard directory {str(directory)!r} does not exist; build it with prepare_dataset"
            )
        index_path = directory / INDEX_FILE
        rebuild = f"delete {str(directory)!r} so it is rebuilt"

        def bad(why: str) -> ValueError:
            return ValueError(f"token shards in {str(directory)!r} are unusable: {why}; {rebuild}")

        if not index_path.is_file():
            raise bad(f"{INDEX_FILE} is missing (an interrupted build?)")
        try:
            index = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"{INDEX_FILE} is not valid JSON ({e})") from None
        required = (
            "format", "version", "dtype", "vocab_size", "eos_id", "num_tokens", "num_documents", "shards"
        )
        if not isinstance(index, dict) or any(k not in index for k in required):
            raise bad(f"{INDEX_FILE} lacks some of the fields {', '.join(required)}")
        if index["format"] != _FORMAT or index["version"] != _VERSION:
            raise bad(f"format {index['format']!r} v{index['version']} is not {_FORMAT!r} v{_VERSION}")
        dtype = np.dtype(index["dtype"])
        for shard in index["shards"]:
            path = directory / shard["file"]
            expected = shard["num_tokens"] * dtype.itemsize
            actual = path.stat().st_size if path.is_file() else None
            if actual != expected:
                raise bad(f"{shard['file']} has {actual} bytes, the index says {expected}")
            if "crc32" in shard and _file_crc32(path) != shard["crc32"]:
                raise bad(f"{shard['file']} does not match the checksum written with it (changed on disk)")
        total = sum(shard["num_tokens"] for shard in index["shards"])
        if total != index["num_tokens"] or total == 0:
            raise bad(f"shards hold {total} tokens, the index says {index['num_tokens']}")
        return cls(directory, index)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the global stream, as a fresh array (may span shards)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"token range [{start}, {start + length}) outside [0, {self.num_tokens})")
        shard = bisect.bisect_right(self._starts, start) - 1
        offset = start - self._starts[shard]
        first = self._shard(shard)[offset : offset + length]
        if len(first) == length:
            return np.array(first)  # copy: callers must not hold views into the memmap
        parts = [first]
        got = len(first)
        while got < length:
            shard += 1
            part = self._shard(shard)[: length - got]
            parts.append(part)
            got += len(part)
        return np.concatenate(parts)

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.directory)!r}, tokens={self.num_tokens}, docs={self.num_documents}, "
            f"shards={len(self._files)}, dtype={self.dtype.name}, vocab={self.vocab_size})"
        )


def _file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    h.update(path.read_bytes())
    return h.hexdigest()


def prepare_dataset(
    *,
    source: str | None,
    text_field: str = "text",
    max_bytes: int | None,
    tokenizer_path: str | None,
    vocab_size: int,
    cache_dir: str | Path,
) -> tuple[Tokenizer, TokenShards]:
    """Corpus -> (tokenizer, token shards), cached under ``cache_dir``.

    ``vocab_size`` is the model's vocab. Without ``tokenizer_path`` a byte-level BPE of exactly
    that size is trained on the corpus; with one, that tokenizer must fit in it. Both the trained
    tokenizer and the shards are cached by content keys, so a second call with the same inputs
    only opens files.
    """
    cache_dir = Path(cache_dir).expanduser()
    fingerprint = corpus_fingerprint(source, text_field=text_field, max_bytes=max_bytes)
    label = source or "stdlib"

    def documents() -> Iterator[str]:
        return iter_documents(source, text_field=text_field, max_bytes=max_bytes)

    if tokenizer_path is None:
        tok_file = cache_dir / "tokenizers" / f"bpe-{fingerprint[:16]}-v{vocab_size}" / "tokenizer.json"
        tokenizer = None
        if tok_file.is_file():
            try:
                tokenizer = load_tokenizer(tok_file)
            except ValueError as e:  # the cache's own file, damaged on disk: train it again
                print(f"data: retraining the damaged cached tokenizer ({e})", flush=True)
        if tokenizer is None:
            t0 = time.perf_counter()
            tokenizer = train_bpe_tokenizer(documents(), vocab_size=vocab_size, save_path=tok_file)
            seconds = time.perf_counter() - t0
            print(f"data: trained BPE (vocab {vocab_size}) on {label} in {seconds:.1f}s -> {tok_file}", flush=True)
    else:
        tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_path!r} has {tokenizer.vocab_size} tokens but the model vocab is "
                f"{vocab_size}; raise --model.vocab_size to at least {tokenizer.vocab_size} or pick a "
                f"model flavor made for this tokenizer"
            )
    assert tokenizer.path is not None
    tok_hash = _file_sha256(tokenizer.path)
    key = hashlib.sha256(f"{fingerprint}|{tok_hash}".encode()).hexdigest()[:16]
    shard_dir = cache_dir / "tokens" / key
    if (shard_dir / INDEX_FILE).is_file():
        try:
            shards = TokenShards.open(shard_dir)
        except ValueError as e:
            print(f"data: rebuilding broken token cache ({e})", flush=True)
        else:
            print(f"data: cached {shards.num_tokens:,} tokens of {label} from {shard_dir}", flush=True)
            return tokenizer, shards
    t0 = time.perf_counter()
    shards = build_token_shards(documents(), tokenizer, shard_dir)
    print(
        f"data: tokenized {shards.num_documents:,} documents of {label} -> {shards.num_tokens:,} tokens "
        f"in {time.perf_counter() - t0:.1f}s -> {shard_dir}",
        flush=True,
    )
    return tokenizer, shards
