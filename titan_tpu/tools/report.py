"""``titan-tpu report RUN_DIR [RUN_DIR ...]``: one HTML file that shows a run, or several overlaid.

What a run directory holds and the report reads (train/metrics.py writes them):

    metrics.jsonl   one row per logged step: loss, lr, grad_norm, tokens_per_s, mfu, memory_gb,
                    max_memory_gb, data_s, step_s, time; val_loss rows; eval/<task>/<metric> rows
                    of the [evaluation] tasks; capture_s/compile_s on the first row of a process;
                    aux_loss, expert_load_max/min, moe/layer<i>/* and the expert_load dict of
                    per-expert loads for MoE models (loops/routing.py)
    config.json     the full config of the run (the config table compares these)
    events.jsonl    one line per process start (restarts = starts - 1)
    goodput.json    where the run's wall time went, per process (train/goodput.py): the goodput plot

The HTML is self-contained: every plot is a PNG inside the page as a data: URI, the style sheet is
inline, and there is no script, font or link to fetch, so it opens the same from a laptop, a mail
attachment or a machine without network. Plots are drawn with matplotlib's Agg backend (no display
needed); ``--png DIR`` also writes each plot as a PNG file.

A plot appears only when some run has its data (no MoE plot for dense models, no capture/compile
plot for eager runs). An MoE run's routing heat map (layers x experts, colour = tokens per expert /
the layer's mean) is drawn from its last row with the `expert_load` dict: the routing as the run
left it, one step's loads, not an average that would blur a collapse under way (metrics.jsonl and
the trackers' moe/layer<i>/* keys hold the history). One heat map per MoE run, after the other plots.

"After warm-up" in the summary means: leaving out the first logged row of every process (its window
holds compilation and the first, slow steps) and the first 10 % of the run's steps.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_tpu.train.checkpoint import _flatten as flatten  # "section.key" names
from titan_tpu.train.goodput import BUCKETS, read_processes, totals as goodput_totals
from titan_tpu.train.metrics import format_duration

SMOOTHING = 0.9  # weight of the exponential moving average of the smoothed loss (TensorBoard's slider)
WARMUP_FRACTION = 0.1


@dataclass
class Run:
    path: Path
    label: str
    rows: list[dict[str, Any]]  # every row of metrics.jsonl, in file order
    config: dict[str, Any]  # flattened: "training.steps" -> 200
    starts: list[dict[str, Any]] = field(default_factory=list)  # events.jsonl "start" lines
    goodput: dict[str, Any] | None = None  # train/goodput.py totals of goodput.json, if the run has one

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have a number for ``key``."""
        pairs = [(r["step"], r[key]) for r in self.rows if isinstance(r.get(key), (int, float))
                 and not isinstance(r.get(key), bool)]
        return [s for s, _ in pairs], [float(v) for _, v in pairs]

    def has(self, key: str) -> bool:
        return any(isinstance(r.get(key), (int, float)) for r in self.rows)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a killed process
    return rows


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{path} has no metrics.jsonl; pass a run directory (the output_dir of a training run)")
    config_file = path / "config.json"
    config = flatten(json.loads(config_file.read_text())) if config_file.is_file() else {}
    starts = [e for e in _read_jsonl(path / "events.jsonl") if e.get("event") == "start"]
    processes = read_processes(path)
    return Run(path=path, label=path.name, rows=_read_jsonl(path / "metrics.jsonl"), config=config, starts=starts,
               goodput=goodput_totals(processes) if processes else None)


def _unique_labels(runs: list[Run]) -> None:
    """Directory names, or parent/name where two runs share a name."""
    names = [r.label for r in runs]
    for run in runs:
        if names.count(run.label) > 1:
            run.label = f"{run.path.parent.name}/{run.path.name}"


# ------------------------------------------------------------------------------------------------
# summary


def _after_warmup(run: Run, key: str) -> list[float]:
    total = run.config.get("training.steps") or max((r["step"] for r in run.rows), default=0)
    skip_before = WARMUP_FRACTION * total
    first_rows, seen = set(), set()
    for index, row in enumerate(run.rows):  # the first training row after each process start
        if "loss" in row and "tokens_per_s" in row:
            start = _segment(run, row)
            if start not in seen:
                seen.add(start)
                first_rows.add(index)
    return [float(r[key]) for i, r in enumerate(run.rows) if isinstance(r.get(key), (int, float))
            and i not in first_rows and r["step"] > skip_before]


def _segment(run: Run, row: dict) -> int:
    """Which process wrote a row: the index of the last start whose time is not after the row's."""
    t = row.get("time")
    if t is None:
        return 0
    return max([i for i, s in enumerate(run.starts) if s.get("time", 0) <= t], default=0)


def wall_seconds(run: Run) -> float | None:
    """Sum over the processes of the run of (its last row's time - its start time)."""
    if not run.starts or not any("time" in r for r in run.rows):
        return None
    last: dict[int, float] = {}
    for row in run.rows:
        if isinstance(row.get("time"), (int, float)):
            seg = _segment(run, row)
            last[seg] = max(last.get(seg, 0.0), row["time"])
    return sum(t - run.starts[seg]["time"] for seg, t in last.items() if seg < len(run.starts))


def summary(run: Run) -> dict[str, str]:
    def last(key):
        _, values = run.series(key)
        return values[-1] if values else None

    def median(key):
        values = _after_warmup(run, key)
        return statistics.median(values) if values else None

    steps, _ = run.series("loss")
    peak = [v for key in ("max_memory_gb", "memory_gb") for v in run.series(key)[1]]
    wall = wall_seconds(run)
    total = run.config.get("training.steps")
    rows = {
        "steps": f"{steps[-1] if steps else 0}" + (f" / {total}" if total else ""),
        "final loss": _fmt(last("loss"), "{:.4f}"),
        "final val loss": _fmt(last("val_loss"), "{:.4f}"),
        "median tokens/s": _fmt(median("tokens_per_s"), "{:,.0f}"),
        "median MFU": _fmt(median("mfu"), "{:.2f} %"),
        "peak memory": _fmt(max(peak) if peak else None, "{:.2f} GB"),
        "wall time": _fmt(wall, "{}", transform=format_duration),
        "restarts": str(max(len(run.starts) - 1, 0)) if run.starts else "n/a",
    }
    if run.goodput is not None:
        rows["goodput"] = f"{run.goodput['goodput']:.1f} %"
        rows["steps recomputed after failures"] = str(run.goodput["recomputed_steps"])
    if last("rewards/accuracies") is not None:  # a DPO run (docs/dpo.md)
        rows["final reward accuracy"] = _fmt(last("rewards/accuracies"), "{:.3f}")
        rows["final reward margin"] = _fmt(last("rewards/margins"), "{:.4f}")
    if last("reward") is not None:  # a GRPO run (docs/grpo.md)
        rows["final reward"] = _fmt(last("reward"), "{:.3f}")
        rows["first reward"] = _fmt(run.series("reward")[1][0], "{:.3f}")
    return rows


def _fmt(value, pattern: str, transform=None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return pattern.format(transform(value) if transform else value)


def config_differences(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(key, value per run) for every config key whose value is not the same in all runs."""
    keys = sorted(set().union(*(r.config for r in runs)))
    missing = object()
    rows = []
    for key in keys:
        values = [r.config.get(key, missing) for r in runs]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, ["(absent)" if v is missing else json.dumps(v) for v in values]))
    return rows


# ------------------------------------------------------------------------------------------------
# plots


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average with the start-up bias removed (as TensorBoard's smoothing);
    non-finite values are skipped."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            avg, norm = weight * avg + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(avg / norm if norm else float("nan"))
    return out


def _line_plot(ax, runs, colors, key, *, label_suffix="", style="-", scale=1.0, alpha=1.0) -> bool:
    drawn = False
    for run, color in zip(runs, colors):
        steps, values = run.series(key)
        if steps:
            ax.plot(steps, [v * scale for v in values], style, color=color, alpha=alpha, linewidth=1.4,
                    label=f"{run.label}{label_suffix}", markersize=4)
            drawn = True
    return drawn


def _plot_loss(ax, runs, colors) -> bool:
    drawn = False
    for run, color in zip(runs, colors):
        steps, values = run.series("loss")
        if steps:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1.0)
            ax.plot(steps, ema(values), color=color, linewidth=1.8, label=f"{run.label} (smoothed)")
            drawn = True
        val_steps, val = run.series("val_loss")
        if val_steps:
            ax.plot(val_steps, val, "o--", color=color, markersize=5, linewidth=1.2, label=f"{run.label} validation")
            drawn = True
    ax.set_ylabel("cross-entropy")
    return drawn


def _plot_share(ax, runs, colors) -> bool:
    drawn = False
    for run, color in zip(runs, colors):
        pairs = [(r["step"], 100.0 * r["data_s"] / r["step_s"]) for r in run.rows
                 if isinstance(r.get("data_s"), (int, float)) and isinstance(r.get("step_s"), (int, float))
                 and r["step_s"] > 0]
        if pairs:
            ax.plot([s for s, _ in pairs], [v for _, v in pairs], color=color, linewidth=1.4, label=run.label)
            drawn = True
    ax.set_ylabel("% of step time")
    return drawn


def _plot_compile(ax, runs, colors) -> bool:
    keys = ("capture_s", "compile_s")
    totals = [[sum(run.series(k)[1]) for k in keys] for run in runs]
    if not any(any(t) for t in totals):
        return False
    width = 0.8 / len(runs)
    for i, (run, color, values) in enumerate(zip(runs, colors, totals)):
        ax.bar([j + i * width for j in range(len(keys))], values, width=width, color=color, label=run.label)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(keys))], ["capture", "compile"])
    ax.set_ylabel("seconds (all processes of the run)")
    return True


def _plot_goodput(ax, runs, colors) -> bool:
    """One horizontal bar per run, stacked by where its wall time went (train/goodput.py buckets)."""
    import matplotlib.pyplot as plt

    measured = [r for r in runs if r.goodput is not None]
    if not measured:
        return False
    palette = plt.get_cmap("tab10")
    for j, bucket in enumerate(BUCKETS):
        widths = [r.goodput["seconds"][bucket] for r in measured]
        lefts = [sum(r.goodput["seconds"][b] for b in BUCKETS[:j]) for r in measured]
        if any(widths):
            ax.barh([r.label for r in measured], widths, left=lefts, color=palette(j % 10),
                    label=bucket.replace("_", " "))
    ax.set_xlabel("seconds of wall time (all processes of the run, and the time between them)")
    return True


def _plot_memory(ax, runs, colors) -> bool:
    drawn = _line_plot(ax, runs, colors, "memory_gb")
    drawn |= _line_plot(ax, runs, colors, "max_memory_gb", label_suffix=" (peak)", style="--")
    ax.set_ylabel("GB per device")
    return drawn


def _plot_experts(ax, runs, colors) -> bool:
    drawn = _line_plot(ax, runs, colors, "expert_load_max", label_suffix=" max/mean")
    drawn |= _line_plot(ax, runs, colors, "expert_load_min", label_suffix=" min/mean", style="--")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("tokens per expert / mean")
    return drawn


def _simple(key: str, ylabel: str, *, log: bool = False):
    def plot(ax, runs, colors) -> bool:
        drawn = _line_plot(ax, runs, colors, key)
        ax.set_ylabel(ylabel)
        if log and drawn:
            ax.set_yscale("log")
        return drawn
    return plot


def _lines(ylabel: str, *series: tuple[str, str, str]):
    """A plot of several metrics on one axis: (metric key, label suffix, line style) each."""
    def plot(ax, runs, colors) -> bool:
        drawn = False
        for key, suffix, style in series:
            drawn |= _line_plot(ax, runs, colors, key, label_suffix=suffix, style=style)
        ax.set_ylabel(ylabel)
        return drawn
    return plot


def _benchmark_keys(runs, *, scores: bool) -> list[str]:
    """The eval/<task>/<metric> keys of the runs' [evaluation] rows: scores (every value in [0, 1]:
    accuracies, exact match) or the rest (perplexities, bits per byte)."""
    keys = sorted({key for run in runs for row in run.rows for key in row if key.startswith("eval/")})
    return [key for key in keys if all(0.0 <= v <= 1.0 for run in runs for v in run.series(key)[1]) == scores]


def _benchmarks(ylabel: str, *, scores: bool):
    def plot(ax, runs, colors) -> bool:
        drawn = False
        for key, style in zip(_benchmark_keys(runs, scores=scores), ("o-", "s--", "^:", "d-.") * 8):
            drawn |= _line_plot(ax, runs, colors, key, label_suffix=f" {key.removeprefix('eval/')}", style=style)
        ax.set_ylabel(ylabel)
        if drawn and not scores:
            ax.set_yscale("log")
        return drawn
    return plot


_plot_rewards = _lines("reward", ("rewards/chosen", " chosen", "-"), ("rewards/rejected", " rejected", "--"),
                       ("rewards/margins", " margins", ":"))
_plot_grpo_reward = _lines("reward", ("reward", " mean", "-"), ("reward_std", " std within groups", "--"))
_plot_grpo_lengths = _lines("tokens per completion", ("completions/mean_length", " mean", "-"),
                            ("completions/min_length", " min", ":"), ("completions/max_length", " max", "--"))
_plot_grpo_time = _lines("seconds per step", ("sampling_s", " sampling", "-"), ("training_s", " training", "--"))


# The plots of a GRPO run (docs/grpo.md): absent from other runs.
GRPO_PLOTS = ("grpo_reward", "grpo_kl", "grpo_clip", "grpo_lengths", "grpo_time")

# (file name, title, plot function): the report's plots in page order.
PLOTS = (
    ("loss", "Loss (raw, smoothed) and validation loss", _plot_loss),
    ("lr", "Learning rate", _simple("lr", "learning rate")),
    ("grad_norm", "Gradient norm (before clipping)", _simple("grad_norm", "global L2 norm", log=True)),
    ("tokens_per_s", "Throughput", _simple("tokens_per_s", "tokens / s (all ranks)")),
    ("mfu", "Model FLOPs utilisation", _simple("mfu", "MFU (%)")),
    ("memory", "Memory", _plot_memory),
    ("data_wait", "Share of each step spent waiting for data", _plot_share),
    ("compile", "Graph capture and compile time", _plot_compile),
    ("goodput", "Where the wall time went (goodput: the productive share)", _plot_goodput),
    ("benchmarks", "Benchmark scores during training (lm-eval tasks, held-out scoring)",
     _benchmarks("score", scores=True)),
    ("benchmark_perplexity", "Benchmark perplexities during training (lm-eval tasks)",
     _benchmarks("perplexity, bits per byte", scores=False)),
    ("expert_load", "MoE expert load", _plot_experts),
    ("aux_loss", "MoE balancing loss", _simple("aux_loss", "auxiliary loss")),
    ("rewards", "DPO rewards (beta x log-ratio to the reference, mean over pairs)", _plot_rewards),
    ("reward_accuracy", "DPO reward accuracy (pairs whose chosen reward is the larger)",
     _simple("rewards/accuracies", "share of pairs")),
    ("grpo_reward", "GRPO reward (mean over samples; standard deviation within a prompt's group)", _plot_grpo_reward),
    ("grpo_kl", "GRPO KL to the reference (mean per completion token)", _simple("kl", "KL")),
    ("grpo_clip", "GRPO clipped share (completion tokens whose ratio was clipped)",
     _simple("clip_ratio/region_mean", "share of tokens")),
    ("grpo_lengths", "GRPO completion lengths", _plot_grpo_lengths),
    ("grpo_time", "GRPO time per step: sampling and training", _plot_grpo_time),
)


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def last_expert_load(run: Run) -> tuple[int, dict[str, list[float]]] | None:
    """(step, {"layer3": [load / mean per expert], ...}) of the run's last row that has the
    `expert_load` dict (loops/routing.py); None for a dense run or one logged before it existed."""
    rows = [r for r in run.rows if isinstance(r.get("expert_load"), dict) and r["expert_load"]]
    return (rows[-1]["step"], rows[-1]["expert_load"]) if rows else None


def _draw_heat_map(ax, fig, loads: dict[str, list[float]]) -> None:
    """Layers (rows, by transformer block) x experts on a log scale centred on an even share: white
    is even, red a busy expert, blue an idle one, equally deep for 2x and 1/2x; black a dead one."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter

    names = list(loads)
    n_layers, n_experts = len(names), len(loads[names[0]])
    # Symmetric around 1 from the busiest expert (at least 2x, so a balanced run stays pale); idler
    # experts than 1/limit are drawn at 1/limit, a dead one (0: no log) in the colour map's "bad" black.
    limit = max(2.0, max(max(row) for row in loads.values()))
    grid = [[max(v, 1.0 / limit) if v > 0 else float("nan") for v in loads[name]] for name in names]
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="black")
    norm = LogNorm(vmin=1.0 / limit, vmax=limit)
    image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    every = max(1, n_layers // 32)  # at most ~32 row labels: a 94-layer model stays readable
    ax.set_yticks(range(0, n_layers, every), [names[i].removeprefix("layer") for i in range(0, n_layers, every)])
    if n_experts <= 32:
        ax.set_xticks(range(n_experts))
    ax.tick_params(labelsize=8)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer (transformer block)")
    bar = fig.colorbar(image, ax=ax, label="tokens / layer mean (black: 0 tokens)")
    powers = [2.0 ** k for k in range(-8, 9) if 1.0 / limit <= 2.0 ** k <= limit]
    bar.ax.yaxis.set_major_locator(FixedLocator(powers))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v >= 1 else f"1/{1 / v:g}"))
    bar.ax.yaxis.set_minor_locator(FixedLocator([]))
    if n_layers * n_experts <= 256:  # small enough to print each value in its cell
        for i, name in enumerate(names):
            for j, value in enumerate(loads[name]):
                dark = value == 0 or abs(float(norm(grid[i][j])) - 0.5) > 0.3  # black, deep red or deep blue
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")


def expert_heat_maps(runs: list[Run]) -> list[tuple[str, str, bytes]]:
    """(name, title, PNG bytes): one routing heat map per MoE run (module docstring)."""
    import matplotlib.pyplot as plt

    images = []
    for index, run in enumerate(runs):
        last = last_expert_load(run)
        if last is None:
            continue
        step, loads = last
        title = f"MoE routing at step {step}: tokens per expert / layer mean ({run.label})"
        fig, ax = plt.subplots(figsize=(7.0, min(max(3.6, 2.4 + 0.3 * len(loads)), 12.0)), dpi=100)
        try:
            _draw_heat_map(ax, fig, loads)
            ax.set_title(title, fontsize=11)
            fig.tight_layout()
            name = "expert_heat_map" if len(runs) == 1 else f"expert_heat_map_{index + 1}"
            images.append((name, title, _png(fig)))
        finally:
            plt.close(fig)
    return images


def render_plots(runs: list[Run]) -> list[tuple[str, str, bytes]]:
    """(name, title, PNG bytes) of every plot that some run has data for, then the MoE runs' heat maps."""
    import matplotlib

    matplotlib.use("Agg")  # no display: draw into memory
    import matplotlib.pyplot as plt

    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    images = []
    for name, title, plot in PLOTS:
        fig, ax = plt.subplots(figsize=(7.0, 3.6), dpi=100)
        try:
            if not plot(ax, runs, colors):
                continue
            ax.set_title(title, fontsize=11)
            if name not in ("compile", "goodput"):
                ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8, loc="best")
            fig.tight_layout()
            images.append((name, title, _png(fig)))
        finally:
            plt.close(fig)
    return images + expert_heat_maps(runs)


# ------------------------------------------------------------------------------------------------
# HTML

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1500px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(640px, 1fr)); gap: 1em; }
figure { margin: 0; } img { width: 100%; height: auto; border: 1px solid #eee; }
.note { color: #666; font-size: 0.9em; }
"""


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if i >= numeric_from else ''}>{html.escape(c)}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(runs: list[Run], images: list[tuple[str, str, bytes]]) -> str:
    labels = [r.label for r in runs]
    summaries = [summary(r) for r in runs]
    keys = dict.fromkeys(key for s in summaries for key in s)  # a DPO run's rows after the common ones
    summary_rows = [[key] + [s.get(key, "n/a") for s in summaries] for key in keys]
    parts = [f"<h1>Training report: {html.escape(', '.join(labels))}</h1>",
             "<h2>Summary</h2>", _table(["run"] + labels, summary_rows),
             f"<p class=note>Medians leave out the first logged row of every process and the first "
             f"{WARMUP_FRACTION:.0%} of the steps (warm-up, compilation). Wall time: from each process's start "
             "to its last logged step, summed over restarts.</p>"]
    if len(runs) > 1:
        diff = config_differences(runs)
        parts.append("<h2>How the configs differ</h2>")
        parts.append(_table(["key"] + labels, [[k] + v for k, v in diff], numeric_from=len(labels) + 1)
                     if diff else "<p>The configs are identical.</p>")
    else:
        keys = ("model.name", "model.flavor", "training.steps", "training.batch_size", "training.seq_len",
                "training.mode", "optimizer.lr", "parallelism.dp_shard", "training.device")
        rows = [[k, json.dumps(runs[0].config[k])] for k in keys if k in runs[0].config]
        parts += ["<h2>Configuration (main keys)</h2>", _table(["key", "value"], rows, numeric_from=2)]
    parts.append("<h2>Plots</h2><div class=plots>")
    for name, title, png in images:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<figure id="{name}"><img alt="{html.escape(title)}" src="data:image/png;base64,{data}">'
                     "</figure>")
    parts.append("</div>")
    sources = "".join(f"<li>{html.escape(r.label)}: {html.escape(str(r.path.resolve()))}</li>" for r in runs)
    parts.append(f"<h2>Runs</h2><ul class=note>{sources}</ul>")
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>titan-tpu report: {html.escape(', '.join(labels))}</title>"
            f"<style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n")


def write_report(run_dirs: list[str | Path], *, out: str | Path | None = None,
                 png_dir: str | Path | None = None) -> Path:
    """Write the report of ``run_dirs`` (default: report.html in the first run directory);
    returns its path. With ``png_dir`` every plot is also written there as <name>.png."""
    if not run_dirs:
        raise ValueError("titan-tpu report needs at least one run directory")
    runs = [load_run(p) for p in run_dirs]
    _unique_labels(runs)
    images = render_plots(runs)
    out = Path(out) if out else runs[0].path / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(runs, images), encoding="utf-8")
    if png_dir is not None:
        png_dir = Path(png_dir)
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, _, png in images:
            (png_dir / f"{name}.png").write_bytes(png)
    return out


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="titan-tpu report",
        description="One self-contained HTML file with the plots and a summary of one or more runs (overlaid), "
                    "and a table of how their configs differ.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output_dir of a training run")
    parser.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html of the first run)")
    parser.add_argument("--png", metavar="DIR", help="also write every plot as DIR/<name>.png")
    args = parser.parse_args(argv)
    out = write_report(args.run_dirs, out=args.out, png_dir=args.png)
    print(f"wrote {out}")
    return 0
