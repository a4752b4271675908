"""lm-eval benchmarks during training ([evaluation], evaluation/during_training.py) on one process: the scores
`titan-tpu eval --tasks` gives the step's checkpoint (which tests/test_harness*.py hold to lm-eval's
own HF backend), logged as eval/<task>/<metric> with lm-eval's JSON in the run; the training itself
unchanged by it (lm-eval reseeds the global generators); and the one-line refusals."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from harness_fixtures import write_tasks  # noqa: E402
from test_train_dist import losses, overrides, train_here  # noqa: E402

from titan_tpu.cli import main  # noqa: E402

TASKS = "tiny_choice,tiny_generate"  # contexts shorter than training.seq_len: the same windows as eval's


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_tasks")
    write_tasks(root, root / "datasets")
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_cache")


def evaluation(tasks_dir, **extra) -> dict:
    return {"evaluation__tasks": TASKS, "evaluation__include_path": str(tasks_dir), "evaluation__freq": 2,
            "evaluation__batch_size": 3, "training__steps": 4, "checkpoint__interval": 2, **extra}


def eval_rows(run_dir) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows
            if any(k.startswith("eval/") for k in r)}


@pytest.mark.parametrize("layout", [{}, {"model__scan_layers": "true", "activation_checkpoint__mode": "full"}],
                         ids=["unrolled", "scanned_full_ac"])
def test_scores_in_training_equal_eval_of_the_checkpoint(tmp_path, cache, tasks_dir, capsys, layout):
    """The scanned, checkpointed model generates by whole forwards (it has no cached path): the same
    scores as the checkpoint loaded unrolled."""
    run, plain = tmp_path / "run", tmp_path / "plain"
    train_here(overrides(run, cache, **evaluation(tasks_dir), **layout))
    train_here(overrides(plain, cache, training__steps=4, checkpoint__interval=2, **layout))
    assert losses(run) == losses(plain)  # bitwise: an evaluation leaves the run's random draws alone

    scores = eval_rows(run)
    assert sorted(scores) == [2, 4]
    assert {"eval/tiny_choice/acc", "eval/tiny_choice/acc_norm", "eval/tiny_generate/exact_match"} <= set(scores[2])
    written = json.loads((run / "lm_eval" / "step-2.json").read_text())["results"]
    assert written["tiny_choice"]["acc,none"] == scores[2]["eval/tiny_choice/acc"]

    capsys.readouterr()
    code = main(["eval", "--checkpoint", str(run / "checkpoints" / "step-00000002"), "--tasks", TASKS,
                 "--include-path", str(tasks_dir), "--model.name", "llama3", "--model.flavor", "debug",
                 "--device", "cpu", "--output", str(tmp_path / "step2.json")])
    _, err = capsys.readouterr()
    assert code == 0, err
    expected = json.loads((tmp_path / "step2.json").read_text())["results"]
    for task, metrics in expected.items():
        for key, value in metrics.items():
            metric, _, kind = key.partition(",")
            if kind == "none" and "stderr" not in metric:
                assert scores[2][f"eval/{task}/{metric}"] == pytest.approx(value, rel=1e-6), (task, metric)


@pytest.mark.parametrize("layout, message", [
    ({"parallelism__tp": 2}, "evaluation.tasks scores on the data-parallel ranks alone and this run has "
                             "parallelism.tp = 2; score its checkpoints with `titan-tpu eval --tasks` instead"),
    ({"evaluation__freq": 0}, "evaluation.freq = 0 must be >= 1"),
    ({"evaluation__limit": -1}, "evaluation.limit = -1 must be >= 0 (0: all documents)"),
], ids=["tp", "freq", "limit"])
def test_refusals_are_one_line(tmp_path, cache, tasks_dir, capsys, layout, message):
    args = overrides(tmp_path / "run", cache, **evaluation(tasks_dir, **layout))
    code = main(["train", "--config", "configs/llama3_debug.toml", *args])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_unknown_task_fails_before_the_first_step(tmp_path, cache, tasks_dir, capsys):
    args = overrides(tmp_path / "run", cache, **evaluation(tasks_dir, evaluation__tasks="tiny_choise"))
    code = main(["train", "--config", "configs/llama3_debug.toml", *args])
    out, err = capsys.readouterr()
    assert code == 2 and "unknown lm-eval task tiny_choise (closest: tiny_choice" in err, err
    assert "step 1/" not in out
