"""Next-token cross-entropy of a model over given token sequences (``titan-tpu eval``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F


def load_token_file(path: str | Path, *, vocab_size: int, max_len: int) -> list[list[int]]:
    """Read a JSON list of token-id lists and check every id and length against the model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist; pass a JSON list of lists of token ids")
    try:
        sequences = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"token file {path} is not valid JSON: {e}") from None
    if not isinstance(sequences, list) or not sequences or not all(isinstance(s, list) for s in sequences):
        raise ValueError(f"token file {path} must hold a non-empty JSON list of lists of token ids")
    for i, seq in enumerate(sequences):
        if len(seq) < 2:
            raise ValueError(f"sequence {i} in {path} has {len(seq)} tokens; each needs at least 2 to predict one")
        if len(seq) > max_len + 1:
            raise ValueError(f"sequence {i} in {path} has {len(seq)} tokens; the model takes at most {max_len + 1}")
        bad = [t for t in seq if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequence {i} in {path} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
    return sequences


@torch.no_grad()
def sequence_losses(model: torch.nn.Module, sequences: list[list[int]], *, device: torch.device) -> list[float]:
    """Mean next-token cross-entropy of each sequence (one forward per sequence: lengths differ)."""
    model.eval()
    losses = []
    for seq in sequences:
        tokens = torch.tensor(seq, dtype=torch.long, device=device)[None]
        logits = model(tokens[:, :-1])
        losses.append(F.cross_entropy(logits[0].float(), tokens[0, 1:]).item())
    return losses


def evaluate_hf_dir(hf_dir: str | Path, token_file: str | Path, *, device: str = "auto") -> dict:
    from titan_tpu.device import get_backend
    from titan_tpu.models.hf_checkpoint import load_model_from_hf

    backend = get_backend(device)
    name, args, model = load_model_from_hf(hf_dir, device=backend.device, dtype=torch.float32)
    sequences = load_token_file(token_file, vocab_size=args.vocab_size, max_len=args.max_seq_len)
    losses = sequence_losses(model, sequences, device=backend.device)
    counts = [len(s) - 1 for s in sequences]
    mean = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)  # token-weighted
    return {"model": name, "num_sequences": len(sequences), "num_tokens": sum(counts), "loss": mean,
            "per_sequence_loss": losses}
