"""Every compile report still certifies the program today's code builds: each compiled recipe
captured and lowered again (no XLA compile, tools/recheck.py) and its programs' fingerprints held
against its report's. A change to capture, lowering or parallelism that changes a recipe's program
fails here, naming the recipe: recompile it (bench/tpu_compile_table.py) and regenerate
docs/tpu_recipes.md."""

from __future__ import annotations

import json

from titan_tpu.tools.recheck import moved_recipes, recheck
from titan_tpu.tools.recipe_table import REPORTS


def test_every_compile_report_names_the_program_todays_code_builds():
    compiled = [path for path in REPORTS.glob("*.json") if "error" not in json.loads(path.read_text())]
    results = recheck(log=print)
    assert len(results) == len(compiled) >= 20  # every compiled recipe re-lowered
    moved = moved_recipes(results)
    assert not moved, "stale certificates (recompile with bench/tpu_compile_table.py, then python -m " \
        "titan_tpu.tools.recipe_table): " + "; ".join(f"{recipe}: {what}" for recipe, what in moved.items())
