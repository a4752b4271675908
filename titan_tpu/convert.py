"""Conversion between training checkpoints and Hugging Face model directories."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from titan_tpu.train.checkpoint import STATE_FILE, Checkpointer, load_full_state_dict, read_checkpoint_meta


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given, or the newest complete one under a checkpoints/ or run directory."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        latest = Checkpointer(candidate).latest()
        if latest is not None:
            return latest
    raise FileNotFoundError(f"no complete checkpoint found at {path}; pass a step-XXXXXXXX directory, a "
                            "checkpoints/ directory or a run directory")


def checkpoint_to_hf(checkpoint: str | Path, hf_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Export the model weights (and the run's tokenizer.json, when there is one) as an HF directory."""
    from titan_tpu.models.spec import checkpoint_spec

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    spec = checkpoint_spec(meta["model_name"], meta["model_args"])
    # Only the model's tensors: the optimizer moments (twice the model's size) are not needed here.
    out = spec.save_hf(load_full_state_dict(step_dir), Path(hf_dir), overwrite=overwrite)
    tokenizer = step_dir.parent.parent / "tokenizer.json"  # <run>/checkpoints/step-N -> <run>
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    return out


def hf_to_checkpoint(hf_dir: str | Path, checkpoint_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write a weights-only step-0 checkpoint, usable as --checkpoint.initial_load_path."""
    from titan_tpu.models.hf_checkpoint import load_hf_checkpoint

    ckpt = Checkpointer(checkpoint_dir)
    if ckpt.latest() is not None and not overwrite:
        raise FileExistsError(f"{checkpoint_dir} already holds checkpoints; "
                              "pass --overwrite or choose another directory")
    name, args, state_dict = load_hf_checkpoint(hf_dir)
    return ckpt.save(0, {"step": 0, "model": state_dict, "model_name": name,
                         "model_args": dataclasses.asdict(args)})
