"""titan-tpu report: numbers of the summary, the config table, a self-contained page, and the page
opened in a real browser (headless Chromium) with networking off."""

import json
import os
import re
from pathlib import Path

import pytest
from browser import chromium, visit

from titan_tpu.cli import main
from titan_tpu.config import build_config
from titan_tpu.loops import assemble
from titan_tpu.tools import report

LLAMA_DEBUG = str(Path(__file__).resolve().parent.parent / "configs" / "llama3_debug.toml")
ARTIFACTS = Path(os.environ.get("TITAN_TPU_ARTIFACTS",
                               Path(__file__).resolve().parent.parent / "outputs" / "artifacts"))


def write_run(path: Path, rows: list[dict], *, config: dict, starts: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.json").write_text(json.dumps(config))
    (path / "events.jsonl").write_text("".join(json.dumps({"event": "start", **s}) + "\n" for s in starts))
    return path


def expert_loads(step: int) -> dict:
    """Two MoE layers (blocks 1 and 2) of 8 experts: block 2 drifts onto expert 5, expert 7 dead from step 11."""
    drift = step / 20
    busy = [1.0] * 5 + [1.0 + 2.0 * drift, 1.0 - drift, 1.0 - drift]
    return {"layer1": [0.9, 1.1] * 4, "layer2": [round(v, 3) for v in busy]}


def moe_run(path: Path, *, lr: float = 1e-3) -> Path:
    """20 steps logged every step, a restart after step 10 (steps 11-20 by the second process),
    capture/compile rows, MoE statistics; the time axis is exact so that wall time is known."""
    rows = []
    for step in range(1, 21):
        second = step > 10
        row = {"step": step, "loss": 8.0 - 0.1 * step, "lr": lr, "grad_norm": 1.0 / step,
               "tokens_per_s": 1000.0 * step, "mfu": 0.1 * step, "memory_gb": 1.0, "max_memory_gb": 1.0 + step / 100,
               "data_s": 0.01, "step_s": 0.1, "time": (1000.0 if second else 0.0) + step,
               "aux_loss": 0.01, "expert_load_max": 1.5, "expert_load_min": 0.5,
               "moe/layer2/load_max": 1.0 + step / 10, "expert_load": expert_loads(step)}
        if step in (1, 11):
            row.update(capture_s=2.0, compile_s=5.0)
        rows.append(row)
        if step % 10 == 0:
            rows.append({"step": step, "val_loss": 7.0 - step / 100})
    config = {"training": {"steps": 20, "mode": "graph"}, "optimizer": {"lr": lr}, "job": {"name": path.name}}
    return write_run(path, rows, config=config, starts=[{"step": 0, "time": 0.5}, {"step": 10, "time": 1009.0}])


def test_summary_numbers(tmp_path):
    run = report.load_run(moe_run(tmp_path / "a"))
    s = report.summary(run)
    assert s["final loss"] == "6.0000" and s["final val loss"] == "6.8000"
    # After warm-up: the first row of each process (steps 1 and 11) and steps <= 2 (10 % of 20) out.
    # Kept: steps 3-10 and 12-20, 17 rows, median step 12 (with step 11 it would be 11,500; with all, 10,500).
    assert s["median tokens/s"] == "12,000" and s["median MFU"] == "1.20 %"
    assert s["peak memory"] == "1.20 GB"
    assert s["restarts"] == "1"
    # Process 1: 0.5 s -> step 10 at 10 s; process 2: 1009 s -> step 20 at 1020 s.
    assert report.wall_seconds(run) == pytest.approx(9.5 + 11.0)
    assert s["steps"] == "20 / 20"


def test_config_differences_and_smoothing(tmp_path):
    a = report.load_run(moe_run(tmp_path / "a", lr=1e-3))
    b = report.load_run(moe_run(tmp_path / "b", lr=3e-4))
    b.config["data.source"] = "x"
    diff = dict(report.config_differences([a, b]))
    assert diff == {"optimizer.lr": ["0.001", "0.0003"], "job.name": ['"a"', '"b"'],
                    "data.source": ["(absent)", '"x"']}
    assert report.ema([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])  # no start-up bias
    smoothed = report.ema([0.0, 10.0])
    assert smoothed[0] == 0.0 and 0.0 < smoothed[1] < 10.0


def test_report_is_self_contained(tmp_path):
    runs = [moe_run(tmp_path / "a"), moe_run(tmp_path / "b", lr=3e-4)]
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "png")]) == 0
    page = (tmp_path / "r.html").read_text()
    # Every plot a pre-training MoE run has data for (DPO's rewards and GRPO's are other objectives';
    # goodput needs goodput.json: test_goodput_summarised_and_drawn_as_a_stacked_bar).
    names = [name for name, _, _ in report.PLOTS
             if name not in ("rewards", "reward_accuracy", "goodput", "benchmarks", "benchmark_perplexity",
                             *report.GRPO_PLOTS)]
    names += ["expert_heat_map_1", "expert_heat_map_2"]  # one routing heat map per MoE run
    assert sorted(p.stem for p in (tmp_path / "png").glob("*.png")) == sorted(names)  # all data is present
    assert page.count("<img ") == len(names)
    assert not re.search(r"<script|<link|@import|url\(|https?://", page, re.IGNORECASE)
    assert all(src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page))
    assert "optimizer.lr" in page and "How the configs differ" in page


def test_plots_only_where_data_exists(tmp_path):
    rows = [{"step": s, "loss": 5.0, "lr": 1e-3} for s in range(1, 4)]
    run = write_run(tmp_path / "dense", rows, config={}, starts=[])
    out = report.write_report([run], png_dir=tmp_path / "png")
    assert out == run / "report.html"
    assert sorted(p.stem for p in (tmp_path / "png").glob("*.png")) == ["loss", "lr"]
    assert ">n/a<" in out.read_text()  # no throughput rows: the summary says so


def test_expert_heat_map_from_the_last_row_of_moe_runs_only(tmp_path):
    moe = moe_run(tmp_path / "moe")
    dense = write_run(tmp_path / "dense", [{"step": s, "loss": 5.0} for s in range(1, 4)], config={}, starts=[])
    assert report.last_expert_load(report.load_run(moe)) == (20, expert_loads(20))  # the last row's
    assert report.last_expert_load(report.load_run(dense)) is None
    out = report.write_report([dense, moe], out=tmp_path / "r.html", png_dir=tmp_path / "png")
    page = out.read_text()
    # Named by the run's place on the command line: the MoE run is the second; the dense run has none.
    assert {p.stem for p in (tmp_path / "png").glob("expert_heat_map*.png")} == {"expert_heat_map_2"}
    assert page.count('id="expert_heat_map') == 1
    assert 'alt="MoE routing at step 20: tokens per expert / layer mean (moe)"' in page
    alone = report.write_report([moe], png_dir=tmp_path / "alone")
    assert (tmp_path / "alone" / "expert_heat_map.png").is_file() and 'id="expert_heat_map"' in alone.read_text()


def test_dpo_rewards_plotted_and_summarised(tmp_path):
    rows = [{"step": s, "loss": 0.69 - s / 100, "rewards/chosen": s / 10, "rewards/rejected": -s / 10,
             "rewards/margins": s / 5, "rewards/accuracies": s / 4} for s in range(1, 5)]
    run = write_run(tmp_path / "dpo", rows, config={}, starts=[])
    out = report.write_report([run], png_dir=tmp_path / "png")
    assert {"rewards", "reward_accuracy"} <= {p.stem for p in (tmp_path / "png").glob("*.png")}
    assert report.summary(report.load_run(run))["final reward accuracy"] == "1.000"
    assert "final reward margin" in out.read_text()


def test_grpo_metrics_plotted_and_summarised(tmp_path):
    rows = [{"step": s, "loss": 0.01, "reward": s / 10, "reward_std": 0.3, "kl": s / 100, "clip_ratio/region_mean": 0.1,
             "completions/mean_length": 5.0, "completions/min_length": 2.0, "completions/max_length": 8.0,
             "sampling_s": 0.5, "training_s": 0.7} for s in range(1, 5)]
    run = write_run(tmp_path / "grpo", rows, config={}, starts=[])
    report.write_report([run], png_dir=tmp_path / "png")
    assert set(report.GRPO_PLOTS) <= {p.stem for p in (tmp_path / "png").glob("*.png")}
    summary = report.summary(report.load_run(run))
    assert summary["first reward"] == "0.100" and summary["final reward"] == "0.400"


def test_missing_run_is_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (.ci/run installs it)")
def test_report_of_real_runs_in_headless_chromium(tmp_path, train_overrides):
    """Two real training runs overlaid; Chromium opens the page with networking off, every image
    decodes, the page makes no request but its own, and a screenshot is kept."""
    common = dict(training__steps=6, training__batch_size=2, training__seq_len=64, validation__freq=3,
                  checkpoint__enabled="false")
    assemble(build_config(LLAMA_DEBUG, train_overrides(**common))).train()
    assemble(build_config(LLAMA_DEBUG, train_overrides(optimizer__lr=3e-4, output_dir=tmp_path / "run_lr3e-4",
                                                      **common))).train()
    out = report.write_report([tmp_path / "run", tmp_path / "run_lr3e-4"], out=tmp_path / "report.html")

    page = visit(str(out))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "report_screenshot.png").write_bytes(page.screenshot_png)
    assert len(page.images) == 8  # loss, lr, grad norm, throughput, MFU, memory, data wait, goodput
    for image in page.images:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0, image
    assert page.requests and page.requests[0].startswith("file://")  # the document itself was seen
    assert [u for u in page.requests if not u.startswith(("file://", "data:"))] == []
    assert [u for u in page.resources if not u.startswith("data:")] == []
    assert page.scripts == 0
    assert page.screenshot_png.startswith(b"\x89PNG")


def test_goodput_summarised_and_drawn_as_a_stacked_bar(tmp_path):
    run = moe_run(tmp_path / "a")
    seconds = {"productive": 15.0, "recomputed": 1.0, "startup": 3.0, "checkpoint_save": 1.0}
    processes = [{"start": 0.0, "last": 12.0, "step_start": 0, "step_last": 11, "seconds": seconds,
                  "recomputed_steps": 0},
                 {"start": 14.0, "last": 20.0, "step_start": 10, "step_last": 20, "seconds": {"recomputed": 1.0},
                  "recomputed_steps": 1}]
    (run / "goodput.json").write_text(json.dumps({"version": 1, "processes": processes}))
    rows = report.summary(report.load_run(run))
    assert rows["goodput"] == "75.0 %" and rows["steps recomputed after failures"] == "1"
    report.write_report([run], png_dir=tmp_path / "png")
    assert (tmp_path / "png" / "goodput.png").is_file()


def test_benchmark_scores_plotted(tmp_path):
    """[evaluation] rows: the scores on one plot, the perplexities on a log-scale one."""
    rows = [{"step": s, "loss": 5.0} for s in range(1, 5)]
    rows += [{"step": s, "eval/arc_easy/acc": 0.25 + s / 100, "eval/arc_easy/acc_norm": 0.3,
              "eval/wikitext/word_perplexity": 900.0 / s} for s in (2, 4)]
    run = write_run(tmp_path / "bench", rows, config={}, starts=[])
    report.write_report([run], png_dir=tmp_path / "png")
    assert {"benchmarks", "benchmark_perplexity"} <= {p.stem for p in (tmp_path / "png").glob("*.png")}
    loaded = [report.load_run(run)]
    assert report._benchmark_keys(loaded, scores=True) == ["eval/arc_easy/acc", "eval/arc_easy/acc_norm"]
    assert report._benchmark_keys(loaded, scores=False) == ["eval/wikitext/word_perplexity"]
