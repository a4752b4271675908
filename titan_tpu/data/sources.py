"""Data sources beyond text folders: parquet, jsonl(.gz/.zst), ``datasets`` arrow directories,
local Hugging Face dataset directories and globs of those, read with pyarrow.

A source names files; ``iter_records`` yields the value of one field of every row, in a fixed
order (sorted file names, row order within a file), so the same source always gives the same
token stream. Which field: ``text_field`` (a string per row) for ``format = "text"``, a list of
``{role, content}`` messages for ``format = "chat"``.

Why pyarrow and not ``datasets`` (docs/architecture.md, "Reading data"): we read every source
exactly once, in order, into our own token shards, and the resumable position lives in our
loader's state dict. A streaming reader's own position (the part of ``datasets`` that had resume
bugs: #8308, #8145) is never used, and pyarrow reads parquet, arrow IPC streams and compressed
jsonl without the extra dependencies of ``datasets``.

Kinds of path (``resolve_files``):

* a parquet / jsonl / jsonl.gz / jsonl.zst / arrow file;
* a glob (``data/*.parquet``, ``shards/**/*.jsonl.gz``);
* a directory written by ``datasets.save_to_disk`` (``state.json`` + ``*.arrow``; a
  ``DatasetDict`` directory reads its ``train`` split);
* any other directory that holds such data files (a local copy of a Hub dataset repository):
  all of them, recursively, sorted by relative path.

Directories holding only ``.txt`` / ``.md`` / ``.py`` files stay with ``corpus.py``.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

DATA_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".arrow")
_GLOB_CHARS = re.compile(r"[*?\[]")
_ROWS_PER_BATCH = 1024


def has_glob(source: str) -> bool:
    return _GLOB_CHARS.search(source) is not None


def is_data_file(path: Path) -> bool:
    return path.name.endswith(DATA_SUFFIXES)


def looks_like_hub(source: str) -> bool:
    """True for a Hub address, ``hf://datasets/org/name``. A bare ``org/name`` is a local path:
    ``data/corpus`` and ``HuggingFaceFW/fineweb`` have the same shape, and a missing directory must
    be reported as missing, not as a dataset to download."""
    return source.startswith("hf://")


def hub_error(source: str) -> ValueError:
    name = source.removeprefix("hf://").removeprefix("datasets/")
    return ValueError(
        f"data source {source!r} is a Hugging Face Hub dataset; training reads local files: download it first "
        f"(hf download {name} --repo-type dataset --local-dir DIR) and set the source's path to DIR"
    )


def missing_source_error(source: str) -> FileNotFoundError:
    """The one-line error for a local source that is not there, naming the path it resolved to."""
    resolved = Path(source).expanduser().absolute()
    return FileNotFoundError(
        f"data source {source!r} does not exist (looked for {str(resolved)!r}); set the source's path to an existing "
        f"file, directory or glob, or 'stdlib' for the built-in corpus"
    )


def _data_files_under(root: Path) -> list[Path]:
    found = [p for p in root.rglob("*") if p.is_file() and is_data_file(p)
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _arrow_dir_files(root: Path) -> list[Path]:
    """The arrow files of a ``datasets.save_to_disk`` directory, in the dataset's row order."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"dataset directory {str(root)!r} has splits {splits} and no 'train'; set the source "
                             f"path to one of {', '.join(str(root / s) for s in splits)}")
        root = root / "train"
    state = json.loads((root / "state.json").read_text())
    return [root / f["filename"] for f in state["_data_files"]]


def is_data_dir(path: Path) -> bool:
    """A directory this module reads (a saved dataset, or one holding data files)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file() or bool(_data_files_under(path))


def resolve_files(source: str) -> list[Path]:
    """The data files of ``source`` in reading order, or a one-line error saying what to change."""
    if looks_like_hub(source):
        raise hub_error(source)
    path = Path(source).expanduser()
    if has_glob(source) and not path.exists():
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file() and is_data_file(p)]
        if not files:
            raise FileNotFoundError(f"data source glob {source!r} matches no {'/'.join(DATA_SUFFIXES)} file; "
                                    f"fix the pattern")
        return files
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _arrow_dir_files(path)
        files = _data_files_under(path)
        if not files:
            raise ValueError(f"data source directory {str(path)!r} holds no {'/'.join(DATA_SUFFIXES)} files; "
                             f"point the source at a directory with data files")
        return files
    if not path.exists():
        raise missing_source_error(source)
    if not is_data_file(path):
        raise ValueError(f"data source {str(path)!r} has an unsupported type; use one of "
                         f"{', '.join(DATA_SUFFIXES)}, a directory or a glob")
    return [path]


def json_line_problem(e: json.JSONDecodeError) -> str:
    """What is wrong with one JSON line, and where: `e.msg` alone can end mid-sentence
    ("Invalid control character at") because json puts the position after it."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def _field_error(path: Path, where: str, field: str, present: list[str]) -> ValueError:
    return ValueError(f"data source {str(path)!r} {where} has no field {field!r}; fields present: "
                      f"{', '.join(present) or '(none)'}; set text_field to one of them")


def _iter_jsonl(path: Path, field: str) -> Iterator[Any]:
    if path.name.endswith(".gz"):
        f: io.TextIOBase = gzip.open(path, "rt", encoding="utf-8", errors="replace")
    elif path.name.endswith(".zst"):
        import pyarrow as pa

        raw = pa.input_stream(str(path), compression="zstd")
        f = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    else:
        f = path.open("r", encoding="utf-8", errors="replace")
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"data source {str(path)!r} line {lineno} is not valid JSON "
                                     f"({json_line_problem(e)}); fix or remove that line") from None
                if not isinstance(record, dict) or field not in record:
                    present = list(record) if isinstance(record, dict) else []
                    raise _field_error(path, f"line {lineno}", field, present)
                yield record[field]
        except (OSError, EOFError) as e:  # gzip/zstd framing errors surface as OSError
            raise ValueError(f"data source {str(path)!r} is corrupt or truncated ({e}); re-create it") from None


def _arrow_batches(path: Path) -> tuple[list[str], Iterator[Any]]:
    """(column names, record batches) of an arrow file: datasets writes IPC streams; IPC files work too."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema.names, iter(reader)
    except pa.ArrowInvalid:
        file_reader = pa.ipc.open_file(source)
        return file_reader.schema.names, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))


def _iter_table_batches(path: Path, field: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            batches: Iterator[Any] = pf.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[field]) \
                if field in names else iter(())
        else:
            names, batches = _arrow_batches(path)
        if field not in names:
            raise _field_error(path, "schema", field, names)
        for batch in batches:
            yield from batch.column(field).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise ValueError(f"data source {str(path)!r} is corrupt or not {path.suffix[1:]} "
                         f"({str(e).splitlines()[0]}); re-create it or remove it from the source") from None


def iter_records(files: list[Path], *, field: str) -> Iterator[Any]:
    """Every row's ``field`` value, file after file."""
    for path in files:
        if path.name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
            yield from _iter_jsonl(path, field)
        else:
            yield from _iter_table_batches(path, field)


def files_fingerprint(files: list[Path]) -> list[str]:
    """What identifies the files' content cheaply: resolved path, size and modification time each."""
    out = []
    for p in files:
        st = p.stat()
        out.append(f"{p.resolve().as_posix()}:{st.st_size}:{st.st_mtime_ns}")
    return out


@dataclass
class SourceConfig:
    """One ``[[data.sources]]`` entry."""

    path: str = ""  # file, directory, glob, or "stdlib"
    weight: float = 1.0  # share of training rows (normalised over the sources)
    text_field: str = ""  # column/field of each row; "" = "text" (format text) or "messages" (format chat)
    format: str = "text"  # text: documents; chat: {role, content} message lists, loss on assistant tokens
    repeat: bool = True  # start a new epoch when exhausted; false: drop out of the mixture
    name: str = ""  # label in logs and metrics; "" = derived from the path

    @property
    def field(self) -> str:
        return self.text_field or ("messages" if self.format == "chat" else "text")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        path = Path(self.path)
        while has_glob(path.name):
            path = path.parent
        return path.name.split(".")[0] or self.path


SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(SourceConfig))


def source_from_table(table: Any, *, key: str) -> SourceConfig:
    """A SourceConfig from a TOML table, each key checked; one-line errors naming ``key``."""
    if not isinstance(table, dict):
        raise ValueError(f"{key} must be a table like {{path = 'data/*.parquet', weight = 1.0}}")
    unknown = [k for k in table if k not in SOURCE_KEYS]
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a source key; valid keys: {', '.join(SOURCE_KEYS)}")
    spec = SourceConfig()
    for k, value in table.items():
        expected = type(getattr(spec, k))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise ValueError(f"{key}.{k} = {value!r} has the wrong type; expected {expected.__name__}")
        setattr(spec, k, value)
    check_source(spec, key=key)
    return spec


def check_source(spec: SourceConfig, *, key: str) -> None:
    if not spec.path:
        raise ValueError(f"{key}.path is missing; set it to a file, directory or glob")
    if spec.format not in ("text", "chat", "preference", "prompts"):
        raise ValueError(f"{key}.format = {spec.format!r} is not a valid choice; use one of text, chat, preference, "
                         "prompts")
    if spec.weight < 0 or spec.weight != spec.weight:
        raise ValueError(f"{key}.weight = {spec.weight} must be >= 0")


def normalized_weights(specs: list[SourceConfig]) -> list[float]:
    total = sum(s.weight for s in specs)
    if total <= 0:
        raise ValueError(f"data.sources weights are all zero ({', '.join(s.label for s in specs)}); give at least "
                         f"one source a positive weight")
    return [s.weight / total for s in specs]
