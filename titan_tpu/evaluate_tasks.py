"""`titan-tpu eval --tasks`: lm-evaluation-harness benchmarks (hellaswag, arc_easy, ... or task YAMLs
of one's own under --include-path) of any model `titan-tpu eval` loads, through `HarnessLM`
(harness.py). Prints lm-eval's table and writes its results JSON beside the weights (a checkpoint
step-N -> step-N.lm_eval.json, an HF directory DIR -> DIR.lm_eval.json) or to --output.

lm-eval is optional (the `eval` extra): imported only here, after a check that names the install line.
"""

from __future__ import annotations

import difflib
import functools
import json
import sys
from pathlib import Path

LM_EVAL_INSTALL = "pip install 'lm-eval>=0.4,<0.5' (or the eval extra: pip install -e '.[eval]')"


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(f"titan-tpu eval --tasks needs lm-evaluation-harness, which is not installed: "
                         f"{LM_EVAL_INSTALL}") from None


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None):
    """lm-eval's tasks and those under include_path (a folder of task YAMLs). Kept for the process:
    indexing lm-eval's own (some 15,000 names) takes seconds."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path {include_path} is not a directory; give a folder of task YAMLs")
    return TaskManager(include_path=include_path)


def check_task_names(tasks: list[str], known: list[str]) -> None:
    """One line naming the closest known names for each task lm-eval does not have."""
    unknown = [task for task in tasks if task not in known]
    if not unknown:
        return
    hints = [f"{task} (closest: {', '.join(difflib.get_close_matches(task, known, n=3, cutoff=0.5)) or 'none'})"
             for task in unknown]
    raise ValueError(f"unknown lm-eval task {'; '.join(hints)}; list them with `lm-eval ls tasks`, or add a "
                     "folder of task YAMLs with --include-path")


def default_results_path(weights: str) -> Path | None:
    """Beside the weights: a checkpoint step directory or an HF directory DIR -> DIR.lm_eval.json; a
    seeded init has no such place (None)."""
    path = Path(weights)
    return path.with_name(path.name + ".lm_eval.json") if path.is_dir() else None


def run_tasks(setup, *, checkpoint: str | None, tasks: list[str], num_fewshot: int | None, limit: float | None,
              batch_size: int, include_path: str | None, output: str | None) -> dict:
    """lm-eval's results (its dict) of the run setup's model (`checkpoint`'s weights) on `tasks`."""
    require_lm_eval()
    import lm_eval
    from lm_eval.utils import handle_non_serializable, make_table

    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.device import get_backend
    from titan_tpu.evaluate import load_eval_model
    from titan_tpu.harness import HarnessLM

    cfg = setup.cfg
    manager = task_manager(include_path)
    check_task_names(tasks, manager.all_tasks)
    loaded = load_eval_model(cfg, checkpoint=checkpoint, device=get_backend(cfg.training.device).device,
                             spec=setup.spec)
    tokenizer_path = cfg.data.tokenizer_path or loaded.tokenizer
    if not tokenizer_path:
        raise ValueError("eval --tasks needs the model's tokenizer: pass --data.tokenizer_path TOKENIZER_JSON, or a "
                         "model directory or checkpoint run that holds tokenizer.json")
    model = HarnessLM(loaded.model, load_tokenizer(tokenizer_path), max_length=loaded.max_len, batch_size=batch_size,
                      seed=cfg.training.seed)
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=False)
    results["config"]["model"] = loaded.spec.label
    results["config"]["weights"] = loaded.weights
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    path = Path(output) if output else default_results_path(loaded.weights)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        print(f"results: {path}", file=sys.stderr)
    return results
