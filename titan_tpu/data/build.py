"""The data section of a run -> tokenizer, training loader, validation loader.

One text source with ``repeat`` on reads through ``TokenLoader`` exactly as before mixtures
existed (same batches, same checkpointed position); several sources, chat data or
``repeat = false`` read through ``MixtureLoader``. ``data.val_source`` gives validation its own
source (all of its rows), otherwise the held-out fraction of each training source is used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from titan_tpu.data.loader import TokenLoader
from titan_tpu.data.mixture import ChatRows, MixtureLoader, TextRows
from titan_tpu.data.prepare import PreparedSource, prepare_sources
from titan_tpu.data.tokenizer import Tokenizer


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train: list[PreparedSource]
    val: list[PreparedSource]


def prepare_data(data_cfg: Any, sources: list[Any], *, vocab_size: int, tokenizer_path: str | None,
                 cache_dir: str | Path, workers: int = 1, log: Callable[[str], None] = print,
                 tokenize_limit_mb: float = 0.0) -> PreparedData:
    """Tokenize (or find in the cache) every training source and data.val_source. A training run
    passes data.tokenize_limit_mb (a source above it that is not in the cache is refused, naming
    prepare-data); prepare-data itself has no limit (0)."""
    max_bytes = data_cfg.max_bytes or None
    common = dict(max_bytes=max_bytes, vocab_size=vocab_size, cache_dir=cache_dir, workers=workers,
                  chat_template_choice=data_cfg.chat_template, log=log, tokenize_limit_mb=tokenize_limit_mb)
    tokenizer, train = prepare_sources(sources, tokenizer_path=tokenizer_path, **common)
    val: list[PreparedSource] = []
    if data_cfg.val_source:
        spec = replace(sources[0], path=data_cfg.val_source, weight=1.0, name="val")
        _, val = prepare_sources([spec], tokenizer_path=str(tokenizer_path or tokenizer.path), **common)
    return PreparedData(tokenizer, train, val)


def uses_document_mask(data_cfg: Any, sources: list[Any]) -> bool:
    """Chat rows are always packed with document masks; text follows data.document_mask."""
    return data_cfg.document_mask or any(s.format == "chat" for s in sources)


def _rows(p: PreparedSource, *, seq_len: int, val_fraction: float, overlong: str, all_val: bool = False):
    if p.chat is not None:
        return ChatRows(p.chat, seq_len=seq_len, val_fraction=val_fraction, overlong=overlong, all_val=all_val)
    return TextRows(p.shards, seq_len=seq_len, val_fraction=val_fraction, all_val=all_val)


def build_loaders(data_cfg: Any, prepared: PreparedData, *, seq_len: int, batch_size: int, seed: int,
                  dp_rank: int, dp_size: int, validation: bool, log: Callable[[str], None] = print):
    """(training loader, validation loader or None)."""
    specs = [p.spec for p in prepared.train]
    document_mask = uses_document_mask(data_cfg, specs)
    # With its own validation source, a training source holds nothing out.
    val_fraction = 0.0 if data_cfg.val_source else data_cfg.val_fraction
    common = dict(seq_len=seq_len, batch_size=batch_size, seed=seed, dp_rank=dp_rank, dp_world_size=dp_size)
    if len(specs) == 1 and specs[0].format == "text" and specs[0].repeat:
        shards = prepared.train[0].shards
        train = TokenLoader(shards, split="train", val_fraction=val_fraction, document_mask=document_mask, **common)
        val = None
        if validation and not data_cfg.val_source:
            val = TokenLoader(shards, split="val", val_fraction=val_fraction, document_mask=document_mask, **common)
    else:
        rows = [_rows(p, seq_len=seq_len, val_fraction=val_fraction, overlong=data_cfg.overlong)
                for p in prepared.train]
        for spec, r in zip(specs, rows):
            if isinstance(r, ChatRows) and (r.num_dropped or r.num_truncated):
                what = f"dropped {r.num_dropped}" if r.num_dropped else f"truncated {r.num_truncated}"
                log(f"data: {spec.label}: {what} conversation(s) longer than seq_len {seq_len} (data.overlong)")
        train = MixtureLoader(rows, names=[s.label for s in specs], weights=[s.weight for s in specs],
                              repeat=[s.repeat for s in specs], document_mask=document_mask, **common)
        val = train if validation and not data_cfg.val_source else None
    if validation and data_cfg.val_source:
        rows = [_rows(p, seq_len=seq_len, val_fraction=0.0, overlong=data_cfg.overlong, all_val=True)
                for p in prepared.val]
        if rows[0].num_val == 0:
            raise ValueError(f"data.val_source {data_cfg.val_source!r} holds no row of {seq_len} tokens; use more "
                             f"validation data or a smaller training.seq_len")
        val = MixtureLoader(rows, names=["val"], weights=[1.0], repeat=[True], document_mask=document_mask,
                            split="val", **common)
    return train, val
