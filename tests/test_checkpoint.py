import os

import pytest
import torch

from titan_tpu.train.checkpoint import Checkpointer, load_checkpoint


def test_save_latest_and_prune(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_latest_k=2)
    for step in (10, 20, 30):
        ckpt.save(step, {"step": step, "w": torch.full((3,), float(step))})
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000020", "step-00000030"]
    assert ckpt.latest().name == "step-00000030"
    assert load_checkpoint(ckpt.latest())["step"] == 30


def test_crash_during_save_keeps_previous(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(10, {"step": 10})

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # the process dies mid-write

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(20, {"step": 20})
    monkeypatch.undo()
    assert ckpt.latest().name == "step-00000010"
    assert load_checkpoint(ckpt.latest())["step"] == 10
    assert not (tmp_path / "step-00000020").exists()
    # The next successful save clears the debris.
    ckpt.keep_latest_k = 5
    ckpt.save(20, {"step": 20})
    assert not any(p.name.startswith(".step-") for p in tmp_path.iterdir())


def test_pointer_to_missing_checkpoint_falls_back(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(10, {"step": 10})
    (tmp_path / "latest").write_text("step-00000099\n")
    assert ckpt.latest().name == "step-00000010"


def test_corrupted_checkpoint_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(10, {"step": 10, "w": torch.zeros(1000)})
    state = path / "state.pt"
    state.write_bytes(state.read_bytes()[: os.path.getsize(state) // 2])
    with pytest.raises(ValueError, match="damaged"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope")
