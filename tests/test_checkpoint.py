"""Single-process checkpoint tests: round trip, keep-k, pointer, atomicity, clear errors, signals.

Multi-process (sharded, resharding, async) tests live in test_checkpoint_dist.py.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_fixtures import assert_one_whole_save, kill_during_saves

from titan_tpu.train.checkpoint import (
    Checkpointer,
    load,
    load_checkpoint,
    load_full_state_dict,
    rng_state,
    set_rng_state,
)
from titan_tpu.train.signals import GracefulShutdown

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ARGS = {"dim": 8, "n_layers": 2, "rope_scaling": None, "window": (1, 2)}  # tuple: JSON turns it into a list


def make_state(step: int, scale: float = 1.0) -> dict:
    return {
        "step": step,
        "model": {"tok_embeddings.weight": torch.arange(12.0).reshape(4, 3) * scale,
                  "layers.0.w": torch.full((5,), float(step))},
        "optimizer": {"step": step,
                      "exp_avg": {"layers.0.w": torch.full((5,), 0.5 * step)},
                      "exp_avg_sq": {"layers.0.w": torch.full((5,), 0.25 * step)}},
        "data": {"samples_consumed": 10 * step, "split": "train"},
        "rng": rng_state(),
        "model_name": "llama3",
        "model_args": ARGS,
    }


def empty_like_state(state: dict) -> dict:
    """A target of the same shape with zeroed tensors (what a freshly built trainer would pass)."""
    def zero(x):
        if isinstance(x, dict):
            return {k: zero(v) for k, v in x.items()}
        return torch.zeros_like(x) if isinstance(x, torch.Tensor) else x
    return {k: zero(v) if k in ("model", "optimizer") else v for k, v in state.items() if k != "rng"}


def test_round_trip_in_place(tmp_path):
    ckpt = Checkpointer(tmp_path)
    torch.manual_seed(3)
    saved = make_state(7, scale=2.0)
    path = ckpt.save(7, saved)
    expected_draw = torch.rand(3)

    target = empty_like_state(saved)
    target["optimizer"]["step"] = 0
    weight = target["model"]["tok_embeddings.weight"]
    rest = ckpt.load(path, target)
    assert target["model"]["tok_embeddings.weight"] is weight  # filled in place
    torch.testing.assert_close(weight, saved["model"]["tok_embeddings.weight"], rtol=0, atol=0)
    torch.testing.assert_close(target["optimizer"]["exp_avg_sq"]["layers.0.w"], torch.full((5,), 1.75))
    assert target["optimizer"]["step"] == 7  # non-tensor leaf replaced in the dict
    assert rest["step"] == 7 and rest["data"] == {"samples_consumed": 70, "split": "train"}
    assert rest["model_name"] == "llama3" and rest["world_size"] == 1
    set_rng_state(rest["rng"])
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)

    full = load_full_state_dict(path)
    assert set(full) == {"tok_embeddings.weight", "layers.0.w"}
    torch.testing.assert_close(full["layers.0.w"], torch.full((5,), 7.0))
    whole = load_checkpoint(path)  # single-process view: everything as saved, full plain tensors
    assert whole["model_args"]["window"] == [1, 2] and whole["optimizer"]["step"] == 7
    torch.testing.assert_close(whole["optimizer"]["exp_avg"]["layers.0.w"], torch.full((5,), 3.5))
    assert torch.equal(whole["rng"]["torch"], saved["rng"]["torch"])
    # A weights-only target (fine-tuning from a checkpoint) loads just the model.
    weights = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}
    load(path, weights)
    torch.testing.assert_close(weights["model"]["layers.0.w"], torch.full((5,), 7.0))


def test_weights_only_checkpoint_and_missing_parts(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(0, {"step": 0, "model": {"w": torch.ones(2)}, "model_name": "m", "model_args": {}})
    assert load_checkpoint(path)["step"] == 0
    with pytest.raises(ValueError, match="has no 'optimizer.exp_avg.w'"):
        load(path, {"model": {"w": torch.zeros(2)}, "optimizer": {"exp_avg": {"w": torch.zeros(2)}}})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        ckpt.save(1, {"step": 1, "extra": torch.ones(1)})


def test_save_latest_and_prune(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_latest_k=2)
    for step in (10, 20, 30):
        ckpt.save(step, make_state(step))
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000020", "step-00000030"]
    assert ckpt.latest().name == "step-00000030"
    assert (tmp_path / "latest").read_text() == "step-00000030\n"
    assert load_checkpoint(ckpt.latest())["step"] == 30
    # Re-saving a step (after a resume) replaces it whole.
    ckpt.save(30, make_state(30, scale=3.0))
    torch.testing.assert_close(load_full_state_dict(ckpt.latest())["tok_embeddings.weight"],
                               torch.arange(12.0).reshape(4, 3) * 3)


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(10, make_state(10))
    real_save = dcp.save

    def dying_save(state_dict, *, storage_writer, **kwargs):
        real_save(state_dict, storage_writer=storage_writer, **kwargs)  # shards and .metadata written ...
        raise KeyboardInterrupt  # ... and the process dies before the rename

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(20, make_state(20))
    monkeypatch.undo()
    assert ckpt.latest().name == "step-00000010"
    assert load_checkpoint(ckpt.latest())["step"] == 10
    assert not (tmp_path / "step-00000020").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step-")] == ["step-00000010"]
    # The next save clears the debris, whatever its step.
    ckpt.save(30, make_state(30))
    assert not any(p.name.startswith(".step-") for p in tmp_path.iterdir())
    assert ckpt.latest().name == "step-00000030"


def test_pointer_to_missing_checkpoint_falls_back(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(10, make_state(10))
    (tmp_path / "latest").write_text("step-00000099\n")
    assert ckpt.latest().name == "step-00000010"
    assert Checkpointer(tmp_path / "empty").latest() is None


def test_damaged_checkpoints_are_clear_errors(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(10, make_state(10))
    target = empty_like_state(make_state(10))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load(tmp_path / "nope", target)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load(tmp_path, target)  # the checkpoints/ directory itself, not a step directory

    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"damaged \(__0_0.distcp is .* bytes instead of .*move it away"):
        load(path, target)
    with pytest.raises(ValueError, match="damaged"):
        load_full_state_dict(path)

    # Same length but garbage inside is DCP's own error, re-raised as one line.
    shard.write_bytes(b"\0" * len(data))
    with pytest.raises(ValueError, match="cannot be read .*move it away"):
        load(path, target)

    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:10])
    with pytest.raises(ValueError, match=r"\.metadata is .* bytes instead"):
        load(path, target)


def test_other_model_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(10, make_state(10))
    other = empty_like_state(make_state(10))
    other["model_args"] = {**ARGS, "dim": 16}
    with pytest.raises(ValueError, match="--output_dir or the matching --model.name"):
        load(path, other)
    other = empty_like_state(make_state(10))
    other["model"]["layers.0.w"] = torch.zeros(6)
    with pytest.raises(ValueError, match=r"layers.0.w of shape \(5,\), the model expects \(6,\)"):
        load(path, other)


def test_async_save_single_process_snapshots_and_renames(tmp_path):
    with Checkpointer(tmp_path, keep_latest_k=1, async_save=True) as ckpt:
        state = make_state(1)
        ckpt.save(1, state)
        state["model"]["layers.0.w"].fill_(-1.0)  # training goes on: must not leak into step 1
        ckpt.save(2, make_state(2))
    assert ckpt.latest().name == "step-00000002"
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000002"]
    assert (tmp_path / "step-00000001").exists() is False
    torch.testing.assert_close(load_full_state_dict(ckpt.latest())["layers.0.w"], torch.full((5,), 2.0))


def test_async_snapshot_is_taken_at_save(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=True)
    state = make_state(1)
    path = ckpt.save(1, state)
    state["model"]["layers.0.w"].fill_(-1.0)
    ckpt.close()
    torch.testing.assert_close(load_full_state_dict(path)["layers.0.w"], torch.full((5,), 1.0))


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_kill_9_mid_save_leaves_latest_complete(tmp_path):
    kill_during_saves(tmp_path, commit="rename")
    ckpt = Checkpointer(tmp_path)
    latest = ckpt.latest()
    # Whatever the moment of the kill, no incomplete directory is visible under a step-* name.
    assert sorted(tmp_path.glob("step-*")) == ckpt.complete_checkpoints()
    assert_one_whole_save(latest)


def test_graceful_shutdown_sets_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with GracefulShutdown() as shutdown:
        assert not shutdown.requested and not shutdown.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes, i.e. before the next line runs
        assert shutdown.requested and shutdown.should_stop()
        assert shutdown.signal_name == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is not signal.SIG_DFL  # SIGTERM does not arm the hard exit
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_second_sigint_kills_the_process():
    script = textwrap.dedent("""
        import os, signal, time
        from titan_tpu.train.signals import GracefulShutdown
        with GracefulShutdown() as shutdown:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            print("requested", shutdown.requested, flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the user insists: default action, no cleanup
            time.sleep(5)
            print("still alive", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout == "requested True\n"
    assert result.returncode == -signal.SIGINT
