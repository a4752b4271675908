"""Training on your own data: a weighted mixture of a parquet folder and chat data, resumed.

In-process runs check the trainer wiring and a twice-resumed run; the kill -9 test runs real
processes (marked `multiprocess`, run many times by tests/stress.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from data_fixtures import conversations, make_docs, write_chat_tokenizer_dir, write_jsonl, write_parquet
from dist_utils import require_multiprocess_marker, train_on_ranks
from kill_fixtures import kill_9_at_step
from test_train_dist import train_here

from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train.goodput import read_processes, totals

RECIPE = """
[model]
name = "llama3"
flavor = "debug"
dtype = "float32"

[training]
steps = 12
batch_size = 4
seq_len = 64
device = "cpu"
deterministic = true

[lr_scheduler]
warmup_steps = 0
decay_ratio = 0.0

[data]
tokenizer_path = "{tok}"
cache_dir = "{cache}"
val_fraction = 0.05

[[data.sources]]
path = "{web}/*.parquet"
weight = 2.0

[[data.sources]]
path = "{chat}"
format = "chat"
weight = 1.0
name = "chat"

[validation]
freq = 6
steps = 2

[metrics]
log_freq = 1
tensorboard = false

[checkpoint]
interval = 4
keep_latest_k = 0
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    tok = write_chat_tokenizer_dir(root / "tok")
    for i in range(3):
        write_parquet(root / "web" / f"part-{i}.parquet", make_docs(80, seed=i, tag=f"web{i}"))
    write_jsonl(root / "chat.jsonl", conversations(150, seed=7))
    path = root / "mix.toml"
    path.write_text(RECIPE.format(tok=tok, cache=root / "cache", web=root / "web", chat=root / "chat.jsonl"))
    return path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def test_mixture_with_chat_trains_logs_shares_and_resumes_twice_bitwise(tmp_path, recipe):
    straight = tmp_path / "straight"
    summary = assemble(build_config(recipe, ["--output_dir", str(straight)])).train()
    want = losses(straight)
    assert sorted(want) == list(range(1, 13)) and all(v == v for v in want.values())
    assert summary["val_loss"] is not None
    last = [r for r in rows(straight) if "loss" in r][-1]
    assert abs(last["data/web/share"] - 2 / 3) < 0.05 and abs(last["data/chat/share"] - 1 / 3) < 0.05, last
    # Interrupted after step 4 and after step 8 (checkpoints on disk), restarted each time.
    run = tmp_path / "resumed"
    for stop in (4, 8):
        trainer = assemble(build_config(recipe, ["--output_dir", str(run)]))
        trainer.saving.maybe_resume()
        while trainer.step < stop:
            trainer.train_step()
        trainer.saving.save_checkpoint()
        del trainer
        torch.manual_seed(1234)  # a new process starts from unrelated global RNG state
    assemble(build_config(recipe, ["--output_dir", str(run)])).train()
    got = losses(run)
    assert sorted(got) == list(range(9, 13))
    for step in range(9, 13):
        assert got[step] == want[step], (step, got[step], want[step])  # bitwise


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_kill_9_twice_with_a_chat_mixture_gives_identical_losses(tmp_path, recipe):
    require_multiprocess_marker()
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")

    def command(run: Path) -> list[str]:
        return [sys.executable, "-m", "titan_tpu", "train", "--config", str(recipe), "--output_dir", str(run)]

    straight = tmp_path / "straight"
    done = subprocess.run(command(straight), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "killed"
    # Past the checkpoint of step 4 and before step 8's is logged, then past step 8 (its checkpoint
    # written, or being written by the second process: either is a kill after a checkpoint).
    for first, last in ((5, 6), (9, 9)):
        proc = subprocess.Popen(command(run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        kill_9_at_step(proc, run, first, last, timeout=180)
        proc.stderr.close()
    done = subprocess.run(command(run), capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("resumed from") == 1
    assert totals(read_processes(run))["restarts"] == 2  # the ledger: both kills landed on running processes
    want, got = losses(straight), losses(run)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == want[step], (step, got[step], want[step])  # bitwise


@pytest.mark.multiprocess
def test_two_ranks_equal_one_and_reshard_with_a_chat_mixture(tmp_path, recipe):
    """2 ranks x batch 2 read the rows of 1 rank x batch 4 (disjoint halves of each global batch);
    the loss is the mean over the trained tokens of both ranks, so the runs agree; and a 2-rank
    checkpoint resumes on 1 rank at the same place in the data."""
    require_multiprocess_marker()

    def run(nproc: int, out: Path, *extra: str) -> None:
        args = ["--output_dir", str(out), "--training.deterministic", "false", *extra]
        if nproc > 1:  # the same trainer on ranks forked from the fork server (torchrun is not the point here)
            train_on_ranks(recipe, args, world_size=nproc)
            return
        train_here(args, config=recipe)  # one process: this one (neither is the launcher the point)

    one = tmp_path / "one"
    run(1, one)
    two = tmp_path / "two"
    run(2, two, "--training.batch_size", "2", "--training.steps", "8")
    run(1, two)  # resumes the 2-rank checkpoint of step 8 on one rank, batch 4
    want, got = losses(one), losses(two)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


def test_chat_recipe_fine_tunes_an_hf_model_directory(tmp_path):
    """configs/chat_sft_hf.toml runs on a tiny HF directory (weights + tokenizer + chat template):
    chat rows from the directory's template, validation on the held-out conversations."""
    from transformers import AutoModelForCausalLM

    from titan_tpu.models.hf.config import load_hf_config

    hf_dir = write_chat_tokenizer_dir(tmp_path / "hf")
    config = load_hf_config("llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400})
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(hf_dir))
    write_jsonl(tmp_path / "chat.jsonl", conversations(120, seed=3))
    recipe = Path(__file__).resolve().parent.parent / "configs" / "chat_sft_hf.toml"
    cfg = build_config(recipe, ["--model.hf_config", str(hf_dir), "--data.source", str(tmp_path / "chat.jsonl"),
                                "--output_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"),
                                "--training.device", "cpu", "--model.dtype", "float32", "--training.steps", "4",
                                "--training.seq_len", "128", "--training.batch_size", "2",
                                "--training.grad_accum_steps", "2", "--metrics.log_freq", "1",
                                "--metrics.tensorboard", "false", "--validation.freq", "4", "--validation.steps", "1",
                                "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-3"])
    summary = assemble(cfg).train()
    got = rows(tmp_path / "run")
    first = [r for r in got if "loss" in r][0]
    assert first["data/chat/share"] == 1.0 and first["loss"] == first["loss"]
    assert summary["val_loss"] is not None and summary["step"] == 4
