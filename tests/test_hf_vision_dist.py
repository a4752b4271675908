"""Vision-language models (Qwen2.5-VL, Gemma 3, LLaVA; the Transformers backend, models/hf/vision.py)
on 2 fully sharded ranks (SimpleFSDP dp_shard 2, a row each) train as one process does on both rows:
the same losses, step by step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from dist_utils import train_on_ranks  # noqa: E402
from test_train_dist import train_here  # noqa: E402
from vision_fixtures import (  # noqa: E402
    WRITERS,
    image_chat_rows,
    write_rows,
)

pytestmark = pytest.mark.multiprocess



def _args(root, directory, run: str, *extra: str) -> list[str]:
    return ["--model.name", "hf", "--model.hf_config", str(directory), "--model.max_images", "2",
            "--data.source", str(root / "rows.jsonl"), "--data.format", "chat", "--output_dir", str(root / run),
            "--data.cache_dir", str(root / "cache"), "--training.seq_len", "96", "--training.steps", "4",
            "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
            "--validation.enabled", "false", "--checkpoint.enabled", "false", "--training.device", "cpu", *extra]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.parametrize("name", list(WRITERS))
def test_two_fully_sharded_ranks_train_as_one_process(tmp_path, name):
    directory = WRITERS[name](tmp_path / name, weights=True)
    write_rows(tmp_path / "rows.jsonl", image_chat_rows(tmp_path / "images", 12))
    extra = ("--model.image_size", "56") if name == "qwen2_5_vl" else ()
    train_here(_args(tmp_path, directory, "one", "--training.batch_size", "2", *extra), config=None)
    train_on_ranks(None, _args(tmp_path, directory, "two", "--training.batch_size", "1", "--parallelism.dp_shard", "2",
                               *extra))
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == 4
    assert two == pytest.approx(one, abs=1e-5)
