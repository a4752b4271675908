"""Where training text comes from: a stream of documents (one string each).

Three kinds of source, chosen by ``--data.source``:

* ``None`` / ``"stdlib"``: the embedded default corpus, the ``.py`` files of the running
  interpreter's standard library. It is on every machine that can run this code, so a debug
  training run needs no download.
* a directory: every ``.txt`` / ``.md`` / ``.py`` file under it (recursively), one document per file.
* a ``.jsonl`` file: one JSON object per line, the document text under ``text_field``.
  (A single ``.txt`` / ``.md`` / ``.py`` file is also accepted, as one document.)
* parquet / jsonl.gz / jsonl.zst / arrow files, globs of them, ``datasets.save_to_disk``
  directories and directories holding such files: read by ``sources.py`` (pyarrow).

Order is always deterministic (sorted paths, file line order) so that the same source gives the
same token stream, and therefore the same batches, on every run and every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator

from titan_tpu.data import sources

STDLIB_SOURCE = "stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".py")

# Parts of the standard library that are not good "ordinary code" to learn from, or that differ
# from machine to machine: third-party packages, the huge test suites, GUI demos, build configs.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"}
)
# _sysconfigdata*.py holds the build's paths and flags: machine specific, so it would make the
# default corpus (and with it the batches) differ between machines.
_STDLIB_SKIP_FILE_PREFIXES = ("_sysconfigdata",)

# Bump when the document-producing rules change, so cached tokens keyed by the fingerprint are
# not reused for a different stream.
_FINGERPRINT_VERSION = "corpus-v1"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, *, suffixes: tuple[str, ...], stdlib: bool) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend: hidden dirs (.git, .venv) are never corpus.
        dirnames[:] = [
            d
            for d in dirnames
            if not d.startswith(".")
            and d != "__pycache__"
            and not (stdlib and (d in _STDLIB_SKIP_DIRS or d.startswith("config-")))
        ]
        for name in filenames:
            if name.startswith(".") or not name.endswith(suffixes):
                continue
            if stdlib and name.startswith(_STDLIB_SKIP_FILE_PREFIXES):
                continue
            found.append(Path(dirpath) / name)
    # Sort on the relative POSIX path: independent of os.walk order and of where root lives.
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return found


def _source_files(kind: str, root: Path) -> list[Path]:
    if kind == "stdlib":
        return _list_files(root, suffixes=(".py",), stdlib=True)
    return _list_files(root, suffixes=TEXT_SUFFIXES, stdlib=False)


def _read_text(path: Path) -> str:
    # Corpora in the wild have stray bad bytes; replacing them beats failing a long build.
    return path.read_bytes().decode("utf-8", errors="replace")


def _resolve(source: str | None) -> tuple[str, Path]:
    """Classify a source as ("stdlib" | "dir" | "jsonl" | "file", path), validating it."""
    if source is None or source == STDLIB_SOURCE:
        return "stdlib", _stdlib_root()
    if sources.looks_like_hub(source):
        raise sources.hub_error(source)
    path = Path(source).expanduser()
    if path.is_dir():
        return ("data" if sources.is_data_dir(path) else "dir"), path
    if sources.has_glob(source) and not path.exists():
        return "data", path
    if not path.exists():
        raise sources.missing_source_error(source)
    if path.suffix == ".jsonl":
        return "jsonl", path
    if path.suffix in TEXT_SUFFIXES:
        return "file", path
    if sources.is_data_file(path):
        return "data", path
    raise ValueError(
        f"corpus file {str(path)!r} has unsupported type {path.suffix!r}; set --data.source to a "
        f"directory of {'/'.join(TEXT_SUFFIXES)} files, or a {', '.join(sources.DATA_SUFFIXES)} file, directory or glob"
    )


def _iter_jsonl(path: Path, *, text_field: str) -> Iterator[str]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not records
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"corpus {str(path)!r} line {lineno} is not valid JSON ({sources.json_line_problem(e)}); fix or "
                    "remove that line"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(
                    f"corpus {str(path)!r} line {lineno} has no field {text_field!r}; set "
                    f"--data.text_field to the field that holds the document text"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"corpus {str(path)!r} line {lineno} field {text_field!r} is "
                    f"{type(text).__name__}, not a string; set --data.text_field to a text field"
                )
            yield text


def iter_documents(
    source: str | None = None, *, text_field: str = "text", max_bytes: int | None = None
) -> Iterator[str]:
    """Yield the documents of ``source`` in a deterministic order.

    Empty documents are skipped. With ``max_bytes`` the stream stops once that many UTF-8 bytes
    of text were produced (the last document is cut to fit), which keeps debug runs fast.
    The source is validated here, eagerly, so a bad path fails before any work starts.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"--data.max_bytes must be positive or unset, got {max_bytes}")
    kind, path = _resolve(source)
    if kind in ("stdlib", "dir"):
        raw: Iterator[str] = (_read_text(p) for p in _source_files(kind, path))
    elif kind == "jsonl":
        raw = _iter_jsonl(path, text_field=text_field)
    elif kind == "data":
        raw = _texts(sources.iter_records(sources.resolve_files(str(source)), field=text_field), text_field)
    else:
        raw = iter([_read_text(path)])
    describe = {"stdlib": "stdlib", "dir": "directory", "jsonl": "file", "file": "file", "data": "source"}[kind]
    return _limit(raw, max_bytes=max_bytes, describe=f"{describe} {str(path)!r}")


def _texts(values: Iterator[object], text_field: str) -> Iterator[str]:
    for value in values:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"data field {text_field!r} holds {type(value).__name__}, not text; set text_field to a "
                             f"text column (or format = chat for message lists)")
        yield value or ""


def _limit(docs: Iterator[str], *, max_bytes: int | None, describe: str) -> Iterator[str]:
    produced = 0  # UTF-8 bytes yielded so far
    count = 0
    for text in docs:
        if not text:
            continue
        if max_bytes is not None:
            data = text.encode("utf-8")
            remaining = max_bytes - produced
            if len(data) > remaining:
                # Cut on a byte budget; "ignore" drops a multi-byte character split in two.
                data = data[:remaining]
                text = data.decode("utf-8", errors="ignore")
                if not text:
                    break
            produced += len(data)
        count += 1
        yield text
        if max_bytes is not None and produced >= max_bytes:
            break
    if count == 0:
        raise ValueError(
            f"corpus {describe} is empty: it yielded no non-empty document; point --data.source "
            f"at a directory with {'/'.join(TEXT_SUFFIXES)} files or a .jsonl file that has text"
        )


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def corpus_fingerprint(source: str | None, *, text_field: str = "text", max_bytes: int | None = None) -> str:
    """A cheap, stable hex key for "the documents iter_documents would produce".

    Directories (and the stdlib) are keyed by relative paths, sizes and modification times, so no
    file is read; a .jsonl file (usually one big file, often rewritten in place) by its content.
    Used as a cache key for the trained tokenizer and the token shards.
    """
    kind, path = _resolve(source)
    h = hashlib.sha256()
    h.update(f"{_FINGERPRINT_VERSION}|{kind}|{text_field if kind in ('jsonl', 'data') else ''}|{max_bytes}".encode())
    if kind == "data":
        h.update("|".join(sources.files_fingerprint(sources.resolve_files(str(source)))).encode())
    elif kind in ("stdlib", "dir"):
        h.update(str(path.resolve()).encode())
        for p in _source_files(kind, path):
            st = p.stat()
            h.update(f"|{p.relative_to(path).as_posix()}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        h.update(_hash_file(path).encode())
    return h.hexdigest()
