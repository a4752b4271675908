"""The data of the preference kinds (DPO, ORPO): one source of prompt, chosen and rejected rows,
each pair a `PreferenceBatch` row of chosen and rejected completions with labels on the
completion tokens only (data/preference.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from titan_tpu.kinds.record import DataParts, DataRequest

__all__ = ["PREFERENCE_COLUMNS", "PREFERENCE_ROWS", "preference_data", "two_rows"]

PREFERENCE_ROWS = "preference pairs"
PREFERENCE_COLUMNS = "of prompt, chosen, rejected rows"


def two_rows(cfg) -> int:
    """A pair is two rows of the micro-batch: its chosen and its rejected completion."""
    return 2


def preference_data(request: DataRequest) -> DataParts:
    """The pairs of the one preference source, tokenized with the model's tokenizer (its chat
    template for chat rows) or a BPE learned from the pairs' text, as pre-training would."""
    from titan_tpu.data.chat import load_chat_template
    from titan_tpu.data.preference import PreferenceLoader, load_preference_pairs
    from titan_tpu.data.tokenizer import load_tokenizer

    cfg, t = request.cfg, request.cfg.training
    source = request.sources[0]
    template = None
    if request.tokenizer_path:
        tokenizer = load_tokenizer(request.tokenizer_path)
        try:
            template = load_chat_template(request.tokenizer_path)
        except ValueError:  # no chat template: plain-text rows only (a chat row then says so)
            template = None
    else:
        tokenizer = _pair_tokenizer(source.path, vocab_size=request.vocab_size, cache_dir=request.cache_dir,
                                    log=request.log)
    pairs = load_preference_pairs(source.path, tokenizer=tokenizer, seq_len=t.seq_len, chat_template=template)
    val_fraction = cfg.data.val_fraction if cfg.validation.enabled else 0.0
    train = PreferenceLoader(pairs, batch_size=t.batch_size, seed=t.seed, dp_rank=request.data_rank,
                             dp_world_size=request.data_size, val_fraction=val_fraction)
    request.log(f"data: {len(pairs)} preference pairs from {source.path} ({train.num_val} held out for validation)")
    # Labels are IGNORE_INDEX on the prompt and padding: the run's loss kernel skips them (run/resolved.py).
    return DataParts(tokenizer, train, train if cfg.validation.enabled else None)


def _pair_tokenizer(source: str, *, vocab_size: int, cache_dir: Path, log: Callable[[str], None]):
    """A BPE of the model's vocabulary trained on the plain-text columns of the preference pairs."""
    from titan_tpu.data.preference import COLUMNS, read_preference_rows
    from titan_tpu.data.tokenizer import cached_bpe_tokenizer

    def texts() -> list[str]:
        return [row[c] for _, row in read_preference_rows(source) for c in COLUMNS if isinstance(row[c], str)]

    return cached_bpe_tokenizer(source, texts, kind="preference", vocab_size=vocab_size, cache_dir=cache_dir, log=log)
