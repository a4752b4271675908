"""`titan-tpu eval --tasks`: lm-evaluation-harness benchmarks of any model `titan-tpu eval` loads
(a checkpoint, an HF directory, a recipe's model), through `HarnessLM` (harness.py).
Prints lm-eval's table and writes its results JSON beside the weights (a checkpoint step-N ->
step-N.lm_eval.json, an HF directory DIR -> DIR.lm_eval.json) or to --output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_tpu.evaluation.lm_eval_tasks import (
    TaskSettings,
    chat_renderer,
    check_task_names,
    load_tasks,
    score,
    task_manager,
    write_results,
)
from titan_tpu.extras import require_lm_eval


def default_results_path(weights: str) -> Path | None:
    """Beside the weights: a checkpoint step directory or an HF directory DIR -> DIR.lm_eval.json; a
    seeded init has no such place (None)."""
    path = Path(weights)
    return path.with_name(path.name + ".lm_eval.json") if path.is_dir() else None


def run_tasks(setup, *, checkpoint: str | None, settings: TaskSettings, output: str | None) -> dict:
    """`titan-tpu eval --tasks`: lm-eval's results (its dict) of the run setup's model (`checkpoint`'s
    weights), its table printed and its JSON written."""
    require_lm_eval()
    from lm_eval.utils import make_table

    from titan_tpu.data.tokenizer import load_tokenizer
    from titan_tpu.device import get_backend
    from titan_tpu.evaluation.harness import HarnessLM
    from titan_tpu.evaluation.loss import load_eval_model

    cfg = setup.cfg
    # A task name lm-eval lacks is named before the model loads; the tasks' data is read after every
    # check of the model's side (its tokenizer, its chat template), so those errors come first, alone.
    check_task_names(settings.tasks, task_manager(settings.include_path).all_tasks)
    backend = get_backend(cfg.training.device)  # one device: on a TPU VM auto finds a chip through torch-tpu
    loaded = load_eval_model(cfg, checkpoint=checkpoint, device=backend.device, spec=setup.spec)
    tokenizer_path = cfg.data.tokenizer_path or loaded.tokenizer
    if not tokenizer_path:
        raise ValueError("eval --tasks needs the model's tokenizer: pass --data.tokenizer_path TOKENIZER_JSON, or a "
                         "model directory or checkpoint run that holds tokenizer.json")
    chat = chat_renderer(tokenizer_path, cfg.data.chat_template) if settings.apply_chat_template else None
    model = HarnessLM(loaded.model, load_tokenizer(tokenizer_path), max_length=loaded.max_len,
                      batch_size=settings.batch_size, seed=cfg.training.seed, chat=chat)
    tasks = load_tasks(settings)  # after every check of the model's side (their own one-line errors)
    print(f"eval: scoring on {backend.device} ({backend.chosen_because}), the model in fp32", file=sys.stderr)
    results = score(model, tasks, settings)
    results["config"]["model"] = loaded.spec.label
    results["config"]["weights"] = loaded.weights
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    path = Path(output) if output else default_results_path(loaded.weights)
    if path is not None:
        write_results(results, path)
        print(f"results: {path}", file=sys.stderr)
    return results
