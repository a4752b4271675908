"""LoRA as users run it: 2 fully_shard ranks (base weights and adapters sharded) against one
process, and kill -9 then restart, as real training processes (tests/test_train_dist.py; the
2-rank run on ranks forked from the fork server, the one-process reference in the test's process)."""

import subprocess

import pytest
from kill_fixtures import assert_resumed_once, kill_9_at_step
from test_train_dist import command, losses, overrides, thread_env, train, train_forked, train_here

pytestmark = pytest.mark.multiprocess

LORA = dict(lora__enabled="true", lora__rank=4, optimizer__lr=1e-2, training__steps=10, checkpoint__interval=5)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_dist_cache")


def test_two_fully_shard_ranks_match_one_process_with_two_micro_batches(tmp_path, cache):
    # The same global batch: 2 ranks x 2 sequences = 1 process x 2 micro-batches of 2.
    train_here(overrides(tmp_path / "one", cache, training__batch_size=2, training__grad_accum_steps=2, **LORA))
    # Two ranks forked from the fork server (the launcher is not the point: test_train_dist runs torchrun).
    stdout = train_forked(2, overrides(tmp_path / "two", cache, training__batch_size=2, parallelism__dp_shard=2,
                                       **LORA))
    assert "data parallel: fully_shard" in stdout
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == sorted(want) == list(range(1, 11))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_kill_9_then_restart_gives_identical_losses(tmp_path, cache):
    args = dict(LORA, training__deterministic="true", training__batch_size=2)
    train(1, overrides(tmp_path / "straight", cache, **args))
    run = tmp_path / "killed"
    proc = subprocess.Popen(command(1, overrides(run, cache, **args)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=thread_env())
    # After the first checkpoint (step 5), two steps or more before the end (step 10).
    kill_9_at_step(proc, run, 6, 7, timeout=120)
    proc.stderr.close()
    assert_resumed_once(run, train(1, overrides(run, cache, **args)).stdout, steps=args["training__steps"])
    assert losses(run) == losses(tmp_path / "straight")  # bitwise
