"""Read the history of an offline W&B run back from its .wandb file, without network or a W&B
server (wandb 0.31 no longer ships a Python reader for it).

The file is a LevelDB-style log: a 7-byte header (b":W&B", magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each with a 7-byte header (CRC-32 of the type byte and the data, length, type:
1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a chunk header is zero padding.
Each record is a serialized ``wandb_internal_pb2.Record``; history rows are its ``history`` field,
one item per key with the value JSON-encoded, the step under ``_step``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32 * 1024


def records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:  # created, header not written yet
        return []
    ident, magic, version = _HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pending, pos = [], b"", _HEADER.size
    while pos + _CHUNK.size <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK.size:  # padding at the end of a block
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if length == 0 and kind == 0:  # an unwritten tail (a killed writer)
            break
        chunk = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            break  # torn by a killed writer: what came before stands
        pos += _CHUNK.size + length
        pending += chunk
        if kind in (1, 4):  # full or last: a record is complete
            out.append(pending)
            pending = b""
    return out


def history(path: Path) -> tuple[str, list[dict]]:
    """(run id, history rows in file order) of one .wandb file."""
    from wandb.proto import wandb_internal_pb2

    run_id, rows = "", []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows
