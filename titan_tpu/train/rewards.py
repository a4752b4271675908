"""Rewards for GRPO: the built-ins, a user's function named in the config, and the checks on what
they return.

A reward has TRL's signature: ``f(prompts, completions, **columns) -> list of floats``, one number
per completion. ``prompts`` and ``completions`` are aligned lists (a prompt repeated for each of
its samples): text, or for chat rows the messages and ``[{"role": "assistant", "content": text}]``.
``columns`` holds the prompt rows' other columns, aligned the same way, and ``completion_ids`` (the
sampled token ids, stop token excluded). Extra keyword arguments a function does not name go to
its ``**kwargs``.

`grpo.reward` names one or more, summed with `grpo.reward_weights`:

* ``exact_match``: 1.0 when the completion's final answer equals the row's answer column
  (`grpo.answer_column`, "answer"), else 0.0. The final answer is the text after the last
  ``####`` (GSM8K's mark), else the content of the last ``\\boxed{...}``, else the whole completion;
  stripped of surrounding white space on both sides before comparing;
* ``regex``: 1.0 when `grpo.reward_pattern` matches somewhere in the completion (re.search), else 0.0;
* ``length``: minus the completion's tokens over grpo.max_completion_length (in [-1, 0]): a
  penalty for long answers, to add to another reward with a small weight;
* ``module:function`` (an importable module) or ``path/to/file.py:function``: your function.

Mistakes are one line: a function that cannot be imported (the name and why); one that raises
(its error, with the prompt and the sample that made it raise); a result of the wrong type or
length, or a value that is not a finite number (which sample).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BUILTINS", "RewardError", "Rewards", "final_answer", "load_reward"]


class RewardError(ValueError):
    """A reward function that cannot be loaded or that failed on a sample (one line)."""


def _text(completion: Any) -> str:
    """A completion's text: the string, or the content of the assistant message (chat)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return completion


def final_answer(text: str) -> str:
    """The answer a completion ends with (module docstring, exact_match)."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    return text.strip()


def exact_match(prompts, completions, *, answer_column: str = "answer", **columns) -> list[float]:
    if answer_column not in columns:
        raise RewardError(f"grpo.reward exact_match reads the column {answer_column!r}, which the prompt rows do not "
                          f"have (columns: {', '.join(k for k in columns if k != 'completion_ids') or 'none'}); set "
                          "grpo.answer_column or add the column")
    return [float(final_answer(_text(c)) == str(a).strip()) for c, a in zip(completions, columns[answer_column])]


def regex(prompts, completions, *, pattern: str, **columns) -> list[float]:
    compiled = re.compile(pattern)
    return [float(compiled.search(_text(c)) is not None) for c in completions]


def length(prompts, completions, *, completion_ids, max_completion_length: int, **columns) -> list[float]:
    return [-len(ids) / max_completion_length for ids in completion_ids]


BUILTINS = {"exact_match": exact_match, "regex": regex, "length": length}


def load_reward(name: str, *, answer_column: str = "answer", pattern: str = "",
                max_completion_length: int = 1) -> Callable:
    """The reward `name` (module docstring) as a function of (prompts, completions, **columns)."""
    if name in BUILTINS:
        if name == "regex":
            if not pattern:
                raise RewardError("grpo.reward regex needs grpo.reward_pattern, the pattern a rewarded completion "
                                  "matches")
            try:
                re.compile(pattern)
            except re.error as e:
                raise RewardError(f"grpo.reward_pattern = {pattern!r} is not a regular expression ({e})") from None
        import functools

        options = {"exact_match": {"answer_column": answer_column}, "regex": {"pattern": pattern},
                   "length": {"max_completion_length": max_completion_length}}[name]
        return functools.wraps(BUILTINS[name])(functools.partial(BUILTINS[name], **options))
    module_name, sep, function = name.rpartition(":")
    if not sep or not module_name or not function:
        raise RewardError(f"grpo.reward = {name!r} is neither a built-in ({', '.join(BUILTINS)}) nor module:function "
                          "(or path/to/file.py:function)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            spec = importlib.util.spec_from_file_location(f"titan_tpu_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # a user's module: any error while importing it is theirs to fix
        raise RewardError(f"grpo.reward = {name!r}: cannot import {module_name} ({type(e).__name__}: {e}); check "
                          "the module's name and that it imports (PYTHONPATH)") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise RewardError(f"grpo.reward = {name!r}: {module_name} has no function {function!r}")
    return fn


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Rewards:
    """The run's rewards and weights: `score` gives each completion's weighted sum and each reward's values."""

    def __init__(self, names: list[str], weights: list[float], *, answer_column: str = "answer", pattern: str = "",
                 max_completion_length: int = 1):
        self.names = list(names)
        self.labels = [n.rpartition(":")[2] for n in names]  # metric names: a function's own name
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(names)
        self.functions = [load_reward(n, answer_column=answer_column, pattern=pattern,
                                      max_completion_length=max_completion_length) for n in names]

    def score(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[list[float], dict[str, float]]:
        """(the weighted sum per completion, each reward's mean over them, by its label: a
        built-in's name, a function's own name)."""
        totals, means = [0.0] * len(completions), {}
        for name, label, weight, fn in zip(self.names, self.labels, self.weights, self.functions):
            values = self._call(name, fn, prompts, completions, columns)
            totals = [t + weight * v for t, v in zip(totals, values)]
            means[label] = sum(values) / len(values)
        return totals, means

    def _call(self, name: str, fn: Callable, prompts: list, completions: list, columns: dict[str, list]) -> list[float]:
        try:
            values = fn(prompts, completions, **columns)
        except RewardError:
            raise
        except Exception as e:
            culprit = self._culprit(fn, prompts, completions, columns)
            raise RewardError(f"grpo.reward {name} raised {type(e).__name__}: {e} {culprit}") from None
        if hasattr(values, "tolist"):  # a tensor or an array
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"grpo.reward {name} returned {type(values).__name__}; return a list of one number per "
                              f"completion ({len(completions)})")
        if len(values) != len(completions):
            raise RewardError(f"grpo.reward {name} returned {len(values)} values for {len(completions)} completions; "
                              "return one number per completion")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(f"grpo.reward {name} returned {v!r} for completion {i} (prompt {_short(prompts[i])}, "
                                  f"sample {_short(completions[i])}); return finite numbers")
        return [float(v) for v in values]

    @staticmethod
    def _culprit(fn: Callable, prompts: list, completions: list, columns: dict[str, list]) -> str:
        """Which prompt and sample make `fn` raise, found by calling it on one completion at a time."""
        for i in range(len(completions)):
            try:
                fn(prompts[i:i + 1], completions[i:i + 1], **{k: v[i:i + 1] for k, v in columns.items()})
            except Exception:
                return f"on prompt {_short(prompts[i])} and sample {_short(completions[i])}"
        return f"on the batch of {len(completions)} completions (each alone passes)"
