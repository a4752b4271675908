"""Small file helpers shared by every layer: usual permissions, JSON files read with one-line errors,
where the data cache lives, and what a directory of weights is."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Where tokenizers and token shards are cached when `data.cache_dir` is empty: $TITAN_TPU_CACHE,
    else ~/.cache/titan_tpu."""
    return Path(os.environ.get("TITAN_TPU_CACHE") or Path.home() / ".cache" / "titan_tpu")


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and put back at once
    os.umask(mask)
    return mask


def usual_permissions(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and everything under it) the permissions a plain
    ``open``/``mkdir`` would: 0644/0755 under the common umask 022.

    Files written through a private temporary file (safetensors' ``save_file``, ``tempfile``) keep
    that file's 0600, which hides an export or a report from the other users of a machine."""
    path = Path(path)
    mask = _umask()
    if path.is_file():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def read_json_file(path: str | Path, *, what: str, fix: str) -> Any:
    """The JSON in ``path``; a file that does not parse (truncated, a flipped byte) is one ValueError
    naming the file, ``what`` it is and the ``fix`` (e.g. "re-download it")."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is damaged (not valid JSON: {e}); {fix}") from None


def is_hf_model_dir(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model directory: a config.json that describes a model. A
    training run's directory holds a config.json too (the run's config, whose sections include
    `training` and `model`: loops/base.py writes it beside the checkpoints), and is not one. A
    config.json that does not parse counts as a model's, whose loader then names the damage."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not (isinstance(data, dict) and "training" in data and "model" in data)
