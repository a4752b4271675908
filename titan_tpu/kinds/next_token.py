"""Pre-training and SFT: next-token prediction over packed text and chat rows (train/objective.py
`NextTokenObjective`), any number of sources mixed (data/build.py), every mesh axis, replica groups."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.data.batch import TokenBatch
from titan_tpu.kinds.record import DataParts, DataRequest, TrainingKind
from titan_tpu.train.objective import NextTokenObjective

if TYPE_CHECKING:
    from torch import nn

    from titan_tpu.config import Config
    from titan_tpu.data.sources import SourceConfig

__all__ = ["NEXT_TOKEN"]


def token_data(request: DataRequest) -> DataParts:
    """The sources tokenized (or found in the cache) and packed into rows: text with document masks
    where asked, chat rows with labels only on the assistant's turns."""
    from titan_tpu.data.build import build_loaders, prepare_data

    cfg, t, sources = request.cfg, request.cfg.training, request.sources
    if request.image_model_dir is not None and any(s.format == "chat" for s in sources):
        return image_chat_data(request)
    if request.image_model_dir is not None:
        request.log("data: text rows on a vision-language model: its language model trains, its vision side is unused")
    # A source above data.tokenize_limit_mb not yet in the cache is refused in one line that names prepare-data.
    prepared = prepare_data(cfg.data, sources, vocab_size=request.vocab_size, tokenizer_path=request.tokenizer_path,
                            cache_dir=request.cache_dir, log=request.log, tokenize_limit_mb=cfg.data.tokenize_limit_mb)
    train, val = build_loaders(cfg.data, prepared, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                               dp_rank=request.data_rank, dp_size=request.data_size,
                               validation=cfg.validation.enabled, log=request.log)
    return DataParts(prepared.tokenizer, train, val)


def image_chat_data(request: DataRequest) -> DataParts:
    """Chat rows with their images for a vision-language model (data/images.py): one conversation a
    row, model.max_images image slots each; with data.pack_images several conversations a row, so
    the batches carry positions (document masks)."""
    from titan_tpu.data.images import image_chat_loaders
    from titan_tpu.data.tokenizer import load_tokenizer

    cfg, t, sources = request.cfg, request.cfg.training, request.sources
    if any(s.format != "chat" for s in sources):
        raise ValueError("a vision-language model reads chat rows (with or without images) or text rows, not both in "
                         "one run: give every source format chat, or none")
    if request.tokenizer_path is None:
        raise ValueError(f"model.hf_config {request.image_model_dir} has no tokenizer.json; a vision-language model's "
                         "rows are rendered with its own tokenizer")
    tokenizer = load_tokenizer(request.tokenizer_path)
    m = cfg.model
    train, val = image_chat_loaders(cfg.data, sources, model_dir=request.image_model_dir, tokenizer=tokenizer,
                                    max_images=m.max_images, image_size=m.image_size, seq_len=t.seq_len,
                                    batch_size=t.batch_size, seed=t.seed, dp_rank=request.data_rank,
                                    dp_size=request.data_size, validation=cfg.validation.enabled, log=request.log)
    return DataParts(tokenizer, train, val, example_batch=train.example_batch())


def token_documents(cfg: Config, sources: list[SourceConfig], *, image_rows: bool) -> bool:
    """Packed rows carry document positions: chat rows always, text with data.document_mask
    (data/build.py), a vision-language model's image rows with data.pack_images."""
    from titan_tpu.data.build import uses_document_mask

    return cfg.data.pack_images if image_rows else uses_document_mask(cfg.data, sources)


def next_token_objective(cfg: Config, reference: nn.Module | None) -> NextTokenObjective:
    return NextTokenObjective()


NEXT_TOKEN = TrainingKind(
    name="next_token", section=None, data_formats=("text", "chat"), rows="text or chat rows",
    columns="of text, or chat messages", batch=TokenBatch, data=token_data, objective=next_token_objective,
    loop="pretrain", one_source=False, replica_groups=True, documents=token_documents)
