"""A recipe's comments agree with its own numbers: the tokens per step a comment states are the
recipe's data-parallel ranks x batch_size x seq_len (x grad_accum_steps), written out in that
order with the exact product. Every recipe with a fixed mesh states them, so a reader sees the
global batch without doing the arithmetic. (The launch commands in the headers are parsed by
tests/test_docs_commands.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from titan_tpu.config import build_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(CONFIGS.glob("*.toml"))
# "4 devices x 2 x 4,096 = 32,768 tokens per step": numbers, each maybe followed by one word.
_FACTOR = r"[\d,]+(?: [a-z-]+)?"
STATEMENT = re.compile(rf"({_FACTOR}(?: x {_FACTOR})+) = ([\d,.]+[kMB]?) tokens per step")
_NUMBER = re.compile(r"[\d,]+")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def stated_tokens(text: str) -> list[tuple[list[int], str]]:
    """(factors, the stated total as written) of every tokens-per-step statement in `text`."""
    return [([_int(_NUMBER.match(f.strip()).group()) for f in factors.split(" x ")], total)
            for factors, total in STATEMENT.findall(text)]


def tokens_per_step(path: Path) -> tuple[list[int], int] | None:
    """(the factors in the stated order, their product) for a recipe with a fixed mesh, else None."""
    cfg = build_config(path)
    t, p = cfg.training, cfg.parallelism
    if p.dp_shard < 1:  # the mesh is set at launch (-1: every rank that dp_replicate leaves)
        return None
    factors = [p.dp_replicate * p.dp_shard, t.batch_size, t.seq_len]
    if t.objective == "dpo":  # batch_size counts pairs: a chosen and a rejected row each
        factors = [p.dp_replicate * p.dp_shard, t.batch_size, 2, t.seq_len]
    if t.grad_accum_steps > 1:
        factors.append(t.grad_accum_steps)
    total = 1
    for f in factors:
        total *= f
    return factors, total


def check_statements(text: str, expected: tuple[list[int], int] | None) -> list[str]:
    problems = []
    for factors, total in stated_tokens(text):
        product = 1
        for f in factors:
            product *= f
        if not re.fullmatch(r"[\d,]+", total) or _int(total) != product:
            problems.append(f"{' x '.join(map(str, factors))} = {total}: the product is {product:,}; write it exactly")
        elif expected is None:
            problems.append(f"states {total} tokens per step, but the mesh is set at launch: drop the statement")
        elif factors != expected[0]:
            problems.append(f"states {' x '.join(map(str, factors))}; the recipe's data-parallel ranks x batch_size x "
                            f"seq_len (DPO: x 2 rows per pair after batch_size; x grad_accum_steps when > 1) are "
                            f"{' x '.join(map(str, expected[0]))} = {expected[1]:,}")
    return problems


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_stated_tokens_per_step_are_the_recipes(path):
    text = path.read_text()
    expected = tokens_per_step(path)
    problems = check_statements(text, expected)
    if expected is not None and path.stem.endswith("_tpu") and not stated_tokens(text):
        problems.append("states no tokens per step; put 'N ranks x batch_size x seq_len = T tokens per step' beside "
                        "batch_size")
    assert not problems, "\n".join(problems)


def test_the_check_catches_wrong_arithmetic_and_wrong_factors():
    expected = ([4, 2, 4096], 32768)
    assert check_statements("per chip: 4 chips x 2 x 4,096 = 32,768 tokens per step", expected) == []
    assert check_statements("per chip: 4 x 2 x 4,096 = 0.0M tokens per step", expected)  # not the product
    assert check_statements("32 x 4096 = 131,072 tokens per step", ([16, 2, 4096], 131072))  # not the factors
    assert check_statements("32 x 2 x 4,096 = 262,144 tokens per step", None)  # a mesh set at launch
