"""Sources -> token shards, in parallel, resumable, never half-read (``titan-tpu prepare-data``).

The documents of a source are cut into chunks of consecutive documents (a deterministic function
of the stream: ``_CHUNK_DOCS`` documents or ``_CHUNK_BYTES`` of text, whichever comes first).
Worker processes tokenize chunks and each writes its chunk's files into ``.<key>.partial/``
under a temporary name, renamed into place when whole, then a small ``chunk_i.json`` last: a
chunk is done exactly when its json exists. An interrupted build (Ctrl-C, kill -9) leaves the
done chunks; the next build reads the documents again but tokenizes only the missing chunks.
When all are done, ``index.json`` is written and the directory renamed to ``<key>/``: readers
only ever open a directory that has an index, which exists only once every chunk is complete.

The chunk files are the shards: a text source gives the ``TokenShards`` layout of shards.py
(one ``.bin`` of token ids per chunk), a chat source adds a flag per token (``.mask``, 1 where
the loss trains) and each conversation's length (``.len``), read by ``ChatShards``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from titan_tpu.data.shards import INDEX_FILE, TokenShards, _token_dtype, chunks
from titan_tpu.data.tokenizer import Tokenizer, load_tokenizer

# A chunk is one worker task and one shard file. Small enough that the workers finish together
# (the last chunk handed out is the one the others wait for: with 4 MB chunks, 11 MB of text made
# 3 chunks for 2 workers and prepare-data ran at 0.79x encode_batch), large enough that the
# per-chunk work (a task's pickling, four small files) stays below 1%.
_CHUNK_DOCS = 2048
_CHUNK_BYTES = 1 << 20
# Recorded in every finished chunk: a partial build resumes only the chunks cut the same way.
_CHUNKING = f"{_CHUNK_DOCS} docs or {_CHUNK_BYTES} bytes"
_CHAT_FORMAT = "titan_tpu.chat_shards"


def chunk_documents(values: Iterator[Any], *, size: Callable[[Any], int]) -> Iterator[list[Any]]:
    """Consecutive chunks of ``values``: a deterministic function of the stream."""
    return chunks(values, size=size, max_items=_CHUNK_DOCS, max_size=_CHUNK_BYTES)


# -- one chunk, in a worker or in this process ---------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, chat: tuple[str, dict] | None, single_thread: bool) -> None:
    if single_thread:  # N processes x 1 thread each, not N x N
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = load_tokenizer(tokenizer_path)
    _WORKER["tokenizer"] = tokenizer
    if chat is not None:
        from titan_tpu.data.chat import ChatRenderer

        _WORKER["chat"] = ChatRenderer(chat[0], tokenizer, special_tokens=chat[1])


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def _encode_chunk(task: tuple[int, list[Any], str, int]) -> dict:
    """Tokenize chunk ``index`` and write its files into ``directory``; returns its json record."""
    index, docs, directory, first_doc = task
    tokenizer: Tokenizer = _WORKER["tokenizer"]
    out = Path(directory)
    dtype = _token_dtype(tokenizer.vocab_size)
    name = f"chunk_{index:06d}"
    record: dict[str, Any] = {"file": f"{name}.bin", "num_documents": len(docs), "chunking": _CHUNKING}
    renderer = _WORKER.get("chat")
    if renderer is None:
        eos = np.array([tokenizer.eos_id], dtype=dtype)
        parts = []
        for ids in tokenizer.encode_batch(docs):
            parts += [np.asarray(ids, dtype=dtype), eos]
        tokens = np.concatenate(parts)
        record["bytes"] = sum(len(d.encode("utf-8")) for d in docs)
    else:
        # Rows counted from 1, as a file's lines and a table's rows are read (a JSONL row is its line).
        encoded = [renderer.encode(m, where=f"row {first_doc + i + 1}") for i, m in enumerate(docs)]
        tokens = np.concatenate([ids for ids, _ in encoded]).astype(dtype)
        lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
        _write_atomic(out / f"{name}.mask", np.concatenate([m for _, m in encoded]).tofile)
        _write_atomic(out / f"{name}.len", lengths.tofile)
        record.update(mask=f"{name}.mask", lengths=f"{name}.len", num_trained=int(sum(m.sum() for _, m in encoded)))
        record["bytes"] = sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8")) for m in docs)
    data = tokens.tobytes()
    _write_atomic(out / record["file"], lambda p: p.write_bytes(data))
    record["num_tokens"] = int(len(tokens))
    record["crc32"] = zlib.crc32(data)  # checked by TokenShards.open where it knows the field
    _write_atomic(out / f"{name}.json", lambda p: p.write_text(json.dumps(record)))  # last: the chunk is done
    return record


# -- the build ------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, label: str, total_bytes: int | None, log: Callable[[str], None]):
        self.label, self.total, self.log = label, total_bytes, log
        self.t0 = self.last = time.perf_counter()
        self.done_bytes = 0

    def update(self, nbytes: int, *, final: bool = False) -> None:
        self.done_bytes += nbytes
        now = time.perf_counter()
        if not final and now - self.last < 2.0:
            return
        self.last = now
        rate = self.done_bytes / max(now - self.t0, 1e-9) / 1e6
        eta = ""
        if self.total and not final and rate > 0:
            left = max(self.total - self.done_bytes, 0) / 1e6 / rate
            eta = f", ETA ~{left:.0f} s"
        self.log(f"prepare: {self.label}: {self.done_bytes / 1e6:,.1f} MB, {rate:.2f} MB/s{eta}")


def build_shards(values: Iterator[Any], tokenizer: Tokenizer, out_dir: str | Path, *, workers: int = 1,
                 chat: tuple[str, dict] | None = None, label: str = "", total_bytes: int | None = None,
                 log: Callable[[str], None] = print) -> Path:
    """Tokenize ``values`` (texts, or conversations with ``chat`` = (template, special tokens)) into
    ``out_dir``, resuming a partial build; returns ``out_dir``. ``workers`` > 1 uses that many
    processes of one tokenizer thread each; 1 tokenizes here with the tokenizer's own threads."""
    assert tokenizer.path is not None, "build_shards needs a tokenizer saved to a file (workers load it)"
    out_dir = Path(out_dir)
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    partial.mkdir(parents=True, exist_ok=True)
    size = (lambda d: len(d)) if chat is None else (lambda m: sum(len(str(x.get("content", ""))) for x in m)
                                                    if isinstance(m, list) else 0)
    texts = values if chat is not None else (v for v in values if v)
    progress = _Progress(label, total_bytes, log)
    records: dict[int, dict] = {}
    tasks = _tasks(chunk_documents(texts, size=size), partial, records)
    try:
        if workers <= 1:
            _init_worker(str(tokenizer.path), chat, single_thread=False)
            for task in tasks:
                records[task[0]] = _encode_chunk(task)
                progress.update(records[task[0]]["bytes"])
        else:
            _run_pool(tasks, workers, tokenizer, chat, records, progress)
    except ValueError:
        shutil.rmtree(partial, ignore_errors=True)  # bad input: nothing of it stays in the cache
        raise
    finally:
        _WORKER.clear()
    progress.update(0, final=True)
    if not records or sum(r["num_documents"] for r in records.values()) == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise ValueError(f"data source {label} is empty: it yielded no row; point its path at data with rows")
    _finish(partial, out_dir, [records[i] for i in range(len(records))], tokenizer, chat=chat is not None)
    return out_dir


def _tasks(chunks: Iterator[list[Any]], partial: Path, records: dict[int, dict]) -> Iterator[tuple]:
    """(index, chunk, directory, first row) for the chunks not yet done; done ones go to records.
    A chunk cut another way (by an older version) is done again: its rows are not this chunk's."""
    first = 0
    for index, chunk in enumerate(chunks):
        done = partial / f"chunk_{index:06d}.json"
        record = json.loads(done.read_text()) if done.is_file() else None
        if record is not None and record.get("chunking") == _CHUNKING:
            records[index] = record
        else:
            yield index, chunk, str(partial), first
        first += len(chunk)


def _run_pool(tasks: Iterator[tuple], workers: int, tokenizer: Tokenizer, chat, records: dict, progress) -> None:
    # spawn, not fork: the parent may hold torch and tokenizer threads. At most 2 chunks in flight
    # per worker, so a large source is never read into memory ahead of the tokenizers.
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer.path), chat, True)) as pool:
        pending: list[Any] = []
        for task in tasks:
            pending.append(pool.apply_async(_encode_chunk, (task,)))
            while len(pending) >= 2 * workers or (pending and pending[0].ready()):
                record = pending.pop(0).get()
                records[int(record["file"][6:12])] = record
                progress.update(record["bytes"])
        for result in pending:
            record = result.get()
            records[int(record["file"][6:12])] = record
            progress.update(record["bytes"])


def _finish(partial: Path, out_dir: Path, chunks: list[dict], tokenizer: Tokenizer, *, chat: bool) -> None:
    dtype = _token_dtype(tokenizer.vocab_size)
    shards = [{"file": c["file"], "num_tokens": c["num_tokens"], "crc32": c["crc32"]} for c in chunks]
    index: dict[str, Any] = {"format": "titan_tpu.token_shards", "version": 1, "dtype": dtype.str,
                             "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                             "num_tokens": sum(c["num_tokens"] for c in chunks),
                             "num_documents": sum(c["num_documents"] for c in chunks), "shards": shards}
    if chat:
        index["chat"] = {"format": _CHAT_FORMAT, "masks": [c["mask"] for c in chunks],
                         "lengths": [c["lengths"] for c in chunks],
                         "num_trained": sum(c["num_trained"] for c in chunks)}
    # The index is written last and the directory renamed whole: a reader sees all or nothing.
    _write_atomic(partial / INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=1)))
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.rename(partial, out_dir)
    except OSError:  # another process finished the same build first: theirs is identical
        shutil.rmtree(partial, ignore_errors=True)


class ChatShards:
    """Read side of a chat source: tokens (a ``TokenShards``), a trained flag per token and each
    conversation's start offset in the token stream."""

    def __init__(self, directory: str | Path):
        self.tokens = TokenShards.open(directory)
        index = json.loads((Path(directory) / INDEX_FILE).read_text())
        if "chat" not in index:
            raise ValueError(f"{str(directory)!r} holds text token shards, not chat; delete it so it is rebuilt")
        chat = index["chat"]
        self.mask = np.concatenate([np.fromfile(Path(directory) / m, dtype=np.uint8) for m in chat["masks"]])
        lengths = np.concatenate([np.fromfile(Path(directory) / f, dtype=np.int64) for f in chat["lengths"]])
        if len(self.mask) != self.tokens.num_tokens or lengths.sum() != self.tokens.num_tokens:
            raise ValueError(f"chat shards in {str(directory)!r} are inconsistent; delete it so it is rebuilt")
        self.lengths = lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.num_trained: int = chat["num_trained"]

    @property
    def num_conversations(self) -> int:
        return len(self.lengths)


@dataclass
class PreparedSource:
    """One source ready for the loader: its spec and its shards (text) or chat shards."""

    spec: Any  # SourceConfig
    shards: TokenShards | None = None
    chat: ChatShards | None = None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _log(message: str) -> None:
    print(message, file=sys.stdout, flush=True)


def prepare_sources(specs: list[Any], *, max_bytes: int | None, tokenizer_path: str | None, vocab_size: int,
                    cache_dir: str | Path, workers: int = 1, chat_template_choice: str = "",
                    log: Callable[[str], None] = _log,
                    tokenize_limit_mb: float = 0.0) -> tuple[Tokenizer, list[PreparedSource]]:
    """Sources -> (tokenizer, prepared sources), cached under ``cache_dir`` by content keys.

    ``vocab_size`` is the model's. Without ``tokenizer_path`` a byte-level BPE of that size is
    trained on the text sources (a single source keeps the cache key ``prepare_dataset`` uses);
    chat sources need ``tokenizer_path`` (an HF model directory with a chat template).
    ``tokenize_limit_mb`` > 0 (a training run's data.tokenize_limit_mb): a source that is not in the
    cache and holds more than this many MB on disk, or a BPE to train on such sources, is refused in
    one line naming ``titan-tpu prepare-data`` (which passes 0: no limit).
    """
    from titan_tpu.data.corpus import corpus_fingerprint, iter_documents
    from titan_tpu.data.sources import check_source, normalized_weights
    from titan_tpu.data.tokenizer import train_bpe_tokenizer

    for i, spec in enumerate(specs):
        check_source(spec, key=f"data.sources[{i}]")
    normalized_weights(specs)
    cache_dir = Path(cache_dir).expanduser()
    chat_specs = [s for s in specs if s.format == "chat"]
    if chat_specs and not tokenizer_path:
        raise ValueError(f"data source {chat_specs[0].label!r} has format = chat, which needs the chat template of "
                         f"an HF model directory: set data.tokenizer_path to it (model.name = hf uses its hf_config)")

    def source_arg(spec) -> str | None:
        return None if spec.path == "stdlib" else spec.path

    def texts(spec) -> Iterator[str]:
        return iter_documents(source_arg(spec), text_field=spec.field, max_bytes=max_bytes)

    text_prints = {id(s): corpus_fingerprint(source_arg(s), text_field=s.field, max_bytes=max_bytes)
                   for s in specs if s.format == "text"}
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"tokenizer {tokenizer_path!r} has {tokenizer.vocab_size} tokens but the model vocab is "
                             f"{vocab_size}; raise --model.vocab_size to at least {tokenizer.vocab_size} or pick a "
                             f"model made for this tokenizer")
    else:
        prints = list(text_prints.values())
        key = prints[0] if len(prints) == 1 else _sha("|".join(prints))
        tok_file = cache_dir / "tokenizers" / f"bpe-{key[:16]}-v{vocab_size}" / "tokenizer.json"
        with _build_lock(tok_file.parent):  # one process per cache trains it; the others then load it
            if tok_file.is_file():
                tokenizer = load_tokenizer(tok_file)
            else:
                _check_run_may_tokenize([s for s in specs if s.format == "text"], max_bytes=max_bytes,
                                        limit_mb=tokenize_limit_mb, doing="training a BPE tokenizer on")
                t0 = time.perf_counter()
                docs = (d for s in specs for d in texts(s))
                tokenizer = train_bpe_tokenizer(docs, vocab_size=vocab_size, save_path=tok_file)
                log(f"data: trained BPE (vocab {vocab_size}) in {time.perf_counter() - t0:.1f}s -> {tok_file}")
    assert tokenizer.path is not None
    tok_hash = _file_sha256(tokenizer.path)
    chat_template = None
    if chat_specs:
        from titan_tpu.data.chat import CHATML, CHATML_TOKENS, load_chat_template

        chat_template = load_chat_template(tokenizer_path, chat_template_choice)
        if chat_template[0] == CHATML and any(tokenizer.token_id(t) is None for t in CHATML_TOKENS):
            raise ValueError(f"data.chat_template = chatml needs the tokens {' and '.join(CHATML_TOKENS)}, which the "
                             f"tokenizer {tokenizer.path} lacks; use the model's own template or a .jinja file")
    prepared = []
    for spec in specs:
        if spec.format == "text":
            key = _sha(f"{text_prints[id(spec)]}|{tok_hash}")[:16]
            directory = cache_dir / "tokens" / key

            def values(spec=spec) -> Iterator[Any]:  # read only when the cache misses
                return texts(spec)
        else:
            from titan_tpu.data.sources import files_fingerprint, iter_records, resolve_files

            files = resolve_files(spec.path)
            key = _sha(f"chat-v1|{'|'.join(files_fingerprint(files))}|{spec.field}|{max_bytes}|{tok_hash}|"
                       f"{json.dumps(chat_template)}")[:16]
            directory = cache_dir / "chat" / key

            def values(files=files, spec=spec) -> Iterator[Any]:
                return _limit_rows(iter_records(files, field=spec.field), max_bytes)
        with _build_lock(directory):  # one build per cache entry at a time; the others then open it
            opened = _open(spec, directory, log)
            if opened is None:
                _check_run_may_tokenize([spec], max_bytes=max_bytes, limit_mb=tokenize_limit_mb, doing="tokenizing")
                t0 = time.perf_counter()
                try:
                    build_shards(values(), tokenizer, directory, workers=workers,
                                 chat=chat_template if spec.format == "chat" else None, label=spec.label,
                                 total_bytes=max_bytes or _source_bytes(spec.path), log=log)
                except ValueError as e:
                    if spec.path in str(e):
                        raise
                    raise ValueError(f"data source {spec.path}: {e}") from None  # a row's mistake names its file
                log(f"data: tokenized {spec.label} in {time.perf_counter() - t0:.1f}s -> {directory}")
                opened = _open(spec, directory, log)
                assert opened is not None
        prepared.append(opened)
    return tokenizer, prepared


def _open(spec: Any, directory: Path, log: Callable[[str], None]) -> PreparedSource | None:
    """The built source at ``directory``; None when there is none or it is broken (then removed)."""
    if not (directory / INDEX_FILE).is_file():
        return None
    try:
        if spec.format == "text":
            shards = TokenShards.open(directory)
            log(f"data: {spec.label}: {shards.num_tokens:,} tokens in {shards.num_documents:,} documents")
            return PreparedSource(spec, shards=shards)
        chat = ChatShards(directory)
    except ValueError as e:
        log(f"data: rebuilding a broken token cache ({e})")
        shutil.rmtree(directory, ignore_errors=True)
        return None
    log(f"data: {spec.label}: {chat.num_conversations:,} conversations, {chat.tokens.num_tokens:,} tokens, "
        f"{chat.num_trained:,} trained")
    return PreparedSource(spec, chat=chat)


def _check_run_may_tokenize(specs: list[Any], *, max_bytes: int | None, limit_mb: float, doing: str) -> None:
    """Refuse (one line naming prepare-data) to tokenize in a training run more than ``limit_mb`` MB of
    source on disk (capped by data.max_bytes): a run tokenizes in one process while the other ranks
    wait, at a few MB/s; prepare-data tokenizes ahead in one process per core. 0: no limit. A source
    whose size is not known on disk (the built-in stdlib corpus) is not counted."""
    if not limit_mb:
        return
    sizes = {s.label: _source_bytes(s.path) for s in specs if s.path != "stdlib"}
    sizes = {label: min(b, max_bytes) if max_bytes else b for label, b in sizes.items() if b}
    total = sum(sizes.values())
    if total <= limit_mb * 1e6:
        return
    names = ", ".join(repr(label) for label in sizes)
    raise ValueError(f"data: {doing} {names} ({total / 1e6:,.1f} MB on disk) is more than a run does itself "
                     f"(data.tokenize_limit_mb = {limit_mb:g}): tokenize it ahead with `titan-tpu prepare-data` and "
                     "the run's --config and data overrides (--workers N: N processes; on every host, or with a "
                     "data.cache_dir all hosts share), or raise data.tokenize_limit_mb (0: no limit)")


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    import fcntl

    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(f".{directory.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _limit_rows(values: Iterator[Any], max_bytes: int | None) -> Iterator[Any]:
    """Conversations until about ``max_bytes`` of their JSON (whole rows: a conversation is not cut)."""
    produced = 0
    for value in values:
        if max_bytes is not None and produced >= max_bytes:
            return
        produced += len(json.dumps(value, ensure_ascii=False)) if max_bytes is not None else 0
        yield value


def _source_bytes(path: str) -> int | None:
    """On-disk size of a file-based source (an ETA estimate; compressed files read as more text)."""
    from titan_tpu.data.sources import resolve_files

    try:
        return sum(p.stat().st_size for p in resolve_files(path))
    except (ValueError, OSError):
        return None
