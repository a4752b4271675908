"""Vision-language models (the Transformers backend's Qwen2.5-VL, Gemma 3 and LLaVA, tiny random
directories written here) on the JAX path: the captured step with its vision tower, lowered to JAX
and run by XLA on host devices, against the eager run of the same mesh; and the step compiled for a
TPU slice by `titan-tpu compile`'s core, images in its inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from titan_tpu.config import build_config
from titan_tpu.tools.compile_cmd import compile_step_for_tpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the vision fixtures
from test_jax_path import EAGER, JAX, LOSS_TOL, NORM_TOL, assert_close, metrics, train  # noqa: E402
from vision_fixtures import (  # noqa: E402
    WRITERS,
    image_chat_rows,
    write_rows,
)

pytestmark = pytest.mark.multiprocess

IMAGE_SIZE = {"qwen2_5_vl": ["--model.image_size", "56"], "gemma3": [], "llava": []}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision")
    found = {name: write(root / name, weights=True) for name, write in WRITERS.items()}
    found["rows"] = write_rows(root / "rows.jsonl", image_chat_rows(root / "images", 12))
    return found


RANKS = 2  # fully sharded


def _args(name: str, data: dict[str, Path], run: Path) -> list[str]:
    return ["--model.name", "hf", "--model.hf_config", str(data[name]), "--model.max_images", "2",
            "--model.train_vision", "true", *IMAGE_SIZE[name], "--data.source", str(data["rows"]),
            "--data.format", "chat", "--data.cache_dir", str(run.parent / "cache"), "--output_dir", str(run),
            "--training.device", "cpu", "--training.batch_size", "2", "--training.seq_len", "96",
            "--training.steps", "4", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
            "--metrics.tensorboard", "false", "--validation.enabled", "false", "--checkpoint.enabled", "false",
            "--parallelism.dp_shard", str(RANKS)]


@pytest.mark.parametrize("name", list(WRITERS))
def test_vision_language_jax_path_equals_eager_run(tmp_path, data, name):
    """Two fully sharded ranks, the vision tower trained (its patch convolution, layer norms, GELU
    and Gemma 3's pooling in the program, forward and backward): 4 steps by JAX give the eager run's
    losses and gradient norms. Gemma 3's SigLIP tower holds a pooling head the model never runs,
    whose probe [1, 1, D] 2 ranks cannot split on its first dim: SimpleFSDP shards it on D
    (simple_fsdp._even_blocks), so every rank feeds the one program an equal block."""
    jax_run, eager_run = tmp_path / "jax", tmp_path / "eager"
    train(RANKS, "llama3_debug", _args(name, data, jax_run) + JAX)
    train(RANKS, "llama3_debug", _args(name, data, eager_run) + EAGER)
    assert_close(metrics(jax_run, "loss"), metrics(eager_run, "loss"), LOSS_TOL, "loss")
    assert_close(metrics(jax_run, "grad_norm"), metrics(eager_run, "grad_norm"), NORM_TOL, "grad_norm")


def test_vision_language_step_compiles_for_v5p(tmp_path, data):
    """The Qwen2.5-VL step (frozen tower, its projector trained) on a 4-chip v5p slice, dp_shard 4:
    XLA's TPU compiler takes it, captured with the rows' images as the trainer captures it (one
    conversation a row, no documents; the tower's work in our formula), and our formula's FLOPs are
    reported beside XLA's."""
    from titan_tpu.run.resolved import Target, resolve_run
    from titan_tpu.run.setup import RunSetup
    from titan_tpu.tools.compile_cmd import _formula_flops_per_token

    cfg = build_config("configs/llama3_debug.toml", _args("qwen2_5_vl", data, tmp_path / "run") +
                       ["--parallelism.dp_shard", "4", "--model.train_vision", "false"])
    report = compile_step_for_tpu(cfg, "v5p:2x2x1")
    assert report["fits"] and report["mesh"] == {"dp_shard": 4} and report["documents"] is False
    assert report["formula_flops_per_chip"] > 0 and report["flops_per_chip"] > 0
    text_only = _formula_flops_per_token(resolve_run(RunSetup.resolved(cfg), Target.for_jax("tpu", 4))) * \
        report["tokens_per_chip"]
    assert report["formula_flops_per_chip"] > text_only  # the images' tower and projector counted
