"""MetricsLogger: JSONL rows, console line, TensorBoard events, non-finite values."""

import json
import math
import sys

import pytest
import torch

from titan_tpu.train import metrics as metrics_mod
from titan_tpu.train.metrics import MetricsLogger

TRAIN_ROW = {
    "loss": 6.81234,
    "lr": 3e-4,
    "grad_norm": 1.2345,
    "tokens_per_s": 12345.6,
    "tflops": 0.0761,
    "mfu": 6.12,
    "memory_gb": 1.234,
    "max_memory_gb": 1.5,
}


def read_rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_rows_and_append(tmp_path):
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False) as log:
        log.log(1, {"loss": 7.0, "lr": 1e-4})
        log.log(2, {"loss": torch.tensor(6.5), "tokens": 4096})
        # Flushed per write: readable before close (a killed run keeps its rows).
        assert len(read_rows(tmp_path)) == 2
    assert read_rows(tmp_path) == [{"step": 1, "loss": 7.0, "lr": 1e-4}, {"step": 2, "loss": 6.5, "tokens": 4096}]
    # A resumed run appends to the same file.
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False) as log:
        log.log(3, {"val_loss": 5.0})
    assert [r["step"] for r in read_rows(tmp_path)] == [1, 2, 3]


def test_console_line(tmp_path, capsys):
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, total_steps=200) as log:
        log.log(10, TRAIN_ROW)
        log.log(200, {"val_loss": 5.43214})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step  10/200 [#")
    expected = ["loss 6.8123", "lr 3.0e-04", "gnorm 1.234", "12,346 tok/s", "0.076 TFLOP/s", "MFU 6.1%"]
    for text in expected + ["mem 1.23 GB (max 1.50)"]:
        assert text in lines[0], text
    assert "max_memory_gb" not in lines[0]
    assert lines[1] == "step 200/200 [" + "#" * 20 + "] val_loss 5.4321"


def test_console_only_present_keys_and_no_total(tmp_path):
    log = MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False)
    assert log.format_line(3, {"loss": 2.0, "seen": 0.5}) == "step 3 loss 2.0000 | seen 0.5"
    assert log.format_line(3, {}) == "step 3"
    log.close()
    log.close()  # idempotent


def test_console_keys_keep_a_kinds_line_short_and_the_file_whole(tmp_path, capsys):
    """A kind that logs many terms names the few its console line shows; metrics.jsonl keeps all."""
    row = {"loss": 0.5, "kl": 5.5e-4, "reward": 0.0104, "reward_std": 0.0252, "sampling_s": 0.146,
           "training_s": 0.131, "clip_ratio/low_mean": 0.0, "completions/mean_length": 7.9}
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, console_keys=()) as log:
        log.log(1, row)
    line = capsys.readouterr().out.strip()
    assert line == "step 1 loss 0.5000 | kl 5.5e-04 | reward 0.0104 (std 0.0252) | sample 0.15 s | train 0.13 s"
    assert read_rows(tmp_path) == [{"step": 1, **row}]
    named = MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False, console_keys=("seen",))
    assert named.format_line(2, {"loss": 2.0, "seen": 0.5, "other": 1}) == "step 2 loss 2.0000 | seen 0.5"
    named.close()


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(output_dir=tmp_path, console=False) as log:
        log.log(1, {"loss": 3.0, "lr": 1e-3})
        log.log(2, {"loss": 2.5, "lr": 1e-3})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [3.0, 2.5]
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]


def test_missing_tensorboard_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.warns(UserWarning, match="TensorBoard logging disabled"):
        log = MetricsLogger(output_dir=tmp_path, console=False)
    log.log(1, {"loss": 1.0})
    log.close()
    assert read_rows(tmp_path) == [{"step": 1, "loss": 1.0}]


def test_nan_and_inf_become_null(tmp_path, capsys):
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, total_steps=10) as log:
        log.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}
    out = capsys.readouterr().out
    assert "loss nan" in out and "gnorm inf" in out  # the console still shows the divergence
    assert math.isfinite(row["lr"])
    assert metrics_mod._json_safe(float("-inf")) is None


def test_progress_line_eta_and_data_wait(tmp_path):
    now = [100.0]
    log = MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False, total_steps=100, clock=lambda: now[0])
    assert "ETA" not in log.format_line(10, {"loss": 1.0})  # the first row of a process: no rate yet
    now[0] += 20.0  # 10 more steps in 20 s: 80 steps left at 2 s each
    line = log.format_line(20, {"loss": 1.0, "data_s": 0.0012, "step_s": 2.0, "time": 1e9})
    assert line.startswith("step  20/100 [####................] ETA 2m40s loss 1.0000 | data 1.2 ms")
    assert "time" not in line and "step_s" not in line  # kept for metrics.jsonl and the report
    now[0] += 3 * 3600.0
    assert "ETA 6h00m" in log.format_line(40, {"loss": 1.0})  # 60 steps left at (3 h + 20 s) / 30 steps
    assert "ETA" not in log.format_line(100, {"loss": 1.0})
    log.close()


def test_resumed_run_logs_no_step_twice(tmp_path, capsys):
    """The first attempt logged steps 1-7 and died; its checkpoint was at step 5. The resumed
    process replays 6-7 (not logged again, from any sink) and goes on at 8."""
    class Recorder:
        def __init__(self):
            self.steps = []

        def log(self, step, scalars):
            self.steps.append(step)

        def state_dict(self):
            return {"recorder": "id"}

        def close(self):
            pass

    with MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False) as log:
        for step in range(1, 8):
            log.log(step, {"loss": 1.0 / step})
    recorder = Recorder()
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, trackers=[recorder], resumed_step=5) as log:
        assert log.state_dict() == {"recorder": "id"}
        for step in range(6, 11):
            log.log(step, {"loss": 2.0 / step})
    assert [r["step"] for r in read_rows(tmp_path)] == list(range(1, 11))
    assert read_rows(tmp_path)[6]["loss"] == 1.0 / 7  # the first attempt's row is the one kept
    assert recorder.steps == [8, 9, 10]
    assert "replayed after the restart" in capsys.readouterr().out
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [0, 5]
    # A run that starts afresh in the same directory (no resume) appends as before.
    with MetricsLogger(output_dir=tmp_path, tensorboard=False, console=False) as log:
        log.log(1, {"loss": 3.0})
    assert read_rows(tmp_path)[-1] == {"step": 1, "loss": 3.0}


def test_goodput_ledger_adds_restarts_and_recomputed_steps(tmp_path):
    from titan_tpu.train.goodput import GoodputLedger, describe, read_processes, totals

    now = [100.0]
    first = GoodputLedger(tmp_path, step=0, start=90.0, clock=lambda: now[0])
    first.add("compile", 4.0)
    first.begin_loop()  # 10 s since the start, 4 of them compiling: 6 s start-up
    for step in range(1, 9):
        first.step(step, seconds=1.0, data_seconds=0.25)
        now[0] += 1.0
    first.flush()  # reached step 8 at t = 108; the process is then killed
    now[0] = 120.0
    second = GoodputLedger(tmp_path, step=5, start=115.0, clock=lambda: now[0])  # resumed from step 5
    second.add("checkpoint_load", 2.0)
    second.begin_loop()  # 5 s since its start, 2 of them loading: 3 s of restart, plus 7 s down
    for step in range(6, 11):
        second.step(step, seconds=1.0, data_seconds=0.0)
        now[0] += 1.0
    second.flush()
    t = totals(read_processes(tmp_path))
    assert t["recomputed_steps"] == 3 and t["restarts"] == 1 and t["wall"] == 125.0 - 90.0
    s = t["seconds"]
    assert (s["productive"], s["recomputed"], s["data"]) == (8 * 0.75 + 2.0, 3.0, 2.0)
    assert (s["startup"], s["restart"], s["compile"], s["checkpoint_load"]) == (6.0, 3.0 + 7.0, 4.0, 2.0)
    assert s["other"] == pytest.approx(35.0 - sum(v for k, v in s.items() if k != "other"))
    assert t["goodput"] == pytest.approx(100 * 8.0 / 35.0)
    assert describe(t).startswith("goodput 22.9% of 35s wall (1 restart, 3 steps recomputed): productive 8.0s")
