"""tests/tpu/: checks against the real torch-tpu package and JAX, run by `make tpu-check` in
.venv-tpu (never collected by the main suite: tests/conftest.py ignores this directory unless
TITAN_TPU_CHECK=1). Counts for the run's summary are printed at the end."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tpu_call_sites

if importlib.util.find_spec("torch_tpu") is None or importlib.util.find_spec("jax") is None:
    pytest.exit("tests/tpu/ needs torch-tpu, libtpu and jax: run `make tpu-check` (it builds .venv-tpu)", returncode=4)

# tokamax reads absl flags from sys.argv when first used, and pytest's own options (-q) are not
# its flags: mark them parsed with the program name alone.
from absl import flags  # noqa: E402 - after the check that the environment has jax

flags.FLAGS(sys.argv[:1], known_only=True)

# 4 CPU devices for JAX, set before JAX starts: the lowered step of several ranks runs on a CPU
# mesh (test_jax_lowering.py).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

# The compiles here are compile-only (libtpu's topology client takes no device): let them load
# libtpu beside another process's, which its lockfile otherwise refuses.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

SUMMARY: list[str] = []  # lines for the terminal summary, added by the tests


def pytest_terminal_summary(terminalreporter):
    if SUMMARY:
        terminalreporter.section("tpu-check")
        for line in SUMMARY:
            terminalreporter.write_line(line)


def pytest_runtest_logstart(nodeid, location):
    """The running test's id in the file TITAN_TPU_CHECK_CURRENT names (`make tpu-check` sets it):
    where a crash of the process (an abort inside XLA) cuts the log, the Makefile prints it last."""
    path = os.environ.get("TITAN_TPU_CHECK_CURRENT")
    if path:
        Path(path).write_text(nodeid + "\n")
