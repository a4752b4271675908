"""Replica fault tolerance (train/replica_ft.py): 2 replica groups on CPU gloo, one killed and restarted.

First the library with the bench's worker (a small MLP, against an uninterrupted run); then the
same as a user runs it: `titan-tpu train --fault_tolerance.*` per group, a lighthouse beside them.
The longer run with several faults, and what each costs, is bench/replica_ft.py.
"""

import importlib.util
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import require_multiprocess_marker

from titan_tpu.train.checkpoint import load_full_state_dict
from titan_tpu.train.goodput import read_processes, totals
from titan_tpu.train.replica_ft import Lighthouse

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
        # a heartbeat timeout of 2 s: on a loaded 2-core machine a live group's heartbeat thread can
        # wait half a second for a core, and the lighthouse would drop it
        runs[name] = bench.run_pair(tmp_path, name, steps, kills, step_sleep=0.04, down_steps=down,
                                    heartbeat_timeout=2.0)

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


def test_a_lighthouse_that_does_not_answer_is_one_line():
    from titan_tpu.errors import RunError
    from titan_tpu.train.replica_ft import check_lighthouse

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RunError, match=f"start it first with titan-tpu lighthouse --port {port} --replicas 2"):
        check_lighthouse("127.0.0.1", port, 1.0, replicas=2)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if "loss" in r]


def _last_step(run_dir: Path) -> int:
    rows = _rows(run_dir)
    return rows[-1]["step"] if rows else 0


def _wait(cond, procs: dict, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        for r, p in procs.items():
            assert p.poll() is None, f"replica group {r} exited with {p.returncode}"
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_titan_tpu_train_groups_survive_a_killed_group(tmp_path, data_cache):
    require_multiprocess_marker()
    lighthouse = Lighthouse(0, max_replicas=2, heartbeat_timeout=2.0, initial_replicas=2)  # 2 s: see above
    stop = threading.Event()
    threading.Thread(target=lighthouse.run, args=(stop,), daemon=True).start()
    run = tmp_path / "run"
    logs = {0: tmp_path / "group0.log", 1: tmp_path / "group1.log"}

    def start(replica: int) -> subprocess.Popen:
        args = {"output_dir": run, "data.cache_dir": data_cache, "data.max_bytes": 1_500_000,
                "training.device": "cpu", "training.batch_size": 4, "training.seq_len": 64,
                "training.steps": 1000,  # ended by SIGTERM once the groups hold a common checkpoint after the rejoin
                "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_ratio": 0, "metrics.log_freq": 1,
                "metrics.tensorboard": "false", "validation.enabled": "false", "checkpoint.interval": 5,
                "checkpoint.keep_latest_k": 0, "fault_tolerance.enabled": "true",
                "fault_tolerance.replica_id": replica, "fault_tolerance.lighthouse": f"127.0.0.1:{lighthouse.port}",
                "fault_tolerance.timeout_seconds": 10}
        argv = [item for key, value in args.items() for item in (f"--{key}", str(value))]
        return subprocess.Popen([sys.executable, "-m", "titan_tpu", "train", "--config",
                                 str(ROOT / "configs" / "llama3_debug.toml"), *argv],
                                stdout=logs[replica].open("a"), stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))

    groups = {0: start(0), 1: start(1)}
    dirs = {r: run / f"replica_{r}" for r in groups}
    try:
        kill_at = random.Random(51).randint(6, 9)  # after the checkpoint of step 5
        _wait(lambda: _last_step(dirs[1]) >= kill_at, groups)
        groups[1].send_signal(signal.SIGKILL)
        groups[1].wait()
        killed_at = _last_step(dirs[1])
        procs = {0: groups[0]}
        _wait(lambda: _last_step(dirs[0]) >= killed_at + 4, procs)  # the survivor steps on alone
        groups[1] = start(1)  # the same command again
        _wait(lambda: "took step" in logs[1].read_text(), groups)
        rejoined_at = int(re.search(r"took step (\d+) from replica 0", logs[1].read_text()).group(1))
        common = (rejoined_at // 5 + 2) * 5  # a checkpoint both write after the rejoin

        def written(r):
            return (dirs[r] / "checkpoints" / f"step-{common:08d}" / "checkpoint.json").exists()

        _wait(lambda: written(0) and written(1), groups)
    finally:
        for p in groups.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in groups.values()]
        stop.set()
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs.values()]

    # The survivor stepped alone while its peer was down, in the gradient average of one group.
    alone = [r["step"] for r in _rows(dirs[0]) if r["replica_groups"] == 1]
    assert len(alone) >= 4 and min(alone) >= killed_at and max(alone) <= rejoined_at, (alone, killed_at, rejoined_at)
    # The restarted group resumed from its own checkpoint, then took the survivor's state at its step.
    assert rejoined_at > killed_at + 3
    assert all(r["replica_groups"] == 2 for r in _rows(dirs[1]) if r["step"] > rejoined_at)
    # Bitwise the same weights and optimizer state after the rejoin.
    for key in ("model", "optimizer"):
        a, b = (load_full_state_dict(dirs[r] / "checkpoints" / f"step-{common:08d}", key=key) for r in (0, 1))
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), (key, name)
    # Goodput: the restarted group's process counts as a restart.
    total = totals(read_processes(dirs[1]))
    assert total["restarts"] == 1 and total["seconds"]["restart"] > 0
