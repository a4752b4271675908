"""Faults a long run meets (issue 30): a full disk while saving, a second launch into one output_dir,
damaged input files, a `latest` naming an incomplete checkpoint, exports readable by others, and a
warmup longer than a quick run. Each is injected here and must end as one line (or a note) that
names the file and what to do, with nothing lost."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from titan_tpu.cli import main
from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.train import checkpoint as checkpoint_module
from titan_tpu.train.checkpoint import Checkpointer, CheckpointSaveError, load_checkpoint
from titan_tpu.train.run_lock import OutputDirLocked, RunLock

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LLAMA_DEBUG = str(CONFIGS / "llama3_debug.toml")
REPO = Path(__file__).resolve().parent.parent


def small_state(step: int) -> dict:
    return {"step": step, "model": {"w": torch.full((1000,), float(step))}, "model_name": "m", "model_args": {},
            "rng": checkpoint_module.rng_state()}


@contextmanager
def failing_writes(code: int = errno.ENOSPC, *, times: int = 1_000_000, where: str = ""):
    """DCP's file creation raises OSError(code), as a full disk, a read-only or a broken device does,
    for the next `times` files whose path contains `where` (also in an async save's writer thread)."""
    real = FileSystem.create_stream
    left = [times]

    @contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and left[0] > 0 and where in str(path):
            left[0] -= 1
            raise OSError(code, os.strerror(code), str(path))
        with real(self, path, mode) as stream:
            yield stream

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


# ---------------------------------------------------------------------------------------------
# 1. a save that fails


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_save_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch, async_save):
    logged = []
    ckpt = Checkpointer(tmp_path, async_save=async_save, log=logged.append)
    ckpt.save(10, small_state(10))
    ckpt.wait()
    monkeypatch.setattr(checkpoint_module, "_free_bytes", lambda path: 1234)  # as the full disk would say
    with failing_writes(errno.ENOSPC), pytest.raises(CheckpointSaveError) as info:
        ckpt.save(20, small_state(20))
        ckpt.close()  # an async save's failure surfaces here
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step-00000020 could not be saved in {tmp_path}: no space left on the "
                              "device (it needs about 0.0 MB, 0.0 MB are free); the previous checkpoint "
                              "step-00000010 is intact"), message
    # The free-space check before the save warned too (needed 4,000 bytes, 1,234 free).
    assert any("checkpoint step-00000020 needs about 0.0 MB" in m for m in logged), logged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000010"]  # staging removed
    assert ckpt.latest().name == "step-00000010" and load_checkpoint(ckpt.latest())["step"] == 10
    monkeypatch.undo()
    ckpt.save(30, small_state(30))  # the next attempt, with space again, works
    ckpt.close()
    assert ckpt.latest().name == "step-00000030"


@pytest.mark.parametrize("code, why", [(errno.EACCES, "no permission to write there"),
                                       (errno.EIO, "Input/output error")])
def test_permission_and_io_errors_name_their_cause(tmp_path, code, why):
    ckpt = Checkpointer(tmp_path)
    with failing_writes(code), pytest.raises(CheckpointSaveError, match=f"step-00000001 could not be saved in .*{why}"
                                                                        ".*no earlier checkpoint exists"):
        ckpt.save(1, small_state(1))
    assert list(tmp_path.iterdir()) == []


def test_free_space_below_the_checkpoint_size_is_a_warning_before_the_save(tmp_path, monkeypatch):
    logged = []
    monkeypatch.setattr(checkpoint_module, "_free_bytes", lambda path: 100)
    Checkpointer(tmp_path / "ckpt", log=logged.append).save(5, small_state(5))  # the disk only pretends to be full
    assert logged == [f"warning: checkpoint step-00000005 needs about 0.0 MB and {tmp_path / 'ckpt'} has 0.0 MB free; "
                      "the save will likely fail: free some space, lower checkpoint.keep_latest_k or use another "
                      "--output_dir"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_on_save_error_warn_trains_on_and_retries_stop_exits_non_zero(tmp_path, train_overrides, capsys, async_save):
    overrides = train_overrides(training__steps=6, checkpoint__interval=2, validation__enabled="false",
                                training__deterministic="true", checkpoint__async_save=async_save)
    straight = tmp_path / "straight"
    assemble(build_config(LLAMA_DEBUG, overrides + ["--output_dir", str(straight)])).train()

    # warn: the step-2 save fails (one file refused), training goes on, step 4 and 6 are saved.
    run = tmp_path / "warned"
    cfg = build_config(LLAMA_DEBUG, overrides + ["--output_dir", str(run), "--checkpoint.on_save_error", "warn"])
    with failing_writes(errno.ENOSPC, times=1):
        summary = assemble(cfg).train()
    out = capsys.readouterr().out
    assert summary["save_failures"] == 1 and summary["checkpoint"].endswith("step-00000006")
    assert ("warning: checkpoint step-00000002 could not be saved in" in out
            and "training goes on (checkpoint.on_save_error = warn) and the next save is tried at step" in out), out
    assert _losses(run) == _losses(straight)  # a failed save changes nothing in the training
    assert not list((run / "checkpoints").glob(".step-*"))

    # stop (the default): exit status 1, one line on stderr, the previous checkpoint named.
    stopped = tmp_path / "stopped"
    with failing_writes(errno.ENOSPC, where="step-00000004"):
        code = main(["train", "--config", LLAMA_DEBUG, *overrides, "--output_dir", str(stopped)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: checkpoint step-00000004 could not be saved in"), err
    assert "the previous checkpoint step-00000002 is intact" in err[0]
    assert Checkpointer(stopped / "checkpoints").latest().name == "step-00000002"


UNSHARE_TMPFS = shutil.which("unshare") is not None and subprocess.run(
    ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.multiprocess
@pytest.mark.skipif(not UNSHARE_TMPFS, reason="needs `unshare -rm` and a tmpfs mount (user namespaces)")
def test_a_real_full_disk_stops_the_run_with_one_line(tmp_path, train_overrides):
    """The issue's own case: the output_dir on a small filesystem, the second checkpoint does not fit."""
    mount = tmp_path / "small"
    mount.mkdir()
    args = train_overrides(training__steps=4, checkpoint__interval=2, validation__enabled="false",
                           checkpoint__keep_latest_k=1)
    args += ["--output_dir", str(mount / "run")]
    command = (f"mount -t tmpfs -o size=110m tmpfs {mount} && {sys.executable} -m titan_tpu.cli train "
               f"--config {LLAMA_DEBUG} {' '.join(args)}; code=$?; ls -a {mount}/run/checkpoints; exit $code")
    # One checkpoint of the debug model with its Adam moments is ~75 MB: the second does not fit.
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith("error: checkpoint step-00000004 could not be saved in"), err[0]
    assert "no space left on the device (it needs about 74.0 MB" in err[0], err[0]
    assert "the previous checkpoint step-00000002 is intact" in err[0], err[0]
    # `ls -a` of the checkpoints: the previous one and its pointer; the staging directory was removed.
    assert proc.stdout.split()[-4:] == [".", "..", "latest", "step-00000002"], proc.stdout
    assert "warning: checkpoint step-00000004 needs about 74.0 MB and" in proc.stdout  # warned before the save


# ---------------------------------------------------------------------------------------------
# 2. one writer per output_dir

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from titan_tpu.train.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(60)
""")

FORK_AND_DIE = textwrap.dedent("""
    import os, sys, time
    from titan_tpu.train.run_lock import RunLock
    RunLock(sys.argv[1]).acquire()
    child = os.fork()
    if child == 0:           # the child inherits the locked descriptor and outlives its parent
        time.sleep(60)
        os._exit(0)
    print(os.getpid(), child, flush=True)
    os._exit(0)              # killed-like: no release
""")


def _python(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            **kwargs)


@pytest.mark.multiprocess
def test_a_second_launch_exits_at_once_naming_the_holder(tmp_path, train_overrides, capsys):
    run = tmp_path / "run"
    holder = _python(HOLD_LOCK, str(run))
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main(["train", "--config", LLAMA_DEBUG, *train_overrides(training__steps=2)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith(f"error: output_dir {run} is in use by another run: pid {holder.pid} on host "), err
        assert "pass another --output_dir" in err[0]
        assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed (-9): its lock went with it; the next run notes whom it took over from.
    lock = RunLock(run, log=(notes := []).append).acquire()
    assert len(notes) == 1 and f"was left by pid {holder.pid}" in notes[0] and "taking it over" in notes[0]
    lock.release()
    assert (run / ".lock").read_text() == ""  # a clean end leaves no holder behind
    RunLock(run, log=(notes := []).append).acquire().release()
    assert notes == []


@pytest.mark.multiprocess
def test_a_stale_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    proc = _python(FORK_AND_DIE, str(tmp_path))
    parent, child = map(int, proc.stdout.readline().split())
    proc.wait()
    # The flock is still held (by the orphaned child), but the pid in the file is gone on this host.
    notes = []
    lock = RunLock(tmp_path, log=notes.append).acquire()
    try:
        assert len(notes) == 1 and f"held by pid {parent}" in notes[0] and "no longer running" in notes[0], notes
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
        os.kill(child, 9)


def test_locks_of_one_process_share_and_another_holder_is_refused(tmp_path):
    with RunLock(tmp_path), RunLock(tmp_path):  # two trainers of one process: not a second launch
        pass
    (tmp_path / ".lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
    import fcntl

    fd = os.open(tmp_path / ".lock", os.O_RDWR)  # another open file description: another "process"
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(OutputDirLocked, match="pid 1 on host elsewhere"):
            RunLock(tmp_path).acquire()
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# 3. damaged inputs: one line each, naming the file and what to do


def _save_tiny_hf(path: Path) -> Path:
    from titan_tpu.models.common.transformer import TransformerArgs
    from titan_tpu.models.hub.checkpoint import save_hf_checkpoint
    from titan_tpu.models.registry import build_model

    args = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden_dim=128,
                           max_seq_len=64)
    return save_hf_checkpoint(path, name="llama3", args=args, state_dict=build_model(args, seed=0).state_dict())


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _hf_train_args(tmp_path, hf_dir, train_overrides) -> list[str]:
    return ["train", "--model.name", "hf", "--model.hf_config", str(hf_dir), *train_overrides(training__steps=1),
            "--training.seq_len", "32"]


@pytest.mark.parametrize("damage, message", [
    (_truncate, r"model.safetensors is damaged \(.* bytes where its header describes .*: truncated\); re-download"),
    (lambda p: _flip_bit(p, 8), r"model.safetensors is damaged \(the header is not valid JSON"),
    (lambda p: _flip_bit(p, 5), r"model.safetensors is damaged \(its header claims .* truncated\)"),
])
def test_damaged_safetensors_is_one_line_in_eval_and_train(tmp_path, train_overrides, capsys, damage, message):
    hf_dir = _save_tiny_hf(tmp_path / "hf")
    (tmp_path / "tokens.json").write_text("[[1, 2, 3]]")
    damage(hf_dir / "model.safetensors")
    code = main(["eval", "--hf-dir", str(hf_dir), "--token-file", str(tmp_path / "tokens.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {hf_dir / 'model.safetensors'}"), err
    assert re.search(message, err[0]), err[0]
    # The Transformers backend reading the same directory says the same.
    code = main(_hf_train_args(tmp_path, hf_dir, train_overrides))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_damaged_config_json_and_tokenizer_json_are_one_line(tmp_path, train_overrides, capsys):
    hf_dir = _save_tiny_hf(tmp_path / "hf")
    (tmp_path / "tokens.json").write_text("[[1, 2, 3]]")
    good_config = (hf_dir / "config.json").read_bytes()
    _truncate(hf_dir / "config.json")
    for argv in (["eval", "--hf-dir", str(hf_dir), "--token-file", str(tmp_path / "tokens.json")],
                 _hf_train_args(tmp_path, hf_dir, train_overrides)):
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: config {hf_dir / 'config.json'} is damaged (not valid JSON"), err[0]
        assert err[0].endswith("re-download or re-export the model directory"), err[0]
    (hf_dir / "config.json").write_bytes(good_config)

    # The directory's tokenizer.json, cut short, is named with what to do.
    from titan_tpu.data.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["some text for a tokenizer"] * 20, vocab_size=512, save_path=hf_dir / "tokenizer.json")
    _truncate(hf_dir / "tokenizer.json")
    code = main(_hf_train_args(tmp_path, hf_dir, train_overrides))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"tokenizer file '{hf_dir / 'tokenizer.json'}' is not a valid tokenizer.json" in err[0]
    assert "it is damaged (re-download it)" in err[0]


def test_damaged_token_shard_and_cached_tokenizer_are_rebuilt_with_a_note(tmp_path, capsys):
    import numpy as np

    from titan_tpu.data.shards import prepare_dataset

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 97}" for j in range(300)))
    kwargs = dict(source=str(corpus), max_bytes=None, tokenizer_path=None, vocab_size=300, cache_dir=tmp_path / "c")
    tokenizer, shards = prepare_dataset(**kwargs)
    stream, directory = shards.read(0, shards.num_tokens), shards.directory
    index = json.loads((directory / "index.json").read_text())
    assert all(isinstance(s["crc32"], int) for s in index["shards"])  # written with the shards
    del shards
    capsys.readouterr()
    # One flipped bit: the size is right, only the checksum can tell.
    _flip_bit(directory / "shard_00000.bin", 101)
    _, rebuilt = prepare_dataset(**kwargs)
    out = capsys.readouterr().out
    assert "data: rebuilding broken token cache (token shards in" in out
    assert "shard_00000.bin does not match the checksum written with it" in out, out
    np.testing.assert_array_equal(rebuilt.read(0, rebuilt.num_tokens), stream)
    del rebuilt
    # The cache's own trained tokenizer, cut short, is trained again.
    _truncate(tokenizer.path)
    tokenizer2, _ = prepare_dataset(**kwargs)
    out = capsys.readouterr().out
    assert "data: retraining the damaged cached tokenizer (tokenizer file" in out, out
    assert tokenizer2.encode("word1 word2") == tokenizer.encode("word1 word2")


def test_a_checkpoint_that_fails_to_load_names_the_next_older_one(tmp_path, train_overrides, capsys):
    overrides = train_overrides(training__steps=4, checkpoint__interval=1, checkpoint__keep_latest_k=3,
                                validation__enabled="false")
    assert main(["train", "--config", LLAMA_DEBUG, *overrides]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in Checkpointer(checkpoints).complete_checkpoints()] == [
        "step-00000002", "step-00000003", "step-00000004"]
    shard = next((checkpoints / "step-00000004").glob("*.distcp"))
    _flip_bit(shard, shard.stat().st_size // 2)  # same size, damaged inside
    _truncate(checkpoints / "step-00000004" / ".metadata")
    capsys.readouterr()
    code = main(["train", "--config", LLAMA_DEBUG, *overrides, "--training.steps", "6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {checkpoints / 'step-00000004'} is damaged (.metadata is"), err[0]
    assert ("the next older complete checkpoint is step-00000003: move step-00000004 out of "
            f"{checkpoints} (or delete it) and a restart resumes from step-00000003") in err[0], err[0]
    # Doing what it says works, with a warning for the pointer that now names nothing.
    shutil.move(checkpoints / "step-00000004", tmp_path / "damaged")
    assert main(["train", "--config", LLAMA_DEBUG, *overrides, "--training.steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-00000003 at step 3" in out, out


# ---------------------------------------------------------------------------------------------
# 4. `latest` naming an incomplete checkpoint


def test_latest_naming_an_incomplete_checkpoint_uses_the_newest_complete_one_with_a_warning(tmp_path):
    logged = []
    ckpt = Checkpointer(tmp_path, log=logged.append)
    for step in (1, 2):
        ckpt.save(step, small_state(step))
    (tmp_path / "step-00000002" / "checkpoint.json").unlink()  # e.g. a copy that stopped halfway
    assert ckpt.latest().name == "step-00000001"
    assert logged == [f"warning: {tmp_path / 'latest'} names step-00000002, which is not a complete checkpoint "
                      "(no checkpoint.json or .metadata); using the newest complete one, step-00000001"]
    shutil.rmtree(tmp_path / "step-00000001")
    assert ckpt.latest() is None
    assert logged[-1].endswith("there is no complete checkpoint, so the run starts from step 0")


def test_a_resumed_run_warns_and_resumes_from_the_newest_complete(tmp_path, train_overrides, capsys):
    overrides = train_overrides(training__steps=3, checkpoint__interval=1, checkpoint__keep_latest_k=0,
                                validation__enabled="false")
    assert main(["train", "--config", LLAMA_DEBUG, *overrides]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-00000003" / "checkpoint.json").unlink()
    capsys.readouterr()
    assert main(["train", "--config", LLAMA_DEBUG, *overrides, "--training.steps", "4"]) == 0
    out = capsys.readouterr().out
    assert (f"warning: {checkpoints / 'latest'} names step-00000003, which is not a complete checkpoint (no "
            "checkpoint.json or .metadata); using the newest complete one, step-00000002") in out, out
    assert f"resumed from {checkpoints / 'step-00000002'} at step 2" in out


# ---------------------------------------------------------------------------------------------
# 5. files meant for others get the usual permissions


def _modes(directory: Path) -> set[int]:
    return {stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*") if p.is_file()}


def test_exports_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        hf_dir = _save_tiny_hf(tmp_path / "hf")
        assert _modes(hf_dir) == {0o644} and stat.S_IMODE(hf_dir.stat().st_mode) == 0o755
        ckpt_dir = tmp_path / "ckpt"
        from titan_tpu.convert import checkpoint_to_hf, hf_to_checkpoint

        hf_to_checkpoint(hf_dir, ckpt_dir)
        out = checkpoint_to_hf(ckpt_dir, tmp_path / "export")
        assert _modes(out) == {0o644}
    finally:
        os.umask(old)


def test_hf_backend_export_is_readable_by_others(tmp_path):
    pytest.importorskip("transformers")
    from titan_tpu.models.hf.config import hf_args_from_spec
    from titan_tpu.models.hf.weights import export_hf

    args = hf_args_from_spec("llama", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,"
                                      "num_attention_heads=2,num_key_value_heads=1,vocab_size=64")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(args.transformers_config())
    old = os.umask(0o022)
    try:
        out = export_hf(args, {f"hf_model.{k}": v for k, v in model.state_dict().items()}, tmp_path / "out")
    finally:
        os.umask(old)
    assert (out / "model.safetensors").is_file() and _modes(out) == {0o644}


# ---------------------------------------------------------------------------------------------
# 6. a warmup longer than a quick run


def test_warmup_longer_than_the_run_is_clamped_with_a_note(tmp_path, train_overrides, capsys):
    overrides = train_overrides(training__steps=2, validation__enabled="false", checkpoint__enabled="false")
    cfg = build_config(LLAMA_DEBUG, overrides + ["--lr_scheduler.warmup_steps", "10"])
    assert cfg.lr_scheduler.warmup_steps == 10  # the config keeps what was asked
    trainer = assemble(cfg)
    assert trainer.lr(1) == pytest.approx(cfg.optimizer.lr / 2)  # warmup over the 2 steps there are
    trainer.train()
    assert ("note: lr_scheduler.warmup_steps = 10 is longer than training.steps = 2; warming up over 2 steps "
            "instead") in capsys.readouterr().out


def test_a_one_line_error_after_the_lock_releases_it(tmp_path, train_overrides, capsys):
    """A mistake found once the run holds output_dir (here a damaged data row, read after the lock)
    ends in its one line and leaves the lock released: the next start reports no killed run."""
    source = tmp_path / "rows.jsonl"
    source.write_text('{"text": "a first document"}\n{"text": \n')
    code = main(["train", "--config", LLAMA_DEBUG, *train_overrides(training__steps=1),
                 "--data.source", str(source), "--data.format", "text"])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    run = tmp_path / "run"
    assert (run / ".lock").is_file() and (run / ".lock").read_text() == ""  # taken, then released cleanly
    RunLock(run, log=(notes := []).append).acquire().release()
    assert notes == []
