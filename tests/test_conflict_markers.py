"""No merge-conflict markers are committed: every text file git tracks is scanned for the shape git
writes into a conflicted file (a line opening with seven '<' and a space or nothing, an optional
diff3 base section of seven '|', a line of exactly seven '=', a line opening with seven '>').
A Markdown setext heading or table rule made of '=' is text, not a marker: a bare '=======' line
counts only between an opening and a closing marker. A lone opening or closing marker counts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN, BASE, SPLIT, CLOSE = "<" * 7, "|" * 7, "=" * 7, ">" * 7
_OPEN = re.compile(rf"^{re.escape(OPEN)}(?: |$)")
_BASE = re.compile(rf"^{re.escape(BASE)}(?: |$)")
_CLOSE = re.compile(rf"^{re.escape(CLOSE)}(?: |$)")
_SKIP_DIRS = {".git", ".venv", ".venv-tpu", "outputs", "__pycache__", ".pytest_cache", "node_modules"}


def tracked_files() -> list[Path]:
    """The files git tracks here; outside a git checkout (an unpacked archive), every file but the
    environments and outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not _SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def conflict_markers(text: str) -> list[tuple[int, str]]:
    """(line number, the marker line) of every conflict marker in `text`."""
    found, open_at = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if _OPEN.match(line):
            found.append((number, line))
            open_at = number
        elif _CLOSE.match(line):
            found.append((number, line))
            open_at = None
        elif open_at is not None and (line.rstrip() == SPLIT or _BASE.match(line)):
            found.append((number, line))
    return found


def test_no_conflict_markers_in_tracked_files():
    failures = []
    for path in tracked_files():
        try:
            data = path.read_bytes()
        except OSError:  # a tracked file deleted in the work tree
            continue
        if b"\0" in data:  # binary (an image)
            continue
        text = data.decode("utf-8", errors="replace")
        failures += [f"{path.relative_to(ROOT)}:{n}: {line[:60]!r}" for n, line in conflict_markers(text)]
    assert not failures, "merge-conflict markers committed:\n" + "\n".join(failures)


def test_the_scan_finds_each_kind_of_marker_and_passes_markdown():
    conflicted = "\n".join(["intro", f"{OPEN} HEAD", "ours", f"{BASE} base", "base", SPLIT, "theirs",
                            f"{CLOSE} topic", "after"])
    assert [n for n, _ in conflict_markers(conflicted)] == [2, 4, 6, 8]
    assert conflict_markers(f"text\n{CLOSE} branch\n")  # a half-resolved conflict
    assert conflict_markers(f"{OPEN}\nours\n{SPLIT}\ntheirs\n{CLOSE}\n")  # markers without labels
    markdown = "\n".join(["Title", SPLIT, "", "| a | b |", "|===|===|", SPLIT + "==", "> a quote", ">>> not seven"])
    assert conflict_markers(markdown) == []
    assert len(tracked_files()) > 100 and ROOT / "docs" / "tpu.md" in tracked_files()
