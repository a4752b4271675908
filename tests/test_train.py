"""End to end: the debug model learns on the embedded corpus and resumes bitwise-exactly."""

import json
from pathlib import Path

import pytest
import torch

from titan_tpu.config import build_config
from titan_tpu.loops import assemble

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LLAMA_DEBUG = str(CONFIGS / "llama3_debug.toml")
QWEN_DEBUG = str(CONFIGS / "qwen3_debug.toml")


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def test_loss_falls_and_outputs_are_written(tmp_path, train_overrides):
    cfg = build_config(LLAMA_DEBUG,
                       train_overrides(training__steps=50, metrics__tensorboard="true", checkpoint__interval=25))
    summary = assemble(cfg).train()
    run = tmp_path / "run"
    rows = read_rows(run)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 51))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "memory_gb"):
        assert key in train_rows[-1], key
    assert any("val_loss" in r for r in rows)
    first, last = train_rows[0]["loss"], sum(r["loss"] for r in train_rows[-5:]) / 5
    assert first > 7.0  # ~ln(2048) = 7.6 at init
    assert last < first - 1.5, (first, last)
    assert summary["checkpoint"].endswith("step-00000050")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000050"
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))


def test_resume_is_bitwise_identical(tmp_path, train_overrides):
    # 8 steps, interrupted after 4: a state the checkpoint lost (optimizer moments, the data
    # position, RNG, the LR schedule's step) changes the first step after it, bit for bit; more
    # steps only cost time.
    overrides = train_overrides(training__deterministic="true", validation__enabled="false", training__steps=8)
    assemble(build_config(LLAMA_DEBUG, overrides)).train()
    straight = train_losses(tmp_path / "run")

    # The same 8-step run, interrupted after step 4 (its checkpoint is on disk), then restarted.
    interrupted = overrides + ["--output_dir", str(tmp_path / "resumed")]
    first = assemble(build_config(LLAMA_DEBUG, interrupted))
    for _ in range(4):
        first.train_step()
    first.saving.save_checkpoint()
    del first
    torch.manual_seed(1234)  # a resumed process starts with unrelated global RNG state
    second = assemble(build_config(LLAMA_DEBUG, interrupted))
    second.train()
    assert second.step == 8
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(5, 9))
    for step in range(5, 9):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


def test_gradient_accumulation_matches_larger_batch(tmp_path, train_overrides):
    common = dict(training__steps=3, validation__enabled="false", checkpoint__enabled="false",
                  lr_scheduler__warmup_steps=0, lr_scheduler__decay_ratio=0.0)
    big = assemble(build_config(LLAMA_DEBUG, train_overrides(training__batch_size=4, **common)))
    small = assemble(build_config(LLAMA_DEBUG,
                                 train_overrides(training__batch_size=2, training__grad_accum_steps=2, **common)))
    for _ in range(3):
        a, b = big.train_step(), small.train_step()
        assert a.num_tokens == b.num_tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for (name, p), q in zip(big.components.model.named_parameters(), small.components.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_checkpoint_of_another_model_is_refused(tmp_path, train_overrides):
    assemble(build_config(LLAMA_DEBUG, train_overrides(training__steps=1))).train()
    other = build_config(QWEN_DEBUG, train_overrides(training__steps=2))
    with pytest.raises(ValueError, match="use another --output_dir or the matching --model.name"):
        assemble(other).train()


def test_auto_dtype_is_float32_on_cpu_and_bf16_on_accelerators(train_overrides):
    from titan_tpu.parallel.simple_fsdp import default_mixed_precision

    trainer = assemble(build_config(LLAMA_DEBUG, train_overrides(model__dtype="auto", training__steps=1)))
    assert trainer.components.compute_dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in trainer.components.model.parameters())
    assert default_mixed_precision("cuda").param_dtype == torch.bfloat16
    assert default_mixed_precision("tpu").reduce_dtype == torch.float32


def short_documents(directory: Path, count: int = 300) -> Path:
    """A corpus of short documents (a few dozen tokens each), so every window packs several."""
    directory.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "step", "loss", "token", "window", "rank", "shard", "mesh"]
    for i in range(count):
        text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(20 + i % 30))
        (directory / f"doc{i:04d}.txt").write_text(f"document {i}: {text}.\n")
    return directory


def test_document_mask_trains_in_eager_and_graph_mode_alike(tmp_path, train_overrides):
    """--data.document_mask true: batches carry positions, attention stays within documents, and the
    captured step gives the eager losses; the masked losses differ from unmasked ones."""
    common = dict(training__steps=6, validation__enabled="false", checkpoint__enabled="false",
                  data__document_mask="true", data__source=str(short_documents(tmp_path / "docs")),
                  data__cache_dir=str(tmp_path / "cache"), training__seq_len=128)
    eager = assemble(build_config(LLAMA_DEBUG, train_overrides(**common)))
    graph = assemble(build_config(LLAMA_DEBUG, train_overrides(training__mode="graph", compile__backend="aot_eager",
                                                              output_dir=str(tmp_path / "graph"), **common)))
    plain = assemble(build_config(LLAMA_DEBUG, train_overrides(**{**common, "data__document_mask": "false"})))
    inputs, _, positions = eager.components.train_loader.next_batch()
    assert ((positions == 0).sum(dim=1) > 1).all()  # every window holds several documents
    eager.components.train_loader.load_state_dict(plain.components.train_loader.state_dict())  # rewind to the start
    eager_losses = [eager.train_step().loss for _ in range(6)]
    graph_losses = [graph.train_step().loss for _ in range(6)]
    plain_losses = [plain.train_step().loss for _ in range(6)]
    assert max(abs(a - b) for a, b in zip(eager_losses, graph_losses)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(eager_losses, plain_losses)) > 1e-3


def test_graph_mode_matches_eager(tmp_path, train_overrides):
    """--training.mode graph: the captured, compiled step gives the eager losses (fp32, CPU)."""
    # 8 steps: the losses then already depend on the captured step's updates of every parameter and
    # optimizer moment (a wrong update shows from step 2 on).
    common = dict(training__steps=8, validation__enabled="false", checkpoint__enabled="false")
    eager = assemble(build_config(LLAMA_DEBUG, train_overrides(**common)))
    graph = assemble(build_config(LLAMA_DEBUG, train_overrides(training__mode="graph", compile__backend="aot_eager",
                                                              output_dir=str(tmp_path / "graph"), **common)))
    assert type(graph.components.step_fn).__name__ == "GraphStep"
    graph.train()
    rows = [json.loads(line) for line in (tmp_path / "graph" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["capture_s"] > 0 and rows[0]["compile_s"] > 0
    graph_losses = {r["step"]: r["loss"] for r in rows}
    assert sorted(graph_losses) == list(range(1, 9))
    for step in range(1, 9):
        assert eager.train_step().loss == pytest.approx(graph_losses[step], abs=1e-6), step
