"""Tokenizing inside a run: a run refuses to tokenize a source above data.tokenize_limit_mb itself
and names `titan-tpu prepare-data` in one line; ranks that wait while rank 0 tokenizes wait on the
rendezvous store, so a tokenizer slower than the process group's timeout does not end the run."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from data_fixtures import make_docs, write_jsonl
from dist_utils import run_distributed

from titan_tpu.cli import main as cli_main
from titan_tpu.config import build_config
from titan_tpu.data.build import prepare_data
from titan_tpu.run.setup import prepare_run

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "llama3_debug.toml"


def _corpus(tmp_path: Path, n: int = 400) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in make_docs(n, seed=1)])


def _run_overrides(tmp_path: Path, corpus: Path, **extra) -> list[str]:
    values = {"output_dir": tmp_path / "run", "data.source": corpus, "data.cache_dir": tmp_path / "cache",
              "training.device": "cpu", "training.steps": 2, "training.batch_size": 2, "training.seq_len": 64,
              "lr_scheduler.warmup_steps": 1, "metrics.log_freq": 1, "metrics.tensorboard": "false",
              "validation.enabled": "false", "checkpoint.enabled": "false", **extra}
    return [a for key, value in values.items() for a in (f"--{key.replace('__', '.')}", str(value))]


def _prepare_as_a_run(overrides: list[str]):
    setup = prepare_run(build_config(CONFIG, overrides))
    cfg = setup.cfg
    return prepare_data(cfg.data, setup.sources, vocab_size=setup.spec.args.vocab_size,
                        tokenizer_path=setup.tokenizer_path, cache_dir=cfg.data.cache_dir, log=lambda m: None,
                        tokenize_limit_mb=cfg.data.tokenize_limit_mb)


def test_a_run_refuses_a_source_above_the_limit_in_one_line_and_prepare_data_lifts_it(tmp_path):
    corpus = _corpus(tmp_path)
    mb = corpus.stat().st_size / 1e6
    overrides = _run_overrides(tmp_path, corpus, data__tokenize_limit_mb=mb / 2)
    # No tokenizer yet: the BPE it would train reads the whole source, so that is refused first.
    with pytest.raises(ValueError) as refused:
        _prepare_as_a_run(overrides)
    message = str(refused.value)
    assert "\n" not in message and "training a BPE tokenizer on" in message and "titan-tpu prepare-data" in message
    assert f"data.tokenize_limit_mb = {mb / 2:g}" in message
    assert not (tmp_path / "cache" / "tokens").exists()  # nothing half-built

    # prepare-data (no limit) tokenizes it ahead; the same run then opens the cache without a word.
    assert cli_main(["prepare-data", "--config", str(CONFIG), "--workers", "1", *overrides]) == 0
    prepared = _prepare_as_a_run(overrides)
    assert prepared.train[0].shards.num_documents == 400

    # A tokenizer that exists but tokens that do not: the source itself is refused.
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": d} for d in make_docs(400, seed=2)])
    tokenizer = next((tmp_path / "cache" / "tokenizers").glob("bpe-*/tokenizer.json"))
    with pytest.raises(ValueError, match=r"^data: tokenizing 'other' \(0.1 MB on disk\) is more than a run does"):
        _prepare_as_a_run(_run_overrides(tmp_path, other, data__tokenizer_path=tokenizer,
                                         data__tokenize_limit_mb=mb / 2))
    # Under the limit (or with no limit, 0) a run tokenizes it itself, as before.
    _prepare_as_a_run(_run_overrides(tmp_path, other, data__tokenizer_path=tokenizer, data__tokenize_limit_mb=0))


PG_TIMEOUT_S = 6.0  # the process group's timeout in this test, standing in for the real one (30 min)
TOKENIZE_S = 2.5 * PG_TIMEOUT_S  # what rank 0's tokenizing takes here (a sleep before the real build)


def _train_with_a_slow_tokenizer(config: str, overrides: list[str]) -> dict:
    """A rank: the trainer with rank 0's token-shard build made TOKENIZE_S slower; then a barrier on
    a group of the same timeout that the other rank never enters, to show that such a wait fails."""
    import contextlib
    import io

    import torch.distributed as dist

    import titan_tpu.data.prepare as prepare
    from titan_tpu.loops import assemble

    real_build = prepare.build_shards

    def slow_build(*args, **kwargs):
        time.sleep(TOKENIZE_S)
        return real_build(*args, **kwargs)

    prepare.build_shards = slow_build
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    printed = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(printed):
        summary = assemble(build_config(config, overrides)).train()
    seconds = time.monotonic() - start
    barrier_failed = None
    if dist.get_rank() == 1:  # the old wait: rank 0 does not come (busy); the barrier gives up after the timeout
        try:
            dist.barrier(group=control)
            barrier_failed = False
        except Exception as e:  # gloo: "Timed out waiting ... for recv"
            barrier_failed = type(e).__name__
    return {"step": summary["step"], "seconds": seconds, "printed": printed.getvalue(),
            "barrier_failed": barrier_failed}


@pytest.mark.multiprocess
def test_two_ranks_outwait_a_tokenizer_slower_than_the_process_group_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_TPU_PEAK_FLOPS", "1e11")  # no matmul peak measured: not what this test is about
    corpus = _corpus(tmp_path)
    overrides = _run_overrides(tmp_path, corpus)
    results = run_distributed(_train_with_a_slow_tokenizer, world_size=2, args=(str(CONFIG), overrides),
                              pg_timeout_s=PG_TIMEOUT_S, timeout_s=240)
    # Both ranks trained to the end, and rank 1 waited for rank 0's tokenizing longer than the timeout.
    assert [r["step"] for r in results] == [2, 2]
    assert all(r["seconds"] > TOKENIZE_S > PG_TIMEOUT_S for r in results)
    assert "data: tokenized" in results[0]["printed"]
    # The same wait as a barrier of that timeout fails: the timeout is real.
    assert results[1]["barrier_failed"] not in (None, False), results[1]["barrier_failed"]
