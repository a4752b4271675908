"""lm-eval benchmarks during training on 2 ranks (SimpleFSDP dp_shard 2 and dp_replicate 2): every
rank scores its share of the requests and the scores equal one process's, the same training run
on one process (the same global batch). The shares are uneven (an odd number of documents, one
that spans several windows), so a rank runs forwards and generation steps with nothing to score
while the other scores its last batch: the sharded weights are gathered in every one."""

from __future__ import annotations

import json

import pytest
from dist_utils import train_on_ranks

pytest.importorskip("lm_eval")

from harness_fixtures import TASKS, write_tasks  # noqa: E402
from test_evaluation import eval_rows  # noqa: E402
from test_train_dist import CONFIG, losses, overrides, train_here  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_tasks")
    write_tasks(root, root / "datasets")
    with (root / "generate.jsonl").open("a") as rows:  # a fifth question: 3 and 2 for the ranks
        rows.write(json.dumps({"question": "the red door", "answer": "on"}) + "\n")
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval_cache")


def evaluation(tasks_dir) -> dict:
    return {"evaluation__tasks": ",".join(TASKS), "evaluation__include_path": str(tasks_dir),
            "evaluation__freq": 2, "evaluation__batch_size": 2, "training__steps": 2,
            "checkpoint__enabled": "false"}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache, tasks_dir):
    run = tmp_path_factory.mktemp("one") / "run"
    train_here(overrides(run, cache, training__batch_size=4, **evaluation(tasks_dir)))
    return run


@pytest.mark.parametrize("layout", [{"parallelism__dp_shard": 2}, {"parallelism__dp_replicate": 2,
                                                                    "parallelism__dp_shard": 1}],
                         ids=["dp_shard2", "dp_replicate2"])
def test_two_ranks_score_as_one_process(tmp_path, cache, tasks_dir, one_process, layout):
    run = tmp_path / "run"
    train_on_ranks(CONFIG, overrides(run, cache, training__batch_size=2, **evaluation(tasks_dir), **layout))
    assert losses(run) == pytest.approx(losses(one_process), abs=1e-5)
    got, expected = eval_rows(run), eval_rows(one_process)
    assert sorted(got) == sorted(expected) == [2]
    assert {key.split("/")[1] for key in expected[2]} == set(TASKS)
    assert got[2] == pytest.approx(expected[2], rel=1e-5)
    written = json.loads((run / "lm_eval" / "step-2.json").read_text())
    assert written["n-samples"] == json.loads((one_process / "lm_eval" / "step-2.json").read_text())["n-samples"]
