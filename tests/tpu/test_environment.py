"""The TPU environment as docs/tpu.md installs it: what a run on a TPU VM reaches for besides
torch-tpu is there (the Transformers backend, `hf download`, W&B), and `titan-tpu compile` runs
with no environment variables set by the user (the command sets what it needs before torch loads)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_the_install_has_what_a_run_needs():
    for module in ("transformers", "huggingface_hub", "wandb", "torch_tpu", "jax", "tokamax"):
        assert importlib.util.find_spec(module) is not None, module
    for command in ("titan-tpu", "torchrun", "hf", "wandb"):
        assert (BIN / command).is_file(), f"{command} is not in {BIN}"


def test_compile_needs_no_environment_from_the_user():
    """The debug recipe compiled for a v5p-8 in a fresh process whose environment has none of the
    variables the command needs (cli.COMPILE_ENVIRONMENT), as a user's shell would."""
    from titan_tpu.cli import COMPILE_ENVIRONMENT

    env = {k: v for k, v in os.environ.items() if k not in COMPILE_ENVIRONMENT and k != "TITAN_TPU_CHECK"}
    done = subprocess.run([str(BIN / "titan-tpu"), "compile", "--config", "configs/llama3_debug.toml",
                           "--hardware", "v5p-8", "--training.batch_size", "1", "--training.seq_len", "64"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fits" in done.stdout, done.stdout[-2000:]
    conftest.SUMMARY.append("titan-tpu compile with no environment variables from the user: llama3_debug on v5p-8, "
                            "exit 0")
