"""The guides speak to users: README.md, docs/ and skills/ name no path of the machine a number was
measured on, no issue number, branch name or commit id, and no helper session. Where a measurement
needs provenance, the page gives the command, the date and the CPU instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "skills").rglob("*.md"))]

LEAKS = {
    "a machine path": re.compile(r"(?<![\w.~])/(?:work|tmp|root|home|old_root)/"),
    "an issue number": re.compile(r"\bissues? #?\d+\b|\bissue \d+'s\b", re.IGNORECASE),
    "a branch name": re.compile(r"\bbranch `[\w./-]+`"),
    "a commit id": re.compile(r"\b(?:at|main|commit|titan-tpu) [0-9a-f]{7,12}\b"),
    "a helper session": re.compile(r"\bhelper-\d+\b"),
}


def leaks(text: str) -> list[tuple[int, str, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in LEAKS.items():
            if match := pattern.search(line):
                found.append((number, what, match.group(0)))
    return found


def test_guides_name_no_lab_details():
    failures = [f"{path.relative_to(ROOT)}:{number}: {what} ({text!r})"
                for path in PAGES for number, what, text in leaks(path.read_text())]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("line", [
    "measured under `/work/notes/cpu measure`", "see issue 25 for the history", "as issue 15's part 3 showed",
    "titan-tpu branch `calib`", "replayed with the planner of main at aca8b29", "reported by helper-3",
])
def test_each_kind_of_leak_is_caught(line):
    assert leaks(line)


def test_ordinary_text_passes():
    assert not leaks("`titan-tpu plan --config configs/llama3_8b_tpu.toml` on 2026-12-04, AMD EPYC, ~/.cache/titan_tpu")
