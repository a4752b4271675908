"""After SFT: docs/dpo.md's and docs/grpo.md's commands, as written, from the run directory `make
train` leaves (`--checkpoint.initial_load_path outputs/llama3_debug`). A run directory holds the run's
config.json beside its checkpoints, and was once taken for a Hugging Face directory ("unsupported HF
model"): its weights must load from its newest checkpoint, with the tokenizer it trained with."""

from __future__ import annotations

from pathlib import Path

from titan_tpu.cli import main

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--training.steps", "1", "--validation.enabled", "false", "--metrics.tensorboard", "false",
         "--lr_scheduler.warmup_steps", "1"]


def test_dpo_and_grpo_start_from_the_sft_runs_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cache = ["--data.cache_dir", str(tmp_path / "cache")]
    # `make train`, short: the run's directory outputs/llama3_debug (config.json, tokenizer, checkpoints)
    assert main(["train", "--config", str(ROOT / "configs/llama3_debug.toml"), "--data.max_bytes", "200000",
                 "--training.steps", "2", "--validation.enabled", "false", "--metrics.tensorboard", "false",
                 *cache]) == 0
    run = Path("outputs/llama3_debug")
    assert (run / "config.json").is_file() and (run / "checkpoints" / "latest").is_file()
    capsys.readouterr()

    # docs/dpo.md: your pairs, from an SFT run (the reference is its weights)
    pairs = ROOT / "configs/data/arithmetic_preferences.jsonl"
    assert main(["train", "--config", str(ROOT / "configs/llama3_debug_dpo.toml"), "--data.source", str(pairs),
                 "--checkpoint.initial_load_path", str(run), *QUICK, *cache]) == 0
    out = capsys.readouterr().out
    assert f"initial weights loaded from {run}" in out and "dpo: reference policy the starting weights" in out

    # docs/grpo.md: your prompts and your reward function, from an SFT run
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompts, completions, **columns):\n"
        "    return [float(len(c) > 0) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = ROOT / "configs/data/grpo_digits.jsonl"
    assert main(["train", "--config", str(ROOT / "configs/llama3_debug_grpo.toml"), "--data.source", str(prompts),
                 "--grpo.reward", "my_rewards:score", "--grpo.reward_weights", "1",
                 "--checkpoint.initial_load_path", str(run), *QUICK, *cache]) == 0
    assert f"initial weights loaded from {run}" in capsys.readouterr().out
