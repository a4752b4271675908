"""Conversion between training checkpoints and Hugging Face model directories."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from titan_tpu.models.common.transformer import TransformerArgs
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
    from titan_tpu.models.hf_checkpoint import save_hf_checkpoint

    step_dir = resolve_checkpoint(checkpoint)
    meta = read_checkpoint_meta(step_dir)
    if meta["model_name"] == "hf":  # the Transformers backend: transformers writes its own layout
        out = _export_hf_backend(meta, load_full_state_dict(step_dir), Path(hf_dir), overwrite=overwrite)
    else:
        args = TransformerArgs(**meta["model_args"])  # rope_scaling may stay a dict: __post_init__ converts it
        # Only the model's tensors: the optimizer moments (twice the model's size) are not needed here.
        out = save_hf_checkpoint(hf_dir, name=meta["model_name"], args=args,
                                 state_dict=load_full_state_dict(step_dir), overwrite=overwrite)
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


def _export_hf_backend(meta: dict, state_dict: dict, hf_dir: Path, *, overwrite: bool) -> Path:
    """save_pretrained into a fresh sibling directory, then swap it in: an interrupted export never
    leaves a half-written directory where a complete one was."""
    import uuid

    from titan_tpu.models.hf_backend import HFArgs, export_hf

    if hf_dir.exists() and not hf_dir.is_dir():
        raise FileExistsError(f"{hf_dir} exists and is not a directory; choose another path")
    if hf_dir.is_dir() and any(hf_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{hf_dir} already exists and is not empty; pass --overwrite or choose another directory")
    staging = hf_dir.with_name(f".{hf_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    export_hf(HFArgs(**meta["model_args"]), state_dict, staging)
    if hf_dir.exists():
        old = hf_dir.with_name(f".{hf_dir.name}.old-{uuid.uuid4().hex[:8]}")
        hf_dir.rename(old)
        staging.rename(hf_dir)
        shutil.rmtree(old)
    else:
        staging.rename(hf_dir)
    return hf_dir
