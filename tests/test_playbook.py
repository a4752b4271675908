"""docs/playbook.md stays true to the code: every config flag it names exists in the schema and
takes the values it shows, and every command it shows parses (titan-tpu plan commands run)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from titan_tpu.cli import COMMANDS, main
from titan_tpu.config import Config, build_config, set_value

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = (ROOT / "docs" / "playbook.md").read_text()


def _spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", PLAYBOOK)


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", PLAYBOOK, flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    inline = [s for s in _spans() if s.startswith(("titan-tpu ", "python bench/"))]
    return [c for c in lines + inline if c]


def test_every_flag_exists_with_the_values_shown():
    flags = [s for s in _spans() if s.startswith("--") and "." in s.split()[0]]
    assert len(flags) > 15
    for span in flags:
        # `--a.b v1 | v2` (choices), `--a.b v --c.d w` (several), `--a.b N` (a placeholder)
        for key, values in re.findall(r"--([a-z_]+\.[a-z_]+)((?:\s+(?!--)[^\s|]+(?:\s*\|\s*[^\s|]+)*)?)", span):
            choices = [v.strip() for v in values.split("|") if v.strip()]
            for value in choices or [None]:
                cfg = Config()
                if value is None or re.fullmatch(r"[A-Z]+", value):
                    set_value(cfg, key, getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]))  # exists
                else:
                    set_value(cfg, key, value)


def _bench_parser(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up (bench/playbook.py's Row)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.build_parser()


@pytest.mark.parametrize("command", _commands())
def test_every_command_parses(command, capsys):
    argv = shlex.split(command)
    if argv[0] == "python":
        parser = _bench_parser(argv[1])
        args, rest = parser.parse_known_args(argv[2:])
        assert all(r.startswith("--") and "." in r for r in rest[::2])  # only config overrides left over
        return
    if argv[0] == ".venv-tpu/bin/titan-tpu":  # the same command from the TPU environment (--certify compiles)
        argv[0] = "titan-tpu"
    assert argv[0] == "titan-tpu"
    assert argv[1] in COMMANDS
    if "--config" not in argv:  # a command named with some of its options: each is one of its options
        with pytest.raises(SystemExit):
            main([argv[1], "--help"])
        usage = capsys.readouterr().out
        assert all(f"{a} " in usage or f"{a}\n" in usage for a in argv[2:] if a.startswith("--"))
        return
    argv = [a.replace("YOUR.toml", "configs/llama3_debug.toml").strip("[]") for a in argv[1:]]
    hardware = argv[argv.index("--hardware") + 1] if "--hardware" in argv else ""
    if hardware.startswith("v"):  # a TPU plan of the reader's recipe is of its graph mode (docs/tpu.md)
        argv += ["--training.mode", "graph"]
    argv = [str(ROOT / a) if a.startswith("configs/") else a for a in argv]
    if argv[0] == "plan":
        if "--certify" in argv:  # the search runs here; certifying compiles its top K (minutes, .venv-tpu)
            i = argv.index("--certify")
            argv = argv[:i] + argv[i + 2:]
        assert main(argv) == 0, capsys.readouterr().err
    else:
        config = argv[argv.index("--config") + 1]
        build_config(config, [a for a in argv[1:] if a not in ("--config", config)])


def test_playbook_bench_measures_each_baseline_beside_its_variant(monkeypatch):
    """bench/playbook.py: a row is pairs of runs, baseline and variant back to back in alternating
    order, and each column is the median of the pairs' ratios (not a ratio of medians, nor one
    baseline shared by rows and measured long before)."""
    spec = importlib.util.spec_from_file_location("playbook_bench", ROOT / "bench" / "playbook.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "playbook_bench", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    calls = []
    # tokens/s per run, in call order: the machine slows down 10x over the run; the variant is 2x,
    # 1x and 3x its baseline in the three pairs.
    speeds = iter([200.0, 100.0, 50.0, 50.0, 30.0, 10.0])

    def fake_measure(row, overrides, out, tag):
        calls.append((tag, overrides))
        return {"tokens_per_s": next(speeds), "peak_gb": 2.0 if tag == "var" else 1.0, "compile_s": 0.0,
                "wall_s": 1.0}

    monkeypatch.setattr(bench, "measure", fake_measure)
    row = bench.Row("k", "v", ("--a.b", "1"), base=("--c.d", "2"))
    got = bench.measure_pairs(row, Path("."), rounds=3, first=1)
    assert [tag for tag, _ in calls] == ["var", "base", "base", "var", "var", "base"]
    assert all(o == (("--c.d", "2", "--a.b", "1") if tag == "var" else ("--c.d", "2")) for tag, o in calls)
    assert got["ratio"] == {"tokens_per_s": 2.0, "peak_gb": 2.0, "compile_s": None}
    assert len(got["pairs"]) == 3


def test_playbook_tables_planner_columns_are_todays_planner(monkeypatch):
    """docs/playbook_tables.md's planner columns are what the planner says today (the CPU columns
    come from a 12-minute run and are kept as measured): `python bench/playbook.py --refresh-planner`
    rewrites them, and the refresh changes nothing but its date on a page that is current."""
    spec = importlib.util.spec_from_file_location("playbook_bench", ROOT / "bench" / "playbook.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "playbook_bench", bench)
    spec.loader.exec_module(bench)
    page = ROOT / "docs" / "playbook_tables.md"
    undated = lambda text: re.sub(r"refreshed \d{4}-\d\d-\d\d \d\d:\d\d UTC", "refreshed DATE", text)  # noqa: E731
    assert undated(bench.refresh_planner(page)) == undated(page.read_text()), \
        "docs/playbook_tables.md's planner columns are stale: python bench/playbook.py --refresh-planner"
