"""Data pipeline: text -> tokens -> packed, resumable, rank-aware batches.

``prepare_dataset`` (corpus + tokenizer -> cached token shards) and ``TokenLoader`` (shards ->
batches) are what the trainer uses; the rest is exposed for tools and tests.

Names are imported on first use (PEP 562): the tokenizer worker processes of prepare-data import
this package, and must not pay for importing torch (the loader's) just to tokenize.
"""

import importlib

_WHERE = {
    "Tokenizer": "tokenizer",
    "TokenLoader": "loader",
    "TokenShards": "shards",
    "build_token_shards": "shards",
    "corpus_fingerprint": "corpus",
    "iter_documents": "corpus",
    "load_tokenizer": "tokenizer",
    "prepare_dataset": "shards",
    "train_bpe_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'titan_tpu.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"titan_tpu.data.{_WHERE[name]}"), name)
