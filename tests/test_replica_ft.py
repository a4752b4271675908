"""Replica fault tolerance (train/replica_ft.py): 2 replica groups on CPU gloo, one killed and restarted.

The longer run with several faults, and what each costs, is bench/replica_ft.py.
"""

import importlib.util
import random
import statistics
import threading
from pathlib import Path

import pytest
import torch
from dist_utils import require_multiprocess_marker

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("replica_ft_bench", ROOT / "bench" / "replica_ft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.multiprocess
def test_a_killed_replica_group_rejoins_with_the_survivors_weights(tmp_path):
    require_multiprocess_marker()
    bench = _bench()
    kill_step = random.Random(51).randint(15, 30)
    steps, down = 110, 8
    runs = {}

    def run(name, kills):
        runs[name] = bench.run_pair(tmp_path, name, steps, kills, step_sleep=0.04, down_steps=down)

    reference = threading.Thread(target=run, args=("ref", []))  # the uninterrupted run, alongside
    reference.start()
    run("ft", [kill_step])
    reference.join()
    ft, ref = runs["ft"], runs["ref"]
    (fault,) = ft["faults"]

    # the survivor kept stepping alone while its peer was down, and only then
    survivor = ft["r0"]
    alone = [r["step"] for r in survivor if r["members"] == 1]
    assert fault["survivor_steps_while_down"] >= down
    assert len(alone) >= down and min(alone) >= fault["killed_at"] and max(alone) < fault["rejoined_at"]
    # the restarted group rejoined from the survivor's state at the survivor's step, then stepped together
    assert fault["recovered_from"] == [0] and fault["rejoined_at"] > fault["killed_at"] + down
    assert all(r["members"] == 2 for r in ft["r1"] if r["step"] >= fault["rejoined_at"])
    assert survivor[-1]["step"] == ft["r1"][-1]["step"] == steps
    # bitwise the same weights at the end
    final0, final1 = torch.load(ft["final0"]), torch.load(ft["final1"])
    for key, value in final0["model"].items():
        assert torch.equal(value, final1["model"][key]), key
    # the loss stays within the step-to-step noise of the uninterrupted run
    noise = statistics.stdev(r["loss"] for r in ref["r0"][-30:])
    assert abs(final0["eval_loss"] - torch.load(ref["final0"])["eval_loss"]) < noise
