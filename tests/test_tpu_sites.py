"""Where TorchTPU is used: only in a small, named set of modules, and never at import time, so the
project imports and runs where torch_tpu is absent (or present without libtpu, where importing it
aborts the process). What the uses are is checked against the real package by tests/tpu/
(`make tpu-check`); this test needs neither torch_tpu nor jax."""

from __future__ import annotations

import subprocess
import sys

from tpu_call_sites import ROOT, find_sites

# The TPU backend (device selection), the compile backend (TorchTPU's compilers), the TPU kernel
# variants, and TorchTPU's own lowering of a captured step compiled on a CPU
# (bench/torchtpu_lowering.py).
TPU_MODULES = {"titan_tpu/device.py", "titan_tpu/graph/torchtpu.py", "titan_tpu/kernels/tpu.py",
               "titan_tpu/tools/torchtpu_lowering.py"}
# Imported only by the kernels that run on a TPU (and tests/tpu/): JAX, never at import time.
JAX_MODULES = {"titan_tpu/kernels/tpu_jax.py"}


def test_torch_tpu_is_used_only_in_the_tpu_modules_and_only_inside_functions():
    sites = find_sites()
    assert len(sites) >= 10, "the finder found almost nothing: is it still reading the source?"
    outside = sorted(f"{s.where()} {s.name}" for s in sites if s.path not in TPU_MODULES)
    assert not outside, f"TorchTPU used outside {sorted(TPU_MODULES)}: {outside}"
    at_import = sorted(f"{s.where()} {s.name}" for s in sites if s.module_level)
    assert not at_import, f"TorchTPU used at module level (runs at import): {at_import}"


def test_the_finder_sees_every_kind_of_use(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import importlib\n"
        "import torch\n"
        "from torch.tpu.pallas import jax_op\n"
        "def f(x):\n"
        "    importlib.import_module('torch_tpu')\n"
        "    y = torch.tpu.ops.splash_sdpa(x, x, x, is_causal=True, enable_gqa=False)\n"
        "    op = jax_op('ns::op', f)\n"
        "    return torch.tpu.synchronize, torch.tpu.ops.ragged_dot(*x)\n"
    )
    got = {(s.line, s.name, s.called, s.num_positional, s.keywords, s.starred, s.module_level)
           for s in find_sites(tmp_path, ("pkg",))}
    assert got == {
        (3, "torch.tpu.pallas.jax_op", False, 0, (), False, True),
        (5, "torch_tpu", False, 0, (), False, False),
        (6, "torch.tpu.ops.splash_sdpa", True, 3, ("is_causal", "enable_gqa"), False, False),
        (7, "torch.tpu.pallas.jax_op", True, 2, (), False, False),
        (8, "torch.tpu.synchronize", False, 0, (), False, False),
        (8, "torch.tpu.ops.ragged_dot", True, 0, (), True, False),
    }


def test_importing_the_project_imports_neither_torch_tpu_nor_jax():
    code = ("import sys, titan_tpu.kernels, titan_tpu.graph.compile, titan_tpu.loops.pretrain, titan_tpu.cli; "
            "bad = [m for m in ('torch_tpu', 'jax', 'tokamax') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
