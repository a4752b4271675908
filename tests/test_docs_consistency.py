"""The pages agree with the code and with each other where a reader meets the same fact twice: how
many TPU recipes there are, whether fp8 runs on CUDA, which activation checkpointing a recipe
uses, how large its checkpoint is, and that a real run starts from `titan-tpu prepare-data`. Each
check reads the fact from the code or the recipe, not from another page, so a page that drifts
fails here with its name and line. History (log.md, planner_log.md) keeps the numbers of its day."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from test_docs_commands import FENCE, continues

from titan_tpu.config import build_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HISTORY = {"log.md", "planner_log.md"}
PAGES = [ROOT / "README.md", *(p for p in sorted(DOCS.glob("*.md")) if p.name not in HISTORY)]
TPU_RECIPES = sorted(p.stem for p in (ROOT / "configs").glob("*_tpu.toml"))


def _lines(page: Path) -> list[tuple[int, str]]:
    return list(enumerate(page.read_text().splitlines(), 1))


# ----------------------------------------------------------------------------------------------
# The number of TPU recipes

NUMBER_WORDS = {"twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17,
                "eighteen": 18, "nineteen": 19, "twenty": 20}
RECIPE_COUNT = re.compile(r"\b(\d+|" + "|".join(NUMBER_WORDS) + r")\s+(?:(?:TPU|compiled)\s+)*recipes\b",
                          re.IGNORECASE)


def recipe_counts(text: str) -> list[tuple[int, int, str]]:
    """(line, number, words) of every "N recipes", "N TPU recipes", "of the N compiled recipes"."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in RECIPE_COUNT.finditer(line):
            word = m.group(1).lower()
            found.append((number, int(word) if word.isdigit() else NUMBER_WORDS[word], m.group(0)))
    return found


def test_every_page_counts_the_tpu_recipes_as_there_are_files():
    """The recipes were 14, 16 or 17 depending on the page: a count a page states is the number of
    configs/*_tpu.toml (the GPU and CPU recipes are never counted this way on a page)."""
    failures = []
    for page in PAGES:
        for line, count, words in recipe_counts(page.read_text()):
            if count != len(TPU_RECIPES):
                failures.append(f"{page.relative_to(ROOT)}:{line}: {words!r}, but configs/ holds "
                                f"{len(TPU_RECIPES)} TPU recipes")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("line,count", [("on all 16 recipes", 16), ("the 14 TPU recipes", 14),
                                        ("14 of the 17 compiled recipes", 17), ("Sixteen recipes compile", 16)])
def test_a_stated_count_is_found(line, count):
    assert [n for _, n, _ in recipe_counts(line)] == [count]
    assert not recipe_counts("the 7 GPU recipes") and not recipe_counts("all but three of the compiled recipes")


# ----------------------------------------------------------------------------------------------
# fp8 on CUDA

FP8_DENIED = re.compile(r"\b(?:not supported|unsupported|not available|does not run|cannot run)\b", re.IGNORECASE)


def fp8_denials(text: str) -> list[str]:
    """Sentences that name fp8 and say it is not supported (or does not run)."""
    sentences = re.split(r"(?<=[.;:])\s+|\n\s*\n|\n-\s", text)
    return [" ".join(s.split()) for s in sentences if re.search(r"\bfp8\b", s, re.IGNORECASE) and FP8_DENIED.search(s)]


def test_no_page_says_fp8_training_is_unsupported():
    """fp8 linears run on CUDA (`torch._scaled_mm`), on both TPU runtimes and emulated on the CPU;
    gpu.md once said "fp8 training is not supported" beside pages that said it runs on CUDA."""
    failures = [f"{page.relative_to(ROOT)}: {sentence!r}"
                for page in PAGES for sentence in fp8_denials(page.read_text())]
    assert not failures, "\n".join(failures)


def test_fp8_denial_is_caught():
    assert fp8_denials("## Limits\n\n- fp8 training is not supported ([limits.md](limits.md)).")
    assert not fp8_denials("fp8 only for linear layers' matmuls: no delayed scaling, no fp8 all-gathers.")


def test_fp8_is_not_refused_on_cuda_and_calls_scaled_mm(monkeypatch):
    """What the pages say is what the code does: a CUDA recipe with fp8 on is a valid run, and the
    one fp8 matmul off the CPU is `torch._scaled_mm`."""
    import torch

    from titan_tpu.kernels import fp8
    from titan_tpu.run.setup import prepare_run

    cfg = build_config(ROOT / "configs" / "llama3_8b_cuda.toml", ["--fp8.enabled", "true"])
    assert cfg.fp8.enabled and cfg.training.device == "cuda"
    prepare_run(cfg)  # no refusal
    calls = []
    monkeypatch.setattr(fp8, "kernel_device_type", lambda device_type: "cuda")
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a) or torch.zeros(()))
    fp8.fp8_matmul(torch.randn(16, 32), torch.randn(32, 16), rowwise=True)
    assert len(calls) == 1
    for page in ("gpu.md", "fp8.md"):
        assert "torch._scaled_mm" in (DOCS / page).read_text(), page


# ----------------------------------------------------------------------------------------------
# Activation checkpointing as the recipes set it

AC_WORDS = {"full AC": "full", "selective AC": "selective", "no AC": "none", "no checkpointing": "none"}


def layout_rows() -> list[tuple[int, str, str]]:
    """(line, layout cell, command) of layouts.md's starting points."""
    rows = []
    for number, line in _lines(DOCS / "layouts.md"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[3].startswith("`titan-tpu plan"):
            rows.append((number, cells[2], cells[3].strip("`")))
    return rows


def test_layouts_names_each_recipes_checkpointing():
    """layouts.md once gave the one-host Qwen3-8B recipe full checkpointing where the recipe has
    none: every row names the checkpointing, and it is the one the command's config runs."""
    rows = layout_rows()
    assert len(rows) >= 15
    failures = []
    for line, layout, command in rows:
        flags = dict(zip(shlex.split(command)[2::2], shlex.split(command)[3::2]))  # after "titan-tpu plan"
        config = flags.pop("--config")
        flags.pop("--hardware", None)  # the planner's, not the config's
        cfg = build_config(ROOT / config, [x for pair in flags.items() for x in pair])
        stated = [mode for words, mode in AC_WORDS.items() if words in layout]
        if len(stated) != 1 or stated[0] != cfg.activation_checkpoint.mode:
            failures.append(f"docs/layouts.md:{line}: {layout!r}, but {config} runs activation_checkpoint.mode = "
                            f"{cfg.activation_checkpoint.mode!r}")
        if "scanned" in layout and not cfg.model.scan_layers:
            failures.append(f"docs/layouts.md:{line}: {layout!r}, but {config} does not scan its layers")
    assert not failures, "\n".join(failures)


def _paragraph(page: str, starts: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(starts)
    return text[start:text.find("\n\n", start)]


@pytest.mark.parametrize("page,starts", [("tpu.md", "Every TPU recipe runs graph mode"),
                                         ("layouts.md", "2. **Activation checkpointing next:**")])
def test_the_tpu_recipes_without_full_checkpointing_are_named(page, starts):
    """The pages say full checkpointing on the TPU recipes but the ones they name; those are exactly
    the recipes whose config sets another mode."""
    paragraph = _paragraph(page, starts)
    modes = {name: build_config(ROOT / "configs" / f"{name}.toml").activation_checkpoint.mode for name in TPU_RECIPES}
    others = {name for name, mode in modes.items() if mode != "full"}
    named = set(re.findall(r"`(\w+_tpu)\.toml`", paragraph))
    assert named == others, (f"docs/{page} names {sorted(named)} apart from full checkpointing; "
                             f"the recipes: {sorted(others)}")
    if "but one" in paragraph:
        assert len(others) == 1, f"docs/{page} says one recipe is not fully checkpointed: {sorted(others)}"


# ----------------------------------------------------------------------------------------------
# Checkpoint sizes in the guides

def _gb(name: str) -> str:
    from titan_tpu.plan import plan_config
    from titan_tpu.plan.setting import for_planning

    plan = plan_config(for_planning(ROOT / "configs" / f"{name}.toml"), measure=False)
    return f"{round(plan.checkpoint['bytes_total'] / 1e9):,} GB"


def checkpoint_cells(page: str) -> list[tuple[int, str, str]]:
    """(line, recipe, checkpoint cell) of a page's recipe table with a "checkpoint" column."""
    column, found = None, []
    for number, line in _lines(DOCS / page):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            column = None
        elif "checkpoint" in cells and cells[0] == "config":
            column = cells.index("checkpoint")
        elif column is not None and (m := re.fullmatch(r"`(\w+)\.toml`", cells[0])):
            found.append((number, m.group(1), cells[column]))
    return found


@pytest.mark.parametrize("page", ["tpu.md", "gpu.md"])
def test_the_guides_say_how_large_each_recipes_checkpoint_is(page):
    """A checkpoint is 12 bytes per parameter (fp32 weights and both AdamW moments; LoRA: the base
    once and the adapters' moments), as the planner's checkpoint term counts it."""
    cells = checkpoint_cells(page)
    recipes = [name for _, name, _ in cells]
    if page == "tpu.md":
        assert sorted(recipes) == TPU_RECIPES, "docs/tpu.md's recipe table must give every TPU recipe's checkpoint"
    else:
        assert len(recipes) >= 5
    said = {name: _gb(name) for _, name, _ in cells}
    failures = [f"docs/{page}:{line}: {name} checkpoint {cell!r}, the planner says {said[name]!r}"
                for line, name, cell in cells if cell != said[name]]
    assert not failures, "\n".join(failures)
    guide = " ".join((DOCS / page).read_text().split())
    assert "titan-tpu plan" in guide and "12 bytes per parameter" in guide
    assert "--output_dir" in guide and "checkpoint.folder" in guide  # where to put them


def test_the_tpu_guides_checkpoint_of_its_run():
    m = re.search(r"One checkpoint of this run is (\d+) GB", (DOCS / "tpu.md").read_text())
    assert m and f"{m.group(1)} GB" == _gb("qwen3_8b_tpu")


# ----------------------------------------------------------------------------------------------
# A real run starts from prepare-data

def code_commands(page: str) -> list[tuple[int, list[str]]]:
    """(line, argv) of every command in a page's bash code blocks, continued lines joined."""
    commands, in_code, pending, start = [], False, "", 0
    for number, line in _lines(DOCS / page):
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            continue
        if not pending:
            start = number
        if continues(line):
            pending += line.rstrip()[:-1] + " "
            continue
        argv = shlex.split(pending + line, comments=True)
        pending = ""
        if argv:
            commands.append((start, argv))
    return commands


def _run_args(argv: list[str]) -> dict[str, str]:
    """--config and the data and starting-weight overrides of a command."""
    keep = ("--config", "--data.", "--checkpoint.initial_load_path")
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith(keep)}


def _is_launch(argv: list[str]) -> bool:
    module_launch = any(argv[i:i + 3] == ["-m", "titan_tpu", "train"] for i in range(len(argv)))
    return argv[:2] == ["titan-tpu", "train"] or module_launch


@pytest.mark.parametrize("page", ["tpu.md", "gpu.md"])
def test_the_guides_start_a_run_from_prepare_data(page):
    """The guides tokenize ahead (a run tokenizes in one process while the others wait), with the
    config and the data the first launch then reads, so that launch finds the tokens."""
    commands = code_commands(page)
    prepare = [(line, argv) for line, argv in commands if argv[:2] == ["titan-tpu", "prepare-data"]]
    launches = [(line, argv) for line, argv in commands if _is_launch(argv)]
    assert prepare, f"docs/{page} shows no `titan-tpu prepare-data`"
    assert launches and prepare[0][0] < launches[0][0], f"docs/{page}: prepare-data comes after the first launch"
    data_of = _run_args(prepare[0][1])
    launch = _run_args(launches[0][1])
    assert data_of == launch, (f"docs/{page}:{prepare[0][0]}: prepare-data reads {data_of}, the launch at line "
                               f"{launches[0][0]} {launch}: the run would tokenize again")
    assert "--workers" in (DOCS / page).read_text()


# ----------------------------------------------------------------------------------------------
# The guides are guides: history goes to log.md

@pytest.mark.parametrize("page", ["tpu.md", "gpu.md"])
def test_the_guides_hold_no_dated_measurements(page):
    dated = [f"docs/{page}:{line}: {text.strip()[:80]!r}" for line, text in _lines(DOCS / page)
             if re.search(r"\b20\d\d-\d\d-\d\d\b", text)]
    assert not dated, "a dated measurement is history: move it to docs/log.md\n" + "\n".join(dated)
