"""The two environments are declared once and pinned: .venv (`make install`: the package and the
dev extra, constraints.txt) and the TPU environment (docs/tpu.md's one install command on a TPU
VM, and `make tpu-check`'s .venv-tpu: the same plus pytest, constraints-tpu.txt). torch-tpu never
reaches .venv (it aborts `import torch` where libtpu is missing), and a TPU user installs what a run
needs (Hugging Face, trackers), not the test runner."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
TPU_USER_EXTRAS = ("tpu", "hf", "wandb", "eval")  # what docs/tpu.md installs
TPU_ONLY = {"torch-tpu", "libtpu", "jax", "jaxlib", "tokamax"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not an exact pin"
            pins[_name(name)] = version
    return pins


def test_the_tpu_install_is_pinned_and_holds_what_a_run_needs():
    pins = _pins(ROOT / "constraints-tpu.txt")
    wanted = [r for extra in (*TPU_USER_EXTRAS, "tpu-check") for r in EXTRAS[extra]] + PROJECT["dependencies"]
    missing = sorted({_name(r) for r in wanted} - set(pins))
    assert not missing, f"constraints-tpu.txt pins no version of {', '.join(missing)}"
    assert {"transformers", "huggingface-hub", "wandb"} <= set(pins)  # the HF backend, `hf download`, W&B
    assert not any(_name(r) == "pytest" for extra in TPU_USER_EXTRAS for r in EXTRAS[extra])
    shared = _pins(ROOT / "constraints.txt")
    differ = {name: (pins[name], shared[name]) for name in set(pins) & set(shared) if pins[name] != shared[name]}
    assert not differ, f"the two environments pin these differently: {differ}"


def test_torch_tpu_stays_out_of_the_main_environment():
    for extra in ("dev", "hf", "wandb"):
        assert not {_name(r) for r in EXTRAS[extra]} & TPU_ONLY, extra
    assert not TPU_ONLY & set(_pins(ROOT / "constraints.txt"))


def test_the_page_the_makefile_and_the_extras_agree():
    """docs/tpu.md's install command is the one the TPU environment of `make tpu-check` is built with,
    less the test extra: the check checks what a TPU user installs."""
    user = f'pip install -c constraints-tpu.txt -e ".[{",".join(TPU_USER_EXTRAS)}]"'
    assert user in (ROOT / "docs" / "tpu.md").read_text()
    check = f'pip install -q -c constraints-tpu.txt -e ".[{",".join(TPU_USER_EXTRAS)},tpu-check]"'
    assert check in (ROOT / "Makefile").read_text()
