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

__all__ = ["NEXT_TOKEN"]


def token_data(request: DataRequest) -> DataParts:
    """The sources tokenized (or found in the cache) and packed into rows: text with document masks
    where asked, chat rows with labels only on the assistant's turns."""
    from titan_tpu.data.build import build_loaders, prepare_data, uses_document_mask

    cfg, t, sources = request.cfg, request.cfg.training, request.sources
    document_mask = uses_document_mask(cfg.data, sources)
    kernels = cfg.kernels
    if any(s.format == "chat" for s in sources):  # labels IGNORE_INDEX outside the assistant's turns
        kernels = kernels.for_ignored_labels(request.kernel_device)
    # A kernel that cannot run on this device is a one-line error now, not at the first step.
    kernels.check_device(request.kernel_device, documents=document_mask)
    # A source above data.tokenize_limit_mb not yet in the cache is refused in one line that names prepare-data.
    prepared = prepare_data(cfg.data, sources, vocab_size=request.vocab_size, tokenizer_path=request.tokenizer_path,
                            cache_dir=request.cache_dir, log=request.log, tokenize_limit_mb=cfg.data.tokenize_limit_mb)
    train, val = build_loaders(cfg.data, prepared, seq_len=t.seq_len, batch_size=t.batch_size, seed=t.seed,
                               dp_rank=request.data_rank, dp_size=request.data_size,
                               validation=cfg.validation.enabled, log=request.log)
    return DataParts(prepared.tokenizer, train, val, document_mask=document_mask, kernels=kernels)


def next_token_objective(cfg: Config, reference: nn.Module | None) -> NextTokenObjective:
    return NextTokenObjective()


NEXT_TOKEN = TrainingKind(
    name="next_token", section=None, data_formats=("text", "chat"), rows="text or chat rows",
    columns="of text, or chat messages", batch=TokenBatch, data=token_data, objective=next_token_objective,
    loop="pretrain", one_source=False, replica_groups=True)
