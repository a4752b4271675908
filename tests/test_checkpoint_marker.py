"""Checkpoints committed by a marker written last (checkpoint.commit = marker, what object-store
mounts such as gcsfuse need): no directory is ever renamed, an interrupted or killed save leaves the
previous checkpoint loadable, prune and re-saves of a step, rank 0's view shared by every rank, and
the choice `auto` makes from the mount table. The bitwise resume of a training run through this
path is in tests/test_train.py's style, here with a checkpoint folder outside the run directory.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_fixtures import assert_one_whole_save, kill_during_saves
from dist_utils import run_distributed

from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train.checkpoint import (
    Checkpointer,
    checkpoint_step,
    commit_mode,
    load_checkpoint,
    load_full_state_dict,
    mount_of,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")


def make_state(step: int, scale: float = 1.0) -> dict:
    return {"step": step,
            "model": {"w": torch.arange(12.0).reshape(4, 3) * scale, "b": torch.full((5,), float(step))},
            "optimizer": {"step": step, "exp_avg": {"b": torch.full((5,), 0.5 * step)}},
            "data": {"samples_consumed": 10 * step}, "model_name": "m", "model_args": {}}


@pytest.fixture
def renames(monkeypatch):
    """Every directory renamed in this process (os.rename, os.replace, Path.rename, Path.replace)."""
    seen: list[str] = []

    def watch(real):
        def wrapper(src, dst, *args, **kwargs):
            if os.path.isdir(src):
                seen.append(f"{src} -> {dst}")
            return real(src, dst, *args, **kwargs)
        return wrapper

    for module, name in ((os, "rename"), (os, "replace"), (Path, "rename"), (Path, "replace")):
        monkeypatch.setattr(module, name, watch(getattr(module, name)))
    return seen


# ---------------------------------------------------------------------------------------------
# `auto`: the mount table decides


MOUNTS = """\
/dev/sda1 {root} ext4 rw,relatime 0 0
tmpfs {root}/tmp tmpfs rw 0 0
my-bucket {root}/mnt/gcs fuse.gcsfuse rw,nosuid,nodev,user_id=0 0 0
mountpoint-s3 {root}/mnt/s3 fuse rw,nosuid,nodev 0 0
/dev/sdb1 {root}/mnt/gcs/local\\040disk ext4 rw 0 0
nfs-server:/export {root}/mnt/nfs nfs4 rw 0 0
"""


@pytest.mark.parametrize("directory,expected", [
    ("mnt/gcs/run1/checkpoints", "marker"),  # not there yet: the mount of its nearest existing parent
    ("mnt/s3/ckpt", "marker"),  # mountpoint-s3 mounts as plain "fuse", named by its source
    ("mnt/gcs/local disk/ckpt", "rename"),  # a disk mounted inside the bucket's mount (an escaped space)
    ("mnt/nfs/ckpt", "rename"),
    ("home/me/run/checkpoints", "rename"),
])
def test_auto_takes_marker_on_object_store_mounts(tmp_path, directory, expected):
    root = tmp_path / "root"  # a fake file system: its mount points exist, the table names them
    for point in ("mnt/gcs/local disk", "mnt/s3", "mnt/nfs", "home/me"):
        (root / point).mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS.format(root=root))
    assert commit_mode(root / directory, "auto", mounts=mounts) == expected
    assert commit_mode(root / directory, "rename", mounts=mounts) == "rename"
    assert commit_mode(root / directory, "marker", mounts=mounts) == "marker"
    assert mount_of(root / "mnt/gcs/local disk/x", mounts=mounts)[:2] == (str(root / "mnt/gcs/local disk"), "ext4")


def test_auto_without_a_mount_table_and_bad_modes(tmp_path):
    assert commit_mode(tmp_path, "auto", mounts=tmp_path / "no-such-file") == "rename"
    assert Checkpointer(tmp_path).commit == "rename"  # a test machine's temporary directory: a plain disk
    with pytest.raises(ValueError, match=r"^checkpoint.commit = 'atomic': use one of auto, rename, marker$"):
        Checkpointer(tmp_path, commit="atomic")


# ---------------------------------------------------------------------------------------------
# the marker commit, in one process


def test_marker_saves_prunes_and_resaves_without_renaming_a_directory(tmp_path, renames):
    ckpt = Checkpointer(tmp_path, keep_latest_k=2, commit="marker")
    for step in (10, 20, 30):
        path = ckpt.save(step, make_state(step))
        assert path == tmp_path / f"step-{step:08d}" and (path / "checkpoint.json").is_file()
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000020", "step-00000030"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest", "step-00000020", "step-00000030"]
    assert ckpt.latest().name == "step-00000030" and load_checkpoint(ckpt.latest())["step"] == 30

    # Re-saving step 30 (after a resume) writes a fresh name; the older save of the step goes once
    # the new one is committed.
    path = ckpt.save(30, make_state(30, scale=3.0))
    assert path.name == "step-00000030-1" and checkpoint_step(path) == 30
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000020", "step-00000030-1"]
    assert (tmp_path / "latest").read_text() == "step-00000030-1\n"
    torch.testing.assert_close(load_full_state_dict(ckpt.latest())["w"], torch.arange(12.0).reshape(4, 3) * 3)
    assert ckpt.save(30, make_state(30, scale=4.0)).name == "step-00000030-2"
    # A later step sorts after every attempt of an earlier one, and keep_latest_k counts checkpoints.
    ckpt.save(40, make_state(40))
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000030-2", "step-00000040"]
    assert renames == [], renames


def test_marker_async_save(tmp_path, renames):
    with Checkpointer(tmp_path, keep_latest_k=1, async_save=True, commit="marker") as ckpt:
        state = make_state(1)
        ckpt.save(1, state)
        state["model"]["b"].fill_(-1.0)  # training goes on: must not leak into step 1
        ckpt.save(2, make_state(2))
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000002"]
    assert not (tmp_path / "step-00000001").exists()
    torch.testing.assert_close(load_full_state_dict(ckpt.latest())["b"], torch.full((5,), 2.0))
    assert renames == [], renames


def test_marker_save_that_dies_before_the_marker_leaves_the_previous_one(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, commit="marker")
    ckpt.save(10, make_state(10))
    real_save = dcp.save

    def dying_save(state_dict, *, storage_writer, **kwargs):
        real_save(state_dict, storage_writer=storage_writer, **kwargs)  # shards and .metadata written ...
        raise KeyboardInterrupt  # ... and the process dies before the marker

    monkeypatch.setattr(dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(20, make_state(20))
    monkeypatch.undo()
    debris = tmp_path / "step-00000020"
    assert (debris / ".metadata").is_file() and not (debris / "checkpoint.json").exists()
    assert ckpt.latest().name == "step-00000010" and load_checkpoint(ckpt.latest())["step"] == 10
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000010"]
    # The retry of step 20 takes a fresh name (an object store never sees one name hold two writes)
    # and its commit removes the debris.
    assert ckpt.save(20, make_state(20)).name == "step-00000020-1"
    assert not debris.exists()
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000010", "step-00000020-1"]


def test_a_checkpoint_removed_halfway_is_not_complete(tmp_path, monkeypatch):
    """Pruning removes the marker first: a kill inside the removal leaves no "complete" checkpoint
    with shards missing."""
    import shutil

    ckpt = Checkpointer(tmp_path, keep_latest_k=1, commit="marker")
    ckpt.save(1, make_state(1))
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(2, make_state(2))  # committed, then killed while pruning step 1
    monkeypatch.undo()
    assert (tmp_path / "step-00000001").is_dir() and not (tmp_path / "step-00000001" / "checkpoint.json").exists()
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step-00000002"]
    ckpt.save(3, make_state(3))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003"]


@pytest.mark.multiprocess(ranks=False)  # one process at a time, no ranks: scheduled with its file
def test_kill_9_mid_marker_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    kill_during_saves(tmp_path, commit="marker")
    ckpt = Checkpointer(tmp_path, commit="marker")
    complete = ckpt.complete_checkpoints()
    latest = ckpt.latest()
    assert latest in complete[-2:]  # `latest` lags the marker by one file write at most
    # At most one directory is not a checkpoint: the save the kill interrupted, or one being pruned.
    assert len(set(tmp_path.glob("step-*")) - set(complete)) <= 1
    for path in complete:
        assert_one_whole_save(path)
    # A restart writes on (the debris goes with its next commit).
    ckpt.save(99, {"step": 99, "model": {"w": torch.ones(2)}, "model_name": "m", "model_args": {}})
    assert ckpt.latest().name == "step-00000099"
    assert set(tmp_path.glob("step-*")) == set(ckpt.complete_checkpoints())


# ---------------------------------------------------------------------------------------------
# 2 ranks: sharded marker saves, and every rank resumes from what rank 0 sees


def _two_ranks(root: str) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_tpu.train.checkpoint import load

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def sharded(step: int) -> dict:
        state = make_state(step)
        for part in ("model", "optimizer"):
            state[part] = {k: {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in v.items()}
                           if isinstance(v, dict) else distribute_tensor(v, mesh, [Shard(0)])
                           if isinstance(v, torch.Tensor) else v for k, v in state[part].items()}
        return state

    ckpt = Checkpointer(root, keep_latest_k=2, commit="marker", log=lambda m: None)
    names = [ckpt.save(1, sharded(1)).name, ckpt.save(2, sharded(2)).name, ckpt.save(2, sharded(2)).name]
    with Checkpointer(os.path.join(root, "async"), keep_latest_k=1, async_save=True, commit="marker") as saver:
        saver.save(3, sharded(3))
        saver.save(4, sharded(4))
    # A host whose view of the shared folder lags (a stat cache): rank 1 sees no checkpoint at all.
    if rank == 1:
        ckpt.latest = lambda: None
    chosen = ckpt.agreed_latest()
    target = sharded(0)
    rest = load(chosen, target)
    full = {n: t.full_tensor() for n, t in target["model"].items()}
    return [names, chosen.name, rest["step"], full]


@pytest.mark.multiprocess
def test_two_ranks_save_with_markers_and_agree_on_the_latest(tmp_path):
    results = run_distributed(_two_ranks, world_size=2, args=(str(tmp_path),))
    for names, chosen, step, full in results:
        assert names == ["step-00000001", "step-00000002", "step-00000002-1"]
        assert chosen == "step-00000002-1" and step == 2
        torch.testing.assert_close(full["b"], torch.full((5,), 2.0), rtol=0, atol=0)
    assert [p.name for p in Checkpointer(tmp_path, commit="marker").complete_checkpoints()] == [
        "step-00000001", "step-00000002-1"]
    assert sorted(p.name for p in (tmp_path / "step-00000002-1").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in Checkpointer(tmp_path / "async").complete_checkpoints()] == ["step-00000004"]


# ---------------------------------------------------------------------------------------------
# a training run resumed from a marker checkpoint, bitwise


def test_resume_from_a_marker_checkpoint_in_another_folder_is_bitwise(tmp_path, train_overrides, renames):
    overrides = train_overrides(training__deterministic="true", validation__enabled="false", training__steps=6,
                                checkpoint__interval=3)
    assemble(build_config(LLAMA_DEBUG, overrides + ["--checkpoint.enabled", "false"])).train()
    straight = _losses(tmp_path / "run")

    bucket = tmp_path / "bucket" / "checkpoints"  # stands in for a gcsfuse mount's directory
    interrupted = overrides + ["--output_dir", str(tmp_path / "resumed"), "--checkpoint.folder", str(bucket),
                               "--checkpoint.commit", "marker"]
    first = assemble(build_config(LLAMA_DEBUG, interrupted))
    for _ in range(3):
        first.train_step()
    first.saving.save_checkpoint()
    del first
    assert (bucket / "step-00000003" / "checkpoint.json").is_file()
    assert not (tmp_path / "resumed" / "checkpoints").exists()
    torch.manual_seed(1234)  # a resumed process starts with unrelated global RNG state
    second = assemble(build_config(LLAMA_DEBUG, interrupted))
    second.train()
    assert second.step == 6
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])
    assert (bucket / "latest").read_text() == "step-00000006\n"
    assert [r for r in renames if str(bucket) in r] == []


def _losses(run_dir: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
