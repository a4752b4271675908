"""lm-evaluation-harness tasks (hellaswag, arc_easy, ... or task YAMLs of one's own under an include
path) for `HarnessLM` (harness.py): what `titan-tpu eval --tasks` (tasks.py) and the
[evaluation] section during training (during_training.py) both ask of lm-eval.

`TaskSettings` is that ask; `load_tasks` reads the tasks and their data once, with a one-line error
for a name lm-eval does not know and for data neither cached nor reachable; `score` runs lm-eval
over loaded tasks without touching the caller's random state; `task_metrics` turns its results
into metrics-row keys.

lm-eval is optional (the `eval` extra): imported only inside functions, after `require_lm_eval`
(extras.py).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Builders of datasets from local files (lm-eval's dataset_path with data_files), not Hub names.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


@dataclass(frozen=True)
class TaskSettings:
    """What a run asks of lm-eval: the tasks, and how (as lm-eval's command line names them)."""

    tasks: tuple[str, ...]
    num_fewshot: int | None = None  # None: each task's own
    limit: float | None = None  # documents per task at most; below 1: that fraction
    batch_size: int = 8
    include_path: str | None = None  # a folder of task YAMLs of one's own
    apply_chat_template: bool = False  # render prompts with the tokenizer's chat template
    system_instruction: str | None = None


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None):
    """lm-eval's tasks and those under include_path (a folder of task YAMLs). Kept for the process:
    indexing lm-eval's own (some 15,000 names) takes seconds."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path {include_path} is not a directory; give a folder of task YAMLs")
    return TaskManager(include_path=include_path)


def check_task_names(tasks: list[str] | tuple[str, ...], known: list[str]) -> None:
    """One line naming the closest known names for each task lm-eval does not have."""
    unknown = [task for task in tasks if task not in known]
    if not unknown:
        return
    hints = [f"{task} (closest: {', '.join(difflib.get_close_matches(task, known, n=3, cutoff=0.5)) or 'none'})"
             for task in unknown]
    raise ValueError(f"unknown lm-eval task {'; '.join(hints)}; list them with `lm-eval ls tasks`, or add a "
                     "folder of task YAMLs with --include-path")


def load_tasks(settings: TaskSettings) -> list:
    """lm-eval's Task and Group objects of `settings.tasks`, their data read (from the datasets cache,
    a task's local data_files, or the Hub when it is reachable)."""
    manager = task_manager(settings.include_path)
    check_task_names(settings.tasks, manager.all_tasks)
    loaded = []
    with _cache_only_where_the_hub_is_unreachable():
        built_tasks = []
        for name in settings.tasks:
            try:
                built_tasks.append((name, manager.load([name])))
            except (ConnectionError, FileNotFoundError) as error:
                raise ValueError(_missing_data(name, error)) from None
    for name, built in built_tasks:
        # a group scores as one (its subtasks' aggregate); a tag is its tasks
        if name in built["groups"]:
            loaded.append(built["groups"][name])
        else:
            loaded.extend([built["tasks"][name]] if name in built["tasks"] else built["tasks"].values())
    return loaded


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection (one try). Behind a proxy
    (HTTPS_PROXY) a direct connection says nothing: taken as reachable."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _cache_only_where_the_hub_is_unreachable():
    """Reading a task's data, datasets asks the Hub first and, offline, retries five times (about
    25 s) before it looks in its cache: where the Hub does not answer one connection, read the cache
    only (datasets' and huggingface_hub's offline mode), so cached data loads at once and missing
    data fails at once."""
    import datasets
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _missing_data(name: str, error: Exception) -> str:
    """One line on a task whose data could not be read: which dataset, and how to fetch it."""
    config = _failing_task_config(error)
    subtask = getattr(config, "task", None) or name
    path = getattr(config, "dataset_path", None)
    if path in LOCAL_BUILDERS:
        files = (getattr(config, "dataset_kwargs", None) or {}).get("data_files")
        return (f"lm-eval task {subtask}: its data files {files} are missing ({error}); fix data_files in the task's "
                "YAML")
    dataset = f"{path}{f' ({config.dataset_name})' if getattr(config, 'dataset_name', None) else ''}" if path else ""
    import datasets

    return (f"lm-eval task {subtask}: its data {dataset or ''} is not in the datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}) and cannot be downloaded here; fetch it on a machine with network "
            f"with `python -c \"from lm_eval.tasks import TaskManager; TaskManager().load(['{name}'])\"` and copy "
            "that cache here (or point HF_HOME at a shared one)")


def _failing_task_config(error: Exception) -> Any:
    """The config of the lm-eval task whose data loading raised `error` (its frames hold the task)."""
    from lm_eval.api.task import Task

    traceback, config = error.__traceback__, None
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if isinstance(owner, Task):
            config = owner.config
        traceback = traceback.tb_next
    return config


def chat_renderer(tokenizer_path: str | Path, choice: str = ""):
    """The chat template lm-eval's apply_chat_template renders with: data.chat_template's choice, else
    the tokenizer's own; a one-line error when there is none."""
    from titan_tpu.data.chat import ChatRenderer, load_chat_template

    try:
        template, special = load_chat_template(tokenizer_path, choice)
    except ValueError:
        raise ValueError(f"--apply-chat-template renders prompts with the tokenizer's chat template, and "
                         f"{str(tokenizer_path)!r} has none; drop --apply-chat-template, or give one with "
                         "--data.chat_template chatml (or a .jinja file)") from None
    return ChatRenderer(template, tokenizer=None, special_tokens=special)


@contextlib.contextmanager
def _own_random_state():
    """lm-eval seeds Python's, NumPy's and torch's generators; a training run's draws go on after it
    as if it had not run."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def score(lm, tasks: list, settings: TaskSettings, *, bootstrap_iters: int = 100000,
          verbosity: str | None = None) -> dict | None:
    """lm-eval's results of `lm` on loaded `tasks` (None on every process but the first)."""
    import lm_eval

    limit = settings.limit
    limit = int(limit) if limit is not None and limit >= 1 else limit
    with _own_random_state():
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=settings.num_fewshot, limit=limit,
                                       task_manager=task_manager(settings.include_path), log_samples=False,
                                       apply_chat_template=settings.apply_chat_template,
                                       system_instruction=settings.system_instruction,
                                       bootstrap_iters=bootstrap_iters, verbosity=verbosity)


def task_metrics(results: dict) -> dict[str, float]:
    """The scores of lm-eval's results as metrics-row keys: eval/<task>/<metric>, the filter named
    when it is not lm-eval's "none" (eval/gsm8k/exact_match/strict-match); no standard errors."""
    row = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, _, kind = key.partition(",")
                if not kind or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                row[f"eval/{task}/{metric}{'' if kind == 'none' else '/' + kind}"] = float(value)
    return row


def write_results(results: dict, path: Path) -> None:
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
