"""Pipeline stages in training (parallelism.pp, parallel/pipeline.py) against one process taking the
same micro-batches by gradient accumulation: GPipe and circular schedules, as many micro-batches as
stages and more, pp with fully sharded data parallelism, the captured step with full activation
checkpointing; checkpoints written with pp 2 resumed with pp 1 and pp 3 (DCP re-splits the stack's
layers); kill -9 of both stages and a restart, bitwise. The llama3 debug model has 6 layers, so pp 4
(4 x repeats, or 4 alone) does not divide it; pp 3 stands in for a stage count other than 2, and
pp 2 x 2 or 4 repeats for layers padded to equal chunks (8 rows), checkpointed without the padding."""

from __future__ import annotations

import json

import pytest
from test_train_dist import cache, losses, overrides, train_forked, train_here  # noqa: F401

pytestmark = pytest.mark.multiprocess

# 10 steps, resumed runs from the checkpoint of step 5 (as tests/test_train_dist.py): a stage layout
# that computed a different gradient, or a checkpoint that lost state, shows in the first step after
# it; more steps only cost time (20 took about twice as long per eager run). The kill -9 test keeps its own 20.
STEPS = 10
HALF = STEPS // 2
SCANNED = {"model__scan_layers": "true", "training__steps": STEPS, "checkpoint__interval": HALF}
CHECKPOINT = f"step-{HALF:08d}"


def grad_norms(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in rows if "grad_norm" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):  # noqa: F811
    """One process, 4 micro-batches of 1 row accumulated per step."""
    run = tmp_path_factory.mktemp("reference") / "run"
    train_here(overrides(run, cache, training__batch_size=1, training__grad_accum_steps=4, **SCANNED))
    return run


def assert_same_run(got_dir, reference_dir, *, first: int = 1) -> None:
    got, expected = losses(got_dir), losses(reference_dir)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(first, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step
    # The gradient norm: fp32 on this CPU, one 0.5M-element tensor's norm differs from the norm of
    # its two halves by up to ~1e-4 relative (torch accumulates the squares in fp32), so a layout
    # that shards the output projection reports it that far from one process's.
    got, expected = grad_norms(got_dir), grad_norms(reference_dir)
    for step in range(first, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=2e-4), step


@pytest.mark.parametrize("nproc, layout", [
    (2, {"parallelism__pp": 2, "parallelism__pp_microbatches": 4}),
    (2, {"parallelism__pp": 2, "parallelism__pp_repeats": 3, "parallelism__pp_microbatches": 4}),
    (2, {"parallelism__pp": 2, "parallelism__pp_repeats": 3, "parallelism__pp_microbatches": 2,
         "training__batch_size": 2, "training__grad_accum_steps": 2}),
    (3, {"parallelism__pp": 3, "parallelism__pp_repeats": 2, "parallelism__pp_microbatches": 4}),
    (4, {"parallelism__pp": 2, "parallelism__dp_shard": 2, "training__batch_size": 2,
         "parallelism__pp_microbatches": 2}),
    # Tensor parallelism inside each stage (sequence-sharded activations pass between the stages);
    # pp 2 x tp 2 alone runs in graph mode below.
    (8, {"parallelism__pp": 2, "parallelism__dp_shard": 2, "parallelism__tp": 2, "training__batch_size": 2,
         "parallelism__pp_microbatches": 2}),
    # The captured step (several CPU processes: aot_eager), with full activation checkpointing.
    (2, {"parallelism__pp": 2, "parallelism__pp_repeats": 3, "parallelism__pp_microbatches": 4,
         "training__mode": "graph", "compile__backend": "aot_eager", "activation_checkpoint__mode": "full"}),
    (4, {"parallelism__pp": 2, "parallelism__tp": 2, "parallelism__pp_microbatches": 4,
         "training__mode": "graph", "compile__backend": "aot_eager", "activation_checkpoint__mode": "full"}),
    # Layers that do not divide into pp x repeats chunks: 6 over 2 x 4 chunks of 1 (both stages' last
    # repeat a padding row), captured. Eager, 6 over 2 x 2 chunks of 2 is the padded checkpoint test's
    # second half below (steps 6-10 against the same reference).
    (2, {"parallelism__pp": 2, "parallelism__pp_repeats": 4, "parallelism__pp_microbatches": 4,
         "training__mode": "graph", "compile__backend": "aot_eager", "activation_checkpoint__mode": "full"}),
], ids=["gpipe2", "circular2", "circular2_accumulated", "circular3", "pp2_dp_shard2", "pp2_dp_shard2_tp2",
        "circular2_graph_full_ac", "pp2_tp2_graph_full_ac", "padded2_graph_full_ac"])
def test_stages_equal_one_process(tmp_path, cache, reference, nproc, layout):  # noqa: F811
    run = tmp_path / "run"
    layout = {"training__batch_size": 4, "parallelism__dp_shard": 1, **layout}
    train_forked(nproc, overrides(run, cache, **SCANNED, **layout))
    assert_same_run(run, reference)


@pytest.mark.parametrize("after_nproc, after", [(1, {}), (3, {"parallelism__pp": 3, "parallelism__dp_shard": 1,
                                                                "parallelism__pp_microbatches": 4})],
                         ids=["pp2-to-1", "pp2-to-3"])
def test_checkpoint_of_two_stages_resumes_on_other_stages(tmp_path, cache, reference, after_nproc, after):  # noqa: F811
    run = tmp_path / "run"
    before = {"parallelism__pp": 2, "parallelism__dp_shard": 1, "parallelism__pp_microbatches": 4,
              "training__batch_size": 4}
    train_forked(2, overrides(run, cache, **{**SCANNED, "training__steps": HALF}, **before))
    after = after or {"training__batch_size": 1, "training__grad_accum_steps": 4}
    after = {"training__batch_size": 4, **after}
    stdout = train_forked(after_nproc, overrides(run, cache, **SCANNED, **after))
    assert "resumed from" in stdout and CHECKPOINT in stdout
    assert_same_run(run, reference, first=HALF + 1)


PADDED = {"parallelism__pp": 2, "parallelism__pp_repeats": 2, "parallelism__pp_microbatches": 4,
          "parallelism__dp_shard": 1}  # 6 layers in 8 rows: layers 6 and 7 are padding
ONE_PROCESS = {"training__batch_size": 1, "training__grad_accum_steps": 4}


def _layers_saved(run_dir) -> set[int]:
    """The layer ids of every per-layer entry (weights and Adam moments) of the step-5 checkpoint."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    (path,) = run_dir.rglob(CHECKPOINT)
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {int(m.group(1)) for key in keys if (m := re.search(r"layers\.(\d+)\.", key))}


@pytest.mark.parametrize("before_nproc, before, after_nproc, after", [
    (2, PADDED, 1, ONE_PROCESS), (1, ONE_PROCESS, 2, PADDED)], ids=["padded-to-pp1", "pp1-to-padded"])
def test_padded_stages_checkpoint_without_padding_rows(tmp_path, cache, reference, before_nproc, before,  # noqa: F811
                                                        after_nproc, after):
    """A stack padded for its stages (parallel/pipeline.py) saves the model's 6 layers only, and its
    checkpoints resume without padding and back; the parameter count leaves the padding out."""
    run = tmp_path / "run"
    stdout = train_forked(before_nproc, overrides(run, cache, **{**SCANNED, "training__steps": HALF},
                                                  **{"training__batch_size": 4, **before}))
    assert _layers_saved(run) == set(range(6))
    stdout += train_forked(after_nproc, overrides(run, cache, **SCANNED, **{"training__batch_size": 4, **after}))
    assert "resumed from" in stdout and CHECKPOINT in stdout
    assert_same_run(run, reference, first=HALF + 1)
    assert "pipeline: 2 stages x 4 micro-batches, 2 chunks per stage, 6 layers padded to 8 rows (2 identity rows, " \
           "25.0% of a stage's work)" in stdout
    params = {line.split(" params")[0].rsplit(" ", 1)[1] for line in stdout.splitlines() if line.startswith("model ")}
    assert len(params) == 1, params  # the same count with and without the padding rows


def test_kill_9_of_both_stages_then_restart_gives_identical_losses(tmp_path, cache):  # noqa: F811
    """pp 2 under torchrun, every process killed at an arbitrary moment after the first checkpoint,
    restarted with the same command: it resumes from the killed run's checkpoint, and the losses are
    those of the uninterrupted run, bitwise."""
    import subprocess

    from kill_fixtures import assert_resumed_once, kill_9_at_step
    from test_train_dist import command, thread_env, train

    args = dict(training__deterministic="true", training__steps=20, checkpoint__interval=5, training__batch_size=4,
                parallelism__pp=2, parallelism__dp_shard=1, parallelism__pp_microbatches=2, model__scan_layers="true")
    straight = tmp_path / "straight"
    train(2, overrides(straight, cache, **args))

    run = tmp_path / "killed"
    proc = subprocess.Popen(command(2, overrides(run, cache, **args)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=thread_env())
    # After the first checkpoint (step 5), before the end; the launcher and both stages at once.
    kill_9_at_step(proc, run, 6, 17, timeout=240, tree=True)
    proc.stderr.close()
    assert_resumed_once(run, train(2, overrides(run, cache, **args)).stdout, steps=20)
    want, got = losses(straight), losses(run)
    assert sorted(got) == list(range(1, 21))
    for step in range(1, 21):
        assert got[step] == want[step], (step, got[step], want[step])  # bitwise
