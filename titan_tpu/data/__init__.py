"""Data pipeline: text -> tokens -> packed, resumable, rank-aware batches.

``prepare_dataset`` (corpus + tokenizer -> cached token shards) and ``TokenLoader`` (shards ->
batches) are what the trainer uses; the rest is exposed for tools and tests.
"""

from titan_tpu.data.corpus import corpus_fingerprint, iter_documents
from titan_tpu.data.loader import TokenLoader
from titan_tpu.data.shards import TokenShards, build_token_shards, prepare_dataset
from titan_tpu.data.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "Tokenizer",
    "TokenLoader",
    "TokenShards",
    "build_token_shards",
    "corpus_fingerprint",
    "iter_documents",
    "load_tokenizer",
    "prepare_dataset",
    "train_bpe_tokenizer",
]
