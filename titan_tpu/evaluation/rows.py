"""Loss of a vision-language model on image-text chat rows (``titan-tpu eval --rows``).

The rows are a training run's (data/images.py): chat messages whose user turns hold images,
rendered with the model directory's chat template and processor, each row padded to the same
length with `model.max_images` image slots, at the resolution the run trained at (a checkpoint's
run config gives model.max_images, model.image_size and data.chat_template where the command
line leaves them). The loss is over the assistant's tokens, as training computes it: per row,
and token-weighted over all rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from titan_tpu.data.batch import IGNORE_INDEX
from titan_tpu.evaluation.loss import EvalModel, load_run_model, trained_image_settings

if TYPE_CHECKING:
    from titan_tpu.config import Config
    from titan_tpu.data.images import ImageChatRows


def image_rows(cfg: Config, loaded: EvalModel, path: str, *, seq_len: int) -> ImageChatRows:
    """The rows of `path` (a .jsonl / .parquet file, a glob or a folder, as data.source) rendered
    for `loaded`'s model; a text-only model is a one-line error."""
    from titan_tpu.data.images import directory_renderer, read_image_chat_rows
    from titan_tpu.data.tokenizer import load_tokenizer

    directory = loaded.spec.image_model_dir()
    if directory is None:
        raise ValueError(f"eval --rows scores image-text chat rows on a vision-language model, and {loaded.spec.label} "
                         "is text-only; give a Qwen2.5-VL, Gemma 3 or LLaVA model, or evaluate text with --text")
    tokenizer = cfg.data.tokenizer_path or loaded.tokenizer or str(directory / "tokenizer.json")
    settings = trained_image_settings(cfg, loaded.weights)
    renderer, view = directory_renderer(directory, tokenizer=load_tokenizer(tokenizer), **settings)
    field = cfg.data.text_field if cfg.data.text_field not in ("", "text") else "messages"
    rows = read_image_chat_rows(path, field=field, renderer=renderer, view=view, seq_len=seq_len, all_val=True)
    if not rows.encoded:
        raise ValueError(f"eval --rows {path}: no row fits in {seq_len} tokens ({rows.num_dropped} longer); "
                         "raise --seq-len")
    return rows


@torch.no_grad()
def row_losses(model: torch.nn.Module, rows: ImageChatRows, *, batch_size: int) -> list[tuple[float, int]]:
    """(summed cross-entropy, trained tokens) of each row, `batch_size` rows per forward."""
    from titan_tpu.data.images import stack_rows

    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(rows.encoded), batch_size):
        batch = stack_rows([rows.row(i) for i in range(start, min(start + batch_size, len(rows.encoded)))],
                           rows.view).to(device)
        logits_BSV = model(batch.inputs_BS, images=batch.images).float()
        losses_BS = F.cross_entropy(logits_BSV.transpose(1, 2), batch.labels_BS, ignore_index=IGNORE_INDEX,
                                    reduction="none")
        counts_B = (batch.labels_BS != IGNORE_INDEX).sum(dim=1)
        out += list(zip(losses_BS.sum(dim=1).tolist(), counts_B.tolist()))
    return out


def evaluate_rows(cfg: Config, loaded: EvalModel, path: str, *, seq_len: int, batch_size: int) -> dict:
    """`titan-tpu eval --rows`: the token-weighted loss over the rows' assistant tokens, its
    perplexity, and each row's mean loss."""
    rows = image_rows(cfg, loaded, path, seq_len=seq_len)
    per_row = row_losses(loaded.model, rows, batch_size=batch_size)
    total, tokens = sum(s for s, _ in per_row), sum(n for _, n in per_row)
    if tokens == 0:
        raise ValueError(f"eval --rows {path}: no row has an assistant answer to score")
    mean = total / tokens
    return {"model": loaded.spec.label, "backend": loaded.spec.kind, "weights": loaded.weights,
            "rows": str(Path(path)), "num_sequences": len(per_row), "num_tokens": tokens,
            "num_dropped": rows.num_dropped, "loss": mean, "perplexity": math.exp(mean),
            "per_sequence_loss": [s / n if n else None for s, n in per_row]}


def run_eval_rows(setup, *, checkpoint: str | None, rows: str, seq_len: int, batch_size: int) -> dict:
    """`titan-tpu eval --rows`: the model of a run setup (`checkpoint`'s weights) over image-text rows."""
    return evaluate_rows(setup.cfg, load_run_model(setup, checkpoint=checkpoint), rows, seq_len=seq_len,
                         batch_size=batch_size)
