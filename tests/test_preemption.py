"""Preemption: the local checkpoint tier (train/local_tier.py) and the grace budget of SIGTERM.

Resharding a local tier between 1 and 2 ranks runs in tests/test_checkpoint_dist.py's spawned job;
SIGTERM to a real process with a grace budget in tests/test_train_dist.py; the 300-step chaos run
with every kind of fault is bench/chaos.py.
"""

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import require_multiprocess_marker

from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train.checkpoint import rng_state
from titan_tpu.train.local_tier import LocalTier, LocalTierError

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")
REPO = Path(__file__).resolve().parent.parent


def state(step: int, size: int = 12) -> dict:
    return {"step": step, "model": {"layers.0.w": torch.full((size, 4), float(step))},
            "optimizer": {"step": step, "exp_avg": {"layers.0.w": torch.full((size, 4), 0.5 * step)}},
            "data": {"samples_consumed": 2 * step}, "rng": rng_state()}


def zeros(size: int = 12) -> dict:
    return {"model": {"layers.0.w": torch.zeros(size, 4)},
            "optimizer": {"step": -1, "exp_avg": {"layers.0.w": torch.zeros(size, 4)}}}


def test_a_failed_local_tier_write_leaves_the_previous_one(tmp_path, monkeypatch):
    tier = LocalTier(tmp_path, log=print)
    tier.save(1, state(1))

    def torn(obj, f, *args, **kwargs):  # the disk fills halfway through this rank's file
        f.write(b"PK\x03\x04 half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(LocalTierError, match=r"the local tier of step 2 could not be written in .* \(OSError: "
                                             r"\[Errno 28\] No space left on device\); the previous tier is intact"):
        tier.save(2, state(2))
    monkeypatch.undo()
    step, path = tier.newest()
    target = zeros()
    rest = tier.load(path, target)
    assert step == 1 and rest["step"] == 1 and rest["data"] == {"samples_consumed": 2}
    assert torch.equal(target["model"]["layers.0.w"], state(1)["model"]["layers.0.w"])
    assert target["optimizer"]["step"] == 1 and torch.equal(target["optimizer"]["exp_avg"]["layers.0.w"],
                                                            state(1)["optimizer"]["exp_avg"]["layers.0.w"])
    tier.save(3, state(3))  # the next save clears the torn file and the older tier
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    assert [p.name for p in (tmp_path / "step-00000003").iterdir()] == ["rank-0-of-1.pt"]


def test_pruning_survives_another_rank_removing_the_directory(tmp_path, monkeypatch):
    """Two ranks prune an old step's directory at once: the one that lists it after the other removed
    it goes on (seen in bench/chaos.py as a crash right after a successful save)."""
    tier = LocalTier(tmp_path, log=print)
    tier.save(1, state(1))
    gone = tmp_path / "step-00000000"  # listed, then removed by the other rank before this one looks inside
    glob, is_dir = Path.glob, Path.is_dir
    monkeypatch.setattr(Path, "glob", lambda self, pattern: [*glob(self, pattern), gone] if self == tmp_path
                        else glob(self, pattern))
    monkeypatch.setattr(Path, "is_dir", lambda self: True if self == gone else is_dir(self))
    tier.save(2, state(2))  # prunes step 1 and the vanished step 0 without an error
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


WRITER = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from titan_tpu.train.local_tier import LocalTier, LocalTierError
tier = LocalTier(sys.argv[1], log=print)
for step in range(1, 1000):
    tier.save(step, {"step": step, "model": {"w": torch.full((4_000_000,), float(step))}, "optimizer": {}})
    print(step, flush=True)
"""


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_kill_9_while_the_local_tier_is_written_leaves_the_previous_one(tmp_path):
    require_multiprocess_marker()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(REPO)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "1"  # one complete tier of 16 MB
    deadline = time.time() + 60
    while not list(tmp_path.glob("step-*/.rank-0-of-1.pt.tmp-*")):  # the next one is being written
        assert time.time() < deadline and proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = LocalTier(tmp_path, log=print)
    step, path = tier.newest()
    assert list(tmp_path.glob(f"step-{step + 1:08d}/.rank-0-of-1.pt.tmp-*")), "the kill landed inside a write"
    target = {"model": {"w": torch.zeros(4_000_000)}, "optimizer": {}}
    assert tier.load(path, target)["step"] == step
    assert torch.equal(target["model"]["w"], torch.full((4_000_000,), float(step)))


def test_sigterm_writes_the_local_tier_within_the_budget_and_it_resumes_bitwise(tmp_path, train_overrides, capsys):
    # Two trainers (stopped, resumed) and a straight reference, each a few steps of the debug model.
    common = dict(training__deterministic="true", validation__enabled="false", training__steps=4,
                  training__batch_size=2, training__seq_len=64, checkpoint__interval=100,
                  checkpoint__grace_seconds=60, checkpoint__local_dir=tmp_path / "local")
    assemble(build_config(LLAMA_DEBUG, train_overrides(output_dir=tmp_path / "straight", **common))).train()
    straight = losses(tmp_path / "straight")
    assert not list((tmp_path / "local").rglob("*.pt"))  # a finished run removes its local tier

    args = train_overrides(**common)
    first = assemble(build_config(LLAMA_DEBUG, args))
    first.saving.last_save_seconds = 1e9  # a persistent save that cannot fit: it waits for the next start
    train_step = first.train_step

    def preempted_during_step_2():
        if first.step + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the flag is set; the step still runs to its end
        return train_step()

    first.train_step = preempted_during_step_2
    summary = first.train()
    out = capsys.readouterr().out
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 2 and summary["checkpoint"] is None
    assert "grace budget 60 s: the local tier takes" in out
    assert "emergency save at step 2: " in out and "of the 60 s grace budget (within)" in out
    assert "persistent checkpoint deferred to the next start (the last one took 1000000000.0 s" in out

    torch.manual_seed(1234)  # a new process starts with unrelated global RNG state
    second = assemble(build_config(LLAMA_DEBUG, args))
    second.train()
    out = capsys.readouterr().out
    assert "resumed from the local tier" in out and "at step 2" in out and "writing it to the persistent tier" in out
    assert (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()  # written at the start
    resumed = losses(tmp_path / "run")
    assert resumed == straight  # bitwise, every step

    # After its second step a process checks that the budget also holds the step in flight.
    second.saving.check_step_in_flight(0.0)
    assert "may not hold" not in capsys.readouterr().out
    second.saving.check_step_in_flight(70.0)
    assert re.search(r"warning: checkpoint.grace_seconds = 60 may not hold an emergency save: a SIGTERM waits for the "
                     r"step in flight \(70.00 s here\), then writes the local tier \(\d+\.\d\d s\); set it to at "
                     r"least 14\d", capsys.readouterr().out)

    second.cfg.checkpoint.grace_seconds = 1e-6  # what train() checks at its start
    with pytest.raises(ValueError, match=r"checkpoint.grace_seconds = 1e-06 is too short for even the local tier: "
                                         r"writing it takes \d+\.\d\d s here .*; set it to at least \d+"):
        second.saving.check_grace_budget()


def losses(run: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
