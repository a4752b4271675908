"""fp8 on 2 SimpleFSDP ranks against one process (real training processes, forked from the fork
server as tests/test_lora_dist.py runs them)."""

import pytest
from test_train_dist import losses, overrides, train, train_forked

pytestmark = pytest.mark.multiprocess

FP8 = dict(fp8__enabled="true", optimizer__lr=3e-3, training__steps=6, checkpoint__enabled="false",
           validation__enabled="false")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_dist_cache")


def test_two_fully_shard_ranks_match_one_process_with_two_micro_batches(tmp_path, cache):
    """2 ranks x 2 sequences against 1 process x 2 micro-batches of 2, tensorwise scaling (one
    amax per tensor: where ranks could differ from one process): each rank's activations and
    gradients are one micro-batch's, so their scales are the same; the weights are gathered whole
    before they are quantised. Close, not bitwise: the gradients are summed in another order, and a
    value on an fp8 rounding boundary may round the other way."""
    train(1, overrides(tmp_path / "one", cache, training__batch_size=2, training__grad_accum_steps=2,
                       **FP8))
    stdout = train_forked(2, overrides(tmp_path / "two", cache, training__batch_size=2, parallelism__dp_shard=2,
                                       **FP8))
    assert "data parallel: fully_shard" in stdout
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=3e-4), step
