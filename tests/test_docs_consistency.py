"""The pages agree with the code and with each other where a reader meets the same fact twice: how
many TPU recipes there are, whether fp8 runs on CUDA, which activation checkpointing a recipe
uses, how large its checkpoint is, and that a real run starts from `titan-tpu prepare-data`. Each
check reads the fact from the code or the recipe, not from another page, so a page that drifts
fails here with its name and line. History (log.md, planner_log.md) keeps the numbers of its day.

limits.md, features.md, tpu.md and planner.md are checked sentence by sentence where they state a
number (NUMBERS: a pattern on the page and the function reading the number from its source) or a
capability (CAPABILITIES: a phrase and the check that the code does what it says), and planner.md's
hardware tables against plan/hardware.py. A new such sentence gets its row."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
from pathlib import Path

import pytest
from test_docs_commands import FENCE, continues
from test_features import HF_MOE, hf_dir, refusal  # noqa: F401 (hf_dir: the fixture)

from titan_tpu.config import build_config
from titan_tpu.plan.fp8 import FP8_CAST_BYTES_PER_ELEMENT, fp8_beside
from titan_tpu.plan.hardware import CPU_COLLECTIVE_BANDWIDTH, CPU_COLLECTIVE_LATENCY, HARDWARE, resolve_hardware
from titan_tpu.plan.search import BUCKETS_MB, TIE

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


def test_limits_name_fp8_experts_as_the_config_has_them():
    """limits.md once said MoE experts' grouped matmuls stay in model.dtype after `fp8.experts`
    had made them fp8: its fp8 line names the switch while the config has it."""
    import dataclasses

    from titan_tpu.config import Fp8Config

    items = (ROOT / "docs" / "limits.md").read_text().split("\n- ")
    fp8_line = next(item for item in items if item.startswith("**fp8**"))
    has_switch = "experts" in {f.name for f in dataclasses.fields(Fp8Config)}
    assert ("`fp8.experts" in fp8_line) == has_switch, fp8_line


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


# ----------------------------------------------------------------------------------------------
# The numbers of the reference pages, each against its source
#
# limits.md, features.md, tpu.md and planner.md state tolerances, measured agreements, counts and
# defaults. Each row below is one such sentence (a pattern on the page, its line breaks joined) and
# the function that reads the same number from where it lives: a config default or recipe, a
# constant, a stored result under bench/results/, a test's tolerance, the planner's plan. A row
# fails when the page says another number, and when its sentence is gone (rewrite the row with
# it). planner.md's paragraphs on how the planner agrees with XLA and with the CPU calibration are
# left to their own checks (tests/test_tpu_recipes.py, tests/test_numbers.py).

RESULTS = ROOT / "bench" / "results"
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}


def _prose(page: str) -> str:
    """The page with its line breaks joined, so that a pattern reads a sentence across lines."""
    return " ".join((DOCS / page).read_text().split())


@functools.cache
def _cfg(name: str):
    return build_config(ROOT / "configs" / f"{name}.toml")


@functools.cache
def _plan(name: str, fp8: bool | None = None):
    from titan_tpu.plan import plan_config
    from titan_tpu.plan.setting import for_planning

    return plan_config(for_planning(ROOT / "configs" / f"{name}.toml"), measure=False, fp8=fp8)


@functools.cache
def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _e(x: float) -> str:
    """1.65e-4 as the pages round it: 1.7e-4."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def _in_source(path: str, pattern: str) -> str:
    """The first group of a pattern in a source file (a test's tolerance, a bench's threshold)."""
    m = re.search(pattern, (ROOT / path).read_text(), re.MULTILINE)
    assert m, f"{path} no longer has {pattern!r}: the row reading it needs its new home"
    return m.group(1)


def _jax_path(kind: str) -> float:
    runs = _json("jax_path.json")
    if kind == "dense":
        return max(r["loss"] for key, r in runs.items() if key.startswith("dense") and "bf16" not in key)
    return max(r["loss"] for key, r in runs.items() if kind in key)


def _xla_gib(name: str) -> str:
    return f"{_json(f'xla/{name}.json')['peak_per_chip_bytes'] / 2**30:.1f}"


def _disk(name: str) -> float:
    """What a run of the recipe keeps on disk: keep_latest_k checkpoints and the one it writes."""
    return (_cfg(name).checkpoint.keep_latest_k + 1) * _plan(name).checkpoint["bytes_total"]


@functools.cache
def _model_args(name: str):
    from titan_tpu.run.setup import prepare_run

    return prepare_run(_cfg(name)).spec.args


def _pipeline(name: str) -> tuple[str, ...]:
    """(stages, chips a stage, chunks a stage, layers a chunk, micro-batches) of a pipelined recipe."""
    p = _cfg(name).parallelism
    layers_a_chunk = _model_args(name).n_layers // (p.pp * p.pp_repeats)
    return str(p.pp), str(p.dp_shard), str(p.pp_repeats), WORDS[layers_a_chunk], str(p.pp_microbatches or p.pp)


def _fp8_beside(name: str) -> tuple[str, ...]:
    _, b = fp8_beside(_plan(name), _plan(name, fp8=True))
    return (f"{b['bf16_step_s']:.4g}", f"{b['bf16_tokens_per_s']:,.0f}", f"{b['fp8_step_s']:.4g}",
            f"{b['fp8_tokens_per_s']:,.0f}", f"{b['speedup']:.2f}", f"{b['fp8_peak_bytes'] / 1e9:.2f}",
            f"{b['bf16_peak_bytes'] / 1e9:.2f}")


def _fp8_experts(name: str) -> tuple[str, ...]:
    """(the experts' share of the executed FLOPs %, fp8 with experts tokens/s, bf16 tokens/s, fp8
    linears alone / bf16) of an fp8-experts recipe, as `titan-tpu plan` gives them."""
    from titan_tpu.plan import plan_config
    from titan_tpu.plan.setting import for_planning

    experts, bf16 = _plan(name), _plan(name, fp8=False)
    linears = plan_config(for_planning(ROOT / "configs" / f"{name}.toml", ["--fp8.experts", "false"]), measure=False)
    share = experts.flops["fp8_expert_executed_per_step_per_device"] / experts.flops["executed_per_step_per_device"]
    return (f"{100 * share:.0f}", f"{experts.tokens_per_s:,.0f}", f"{bf16.tokens_per_s:,.0f}",
            f"{linears.tokens_per_s / bf16.tokens_per_s:.2f}")


def _executed_over_model(name: str) -> float:
    flops = _plan(name).flops
    return flops["executed_per_step_per_device"] / flops["model_per_step_per_device"]


# (page, pattern whose groups are the numbers, the numbers from their source)
NUMBERS = [
    # tpu.md: the JAX path against eager torchrun (bench/jax_path.py's stored run) and the tests' bounds
    ("tpu.md", r"the dense fp32 losses agree to (\S+) \(", lambda: (_e(_jax_path("dense")),)),
    ("tpu.md", r"the MoE run's to (\S+), after a router", lambda: (_e(_jax_path("moe")),)),
    ("tpu.md", r"bf16's to (\S+) \(bench/results/jax_path\.json\)", lambda: (_e(_jax_path("bf16")),)),
    ("tpu.md", r"(\d+) steps on up to (\d+) processes",
     lambda: (str(max(r["steps"] for r in _json("jax_path.json").values())),
              str(max(r["processes"] for r in _json("jax_path.json").values())))),
    ("tpu.md", r"magnitude below (\S+) for the loss, gradient norm",
     lambda: (_e(float(_in_source("tests/tpu/test_jax_lowering.py", r"^TOL = (\S+)"))),)),
    ("tpu.md", r"the CPU's kernels within (\S+) for the qwen3_moe debug model",
     lambda: (_e(float(_in_source("tests/tpu/test_jax_lowering.py", r"^TOL = (\S+)"))),)),
    ("tpu.md", r"the next step's loss within (\S+)\)",
     lambda: (_e(float(_in_source("tests/tpu/test_jax_path.py", r"<= (\S+) \* abs\(want\)"))),)),
    ("tpu.md", r"magnitude\): (\S+) in fp32, (\S+) in bf16\.",
     lambda: tuple(_e(float(_in_source("tests/tpu/test_kernels_interpret.py", rf"^TOL = {{.*torch\.{t}: ([\d.e-]+)")))
                   for t in ("float32", "bfloat16"))),
    # tpu.md: the guide's run, as its recipes and config defaults set it
    ("tpu.md", r"`data\.tokenize_limit_mb` \(([\d,]+) MB\)",
     lambda: (f"{_cfg('qwen3_8b_tpu').data.tokenize_limit_mb:,.0f}",)),
    ("tpu.md", r"far below the ([\d,]+) MB limit",
     lambda: (f"{_cfg('qwen3_8b_lora_chat_tpu').data.tokenize_limit_mb:,.0f}",)),
    ("tpu.md", r"SimpleFSDP over the (\d+) chips, (\d+) x ([\d,]+) tokens per chip",
     lambda: (str(_cfg("qwen3_8b_tpu").parallelism.dp_shard), str(_cfg("qwen3_8b_tpu").training.batch_size),
              f"{_cfg('qwen3_8b_tpu').training.seq_len:,}")),
    ("tpu.md", r"checkpoints` every (\d+) steps", lambda: (str(_cfg("qwen3_8b_tpu").checkpoint.interval),)),
    ("tpu.md", r"the recipe keeps (\w+) while it writes a third: about (\d+) GB",
     lambda: (WORDS[_cfg("qwen3_8b_tpu").checkpoint.keep_latest_k], f"{round(_disk('qwen3_8b_tpu') / 1e9, -2):.0f}")),
    ("tpu.md", r"rank-(\d+) adapters", lambda: (str(_cfg("qwen3_8b_lora_chat_tpu").lora.rank),)),
    ("tpu.md", r"moments for the adapters only: (\d+) GB",
     lambda: (_gb("qwen3_8b_lora_chat_tpu").removesuffix(" GB"),)),
    ("tpu.md", r"\(the recipes keep (\d+), and write",
     lambda: tuple({str(_cfg(name).checkpoint.keep_latest_k) for name in TPU_RECIPES})),
    ("tpu.md", r"(\d+) GB for `qwen3_8b_tpu\.toml`, ([\d.]+) TB for `llama3_70b_tpu\.toml`, (\d+) TB for "
               r"`deepseek_v3_671b_tpu\.toml`",
     lambda: (f"{_disk('qwen3_8b_tpu') / 1e9:.0f}", f"{_disk('llama3_70b_tpu') / 1e12:.1f}",
              f"{_disk('deepseek_v3_671b_tpu') / 1e12:.0f}")),
    # tpu.md: the recipe table's prose
    ("tpu.md", r"none for (\w+) whose activations fit",
     lambda: (WORDS[sum(_cfg(name).activation_checkpoint.mode != "full" for name in TPU_RECIPES)],)),
    ("tpu.md", r"XLA's TPU compiler agrees: ([\d.]+), ([\d.]+) and ([\d.]+) of (\d+) GiB per chip",
     lambda: (*(_xla_gib(name) for name in ("qwen3_8b_tpu", "llama3_8b_pp_tpu", "qwen2_5_vl_7b_tpu")),
              f"{_json('xla/qwen3_8b_tpu.json')['hbm_per_chip_bytes'] / 2**30:.0f}")),
    ("tpu.md", r"holds the ([\d.]+) billion trained parameters",
     lambda: (f"{_plan('qwen2_5_vl_7b_tpu').params['parts']['trained'] / 1e9:.2f}",)),
    ("tpu.md", r"`llama3_8b_pp_tpu\.toml` (\d+) stages of (\d+) chips \((\d+) chunks of (\w+) layer per stage, (\d+) "
               r"micro-batches\)", lambda: _pipeline("llama3_8b_pp_tpu")),
    ("tpu.md", r"`llama3_70b_pp_tpu\.toml` (\d+) stages of (\d+) chips \((\d+) chunks, (\d+) micro-batches\)",
     lambda: tuple(_pipeline("llama3_70b_pp_tpu")[i] for i in (0, 1, 2, 4))),
    ("tpu.md", r"a v5p chip's (\d+) GiB of HBM is ([\d.]+) GB",
     lambda: (f"{HARDWARE['v5p'].memory_bytes / 2**30:.0f}", f"{HARDWARE['v5p'].memory_bytes / 1e9:.1f}")),
    ("tpu.md", r"qwen3_8b_tpu: XLA's estimate as run ([\d.]+) s, the planner's ([\d.]+) s",
     lambda: (f"{_json('xla/qwen3_8b_tpu.json')['xla_optimal_seconds_per_step_as_run']:.3f}",
              f"{_plan('qwen3_8b_tpu').time['step_s']:.3f}")),
    ("tpu.md", r"the (\d+)k-value output projection of the debug model",
     lambda: (str(_model_args("llama3_debug").vocab_size * _model_args("llama3_debug").dim // 1000),)),
    ("tpu.md", r"on the TPU VM \(Python (\S+)\+\)",
     lambda: (_in_source("pyproject.toml", r'requires-python = ">=(\S+)"'),)),
    # planner.md: the hardware, the search's knobs, the MFU paragraph, fp8
    ("planner.md", r"`--hardware` takes `([^`]+)`", lambda: (" ".join([*HARDWARE, "cpu"]),)),
    ("planner.md", r"\(`v5p-1024` is (\d+) chips",
     lambda: (str(resolve_hardware("v5p-1024", measure=False)[1]),)),
    ("planner.md", r"\((\d+) for h100, h200, b200\)",
     lambda: tuple({str(HARDWARE[name].devices_per_node) for name in ("h100", "h200", "b200")})),
    ("planner.md", r"bucket size \((\d+), (\d+), (\d+) MB and the config's",
     lambda: tuple(f"{mb:.0f}" for mb in BUCKETS_MB)),
    ("planner.md", r"It prints the `--top` \((\d+)\) that fit",
     lambda: (_in_source("titan_tpu/tools/plan_cmd.py", r'"--top", type=int, default=(\d+)'),)),
    ("planner.md", r"how many candidates predict within ([\d.]+)% of the first",
     lambda: (f"{TIE * 100:g}",)),
    ("planner.md", r"says whether the first choice reached ([\d.]+) of the best measured",
     lambda: (_in_source("bench/search_check.py", r"if first >= ([\d.]+) else"),)),
    ("planner.md", r"an \*\*assumption\*\* of ([\d.]+) of peak",
     lambda: (f"{HARDWARE['v5p'].efficiency:.2f}",)),
    ("planner.md", r"([\d.]+)x the model FLOPs for Llama 3 8B and 405B, which alone caps MFU at ([\d.]+) / ([\d.]+) = "
                   r"(\d+)%",
     lambda: (*{f"{_executed_over_model(name):.2f}" for name in ("llama3_8b_tpu", "llama3_405b_tpu")},
              f"{HARDWARE['v5p'].efficiency:.2f}", f"{_executed_over_model('llama3_405b_tpu'):.2f}",
              f"{100 * HARDWARE['v5p'].efficiency / _executed_over_model('llama3_405b_tpu'):.0f}")),
    ("planner.md", r"Qwen3-8B on v6e-16, ([\d.]+)% vs [^:]*: the elementwise term \(([\d.]+) s of ([\d.]+) s:",
     lambda: (f"{_plan('qwen3_8b_graph_tpu').mfu:.1f}", f"{_plan('qwen3_8b_graph_tpu').time['elementwise_s']:.2f}",
              f"{_plan('qwen3_8b_graph_tpu').time['step_s']:.2f}")),
    ("planner.md", r"Llama 3 405B on 1,024 v5p, ([\d.]+)% vs [^:]*: compute dominates "
                   r"\(([\d.]+) s of a ([\d.]+) s step\), so the plan is the efficiency divided by ([\d.]+)\.",
     lambda: (f"{_plan('llama3_405b_tpu').mfu:.1f}", f"{_plan('llama3_405b_tpu').time['compute_s']:.1f}",
              f"{_plan('llama3_405b_tpu').time['step_s']:.1f}", f"{_executed_over_model('llama3_405b_tpu'):.3f}")),
    ("planner.md", r"Qwen3-235B-A22B on 512 v5p, ([\d.]+)% vs .*? the elementwise term is large "
                   r"\(([\d.]+) s of ([\d.]+) s:",
     lambda: (f"{_plan('qwen3_235b_a22b_tpu').mfu:.1f}", f"{_plan('qwen3_235b_a22b_tpu').time['elementwise_s']:.1f}",
              f"{_plan('qwen3_235b_a22b_tpu').time['step_s']:.1f}")),
    ("planner.md", r"between two processes, ([\d.]+) ms, the mean",
     lambda: (f"{CPU_COLLECTIVE_LATENCY * 1e3:g}",)),
    ("planner.md", r"gloo's collective rate between two processes, ([\d.]+) GB/s per rank, and ([\d.]+) ms per call",
     lambda: (f"{CPU_COLLECTIVE_BANDWIDTH / 1e9:g}", f"{CPU_COLLECTIVE_LATENCY * 1e3:g}")),
    ("planner.md", r"written once in fp8, (\d+) bytes an element \(`FP8_CAST_BYTES_PER_ELEMENT`",
     lambda: (f"{FP8_CAST_BYTES_PER_ELEMENT:g}",)),
    ("planner.md", r"bf16 ([\d.]+) s/step, ([\d,]+) tokens/s; fp8 ([\d.]+) s/step, ([\d,]+) tokens/s "
                   r"\(([\d.]+)x\), peak ([\d.]+) GB against ([\d.]+) GB", lambda: _fp8_beside("llama3_70b_v7_tpu")),
    ("fp8.md", r"ep 8\) the experts are (\d+)% of the executed FLOPs, yet the plan predicts fp8 linears \+ experts "
               r"slower than bf16 \(([\d,]+) against ([\d,]+) tokens/s; fp8 linears alone ([\d.]+)x\)",
     lambda: _fp8_experts("qwen3_235b_a22b_v7_fp8_tpu")),
    ("planner.md", r"For configs/qwen3_235b_a22b_v7_fp8_tpu.toml that is (\d+)% of the executed FLOPs",
     lambda: _fp8_experts("qwen3_235b_a22b_v7_fp8_tpu")[:1]),
]


@pytest.mark.parametrize("page,pattern,truth", NUMBERS, ids=[f"{p}:{pat[:40]}" for p, pat, _ in NUMBERS])
def test_a_stated_number_is_its_sources(page, pattern, truth):
    found = re.findall(pattern, _prose(page))
    assert len(found) == 1, (f"docs/{page}: {len(found)} sentences match {pattern!r}; the row of NUMBERS "
                             "reading this claim must follow its rewrite")
    said = found[0] if isinstance(found[0], tuple) else (found[0],)
    assert said == truth(), f"docs/{page} says {said} where {pattern!r}; the source says {truth()}"


# ----------------------------------------------------------------------------------------------
# What the reference pages say runs, and what they say is refused
#
# A capability or a limitation on limits.md or features.md, as a phrase the page holds and the
# check that the code does what it says: a combination accepted or refused by the checks a run
# makes before it builds anything (tests/test_features.py's `refusal`), a kind or a model family
# registered, the test that shows a feature working. A phrase that is gone fails with its row.

DEBUG = ["--training.device", "cpu"]
PP = ["--parallelism.pp", "2", "--parallelism.dp_shard", "1", "--model.scan_layers", "true"]
MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debug"]
MTP = ["--model.name", "deepseek_v3", "--model.flavor", "debug", "--model.mtp_num_layers", "1"]
PP_EP = ["--parallelism.pp", "2", "--parallelism.dp_shard", "2", "--parallelism.ep", "2", "--model.scan_layers", "true"]


def _runs(*overrides: str) -> str | None:
    reason = refusal([*DEBUG, *overrides])
    return None if reason is None else f"refused: {reason}"


def _refused(*overrides: str, hf: Path | None = None) -> str | None:
    model = ["--model.name", "hf", "--model.hf_config", str(hf)] if hf else []
    return None if refusal([*DEBUG, *model, *overrides]) else f"{' '.join(overrides)} is accepted"


def _has_test(path: str, *names: str) -> str | None:
    text = (ROOT / path).read_text() if (ROOT / path).exists() else ""
    missing = [name for name in names if f"def {name}" not in text and name not in text]
    return f"{path} lacks {missing}" if missing else None


def _hub_id_refused() -> str | None:
    from titan_tpu.models.hf.config import load_hf_config

    try:
        load_hf_config("Qwen/Qwen3-0.6B")
    except FileNotFoundError:
        return None
    return "model.hf_config took a Hub id"


def _one_jax_device_per_process() -> str | None:
    from titan_tpu.jax_start import check_jax_devices

    try:
        check_jax_devices("tpu", local=2, total=2, world_size=1)
    except ValueError:
        return None
    return "a process with two JAX devices was accepted"


def _kinds() -> str | None:
    from titan_tpu.kinds import KINDS

    return None if set(KINDS) == {"next_token", "dpo", "orpo", "grpo"} else f"the kinds are {sorted(KINDS)}"


def _families() -> str | None:
    from titan_tpu.models.registry import MODEL_NAMES

    want = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3")
    return None if tuple(MODEL_NAMES) == want else f"the native families are {MODEL_NAMES}"


def _pp_schedules() -> str | None:
    from titan_tpu.config import ParallelismConfig

    keys = [f.name for f in dataclasses.fields(ParallelismConfig) if f.name.startswith("pp")]
    return None if keys == ["pp", "pp_microbatches", "pp_repeats"] else f"the pipeline keys are {keys}"


def _vision_tower_planned() -> str | None:
    parts = _plan("qwen2_5_vl_7b_tpu").params["parts"]
    return None if parts.get("vision_tower") else f"the VLM plan has no vision tower: {sorted(parts)}"


# (page, phrase, check: None when the code does what the phrase says, else what it does)
CAPABILITIES = [
    ("limits.md", "The JAX path takes one device per process", lambda hf: _one_jax_device_per_process()),
    ("limits.md", "native dense and MoE models (no multi-token prediction) with scanned layers",
     lambda hf: _runs(*PP) or _runs(*PP, *MOE) or _refused(*PP, *MTP)
     or _refused(*PP[:4], "--model.scan_layers", "false")),
    ("limits.md", "and with ep inside each stage for MoE models (DeepSeek-V3's dense first layers run whole",
     lambda hf: _runs(*PP_EP, *MOE) or _runs(*PP_EP, *MTP[:4])
     or _has_test("tests/test_pipeline_moe.py", "test_moe_stages_with_expert_parallelism_equal_one_process")),
    ("limits.md", "eager and graph mode and lowered for a TPU as one program",
     lambda hf: _runs(*PP, "--training.mode", "graph")
     or _has_test("tests/tpu/test_pipeline_lowering.py", "test_lowered_pipeline_step_equals_eager_step")),
    ("limits.md", "composed with dp_replicate, dp_shard and tp",
     lambda hf: _runs(*PP, "--parallelism.tp", "2", "--parallelism.dp_replicate", "2")
     or _runs(*PP[:2], "--parallelism.dp_shard", "2", "--model.scan_layers", "true")),
    ("limits.md", "GPipe and circular schedules, no 1F1B; not with LoRA",
     lambda hf: _pp_schedules() or _refused(*PP, "--lora.enabled", "true")),
    ("limits.md", "one process per replica group, eager mode",
     lambda hf: _refused("--fault_tolerance.enabled", "true", "--training.mode", "graph")),
    ("limits.md", "DPO and ORPO ([dpo.md](dpo.md)) and GRPO ([grpo.md](grpo.md)) on the same models and mesh; no KTO",
     lambda hf: _kinds()),
    ("limits.md", "vision-language fine-tuning of Qwen2.5-VL, Gemma 3 and LLaVA directories",
     lambda hf: _has_test("tests/test_hf_vision.py", "qwen2_5_vl", "gemma3", "llava")),
    ("limits.md", "generation from prompts with images",
     lambda hf: _has_test("tests/test_hf_vision_generate.py",
                          "test_one_prompt_with_images_generates_transformers_greedy_tokens")),
    ("limits.md", "and the vision tower in the planner", lambda hf: _vision_tower_planned()),
    ("limits.md", "tensor or context parallelism and scanned layers with a Hugging Face model",
     lambda hf: _refused("--parallelism.tp", "2", "--parallelism.dp_shard", "1", hf=hf)
     or _refused("--parallelism.cp", "2", "--parallelism.dp_shard", "1", hf=hf)
     or _refused("--model.scan_layers", "true", hf=hf)),
    ("limits.md", "replication (dp_replicate) with expert parallelism, pipeline stages with context parallelism or "
                  "multi-token prediction",
     lambda hf: _refused(*MOE, "--parallelism.ep", "2", "--parallelism.dp_shard", "2", "--parallelism.dp_replicate",
                         "2") or _refused(*PP, "--parallelism.cp", "2") or _refused(*PP, *MTP)),
    ("features.md", "MoE models compose expert parallelism with tensor and context parallelism",
     lambda hf: _runs(*MOE, "--parallelism.tp", "2", "--parallelism.ep", "2", "--parallelism.dp_shard", "2")
     or _runs(*MOE, "--parallelism.cp", "2", "--parallelism.ep", "2", "--parallelism.dp_shard", "2")),
    ("features.md", "and spreads them over ranks with ep when they are transformers' stacked experts",
     lambda hf: _runs(*HF_MOE, "--parallelism.ep", "2", "--parallelism.dp_shard", "2")
     or _refused("--parallelism.ep", "2", "--parallelism.dp_shard", "2", hf=hf)),
    ("limits.md", "`--model.hf_config` takes a local directory", lambda hf: _hub_id_refused()),
    ("features.md", "(Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3)", lambda hf: _families()),
    ("features.md", "MoE models take pp, with ep inside each stage; tp composes with it; cp is refused with pp.",
     lambda hf: _runs(*PP, *MOE) or _runs(*PP_EP, *MOE) or _runs(*PP, "--parallelism.tp", "2")
     or _refused(*PP, "--parallelism.cp", "2")),
    ("features.md", "other families and the Transformers backend refuse it, and so do tensor and context parallelism",
     lambda hf: _refused("--model.mtp_num_layers", "1") or _refused("--model.mtp_num_layers", "1", hf=hf)
     or _refused(*MTP, "--parallelism.tp", "2", "--parallelism.dp_shard", "1")
     or _refused(*MTP, "--parallelism.cp", "2", "--parallelism.dp_shard", "1")),
    ("features.md", "(tensor and context parallelism with or without ep; scanned layers too",
     lambda hf: _runs(*MTP[:4], "--parallelism.tp", "2", "--parallelism.dp_shard", "1")
     or _runs(*MTP[:4], "--parallelism.cp", "2", "--parallelism.ep", "2", "--parallelism.dp_shard", "2")
     or _runs(*MTP[:4], "--parallelism.cp", "2", "--parallelism.dp_shard", "1")
     or _runs(*MTP[:4], "--model.scan_layers", "true")),
]


@pytest.mark.parametrize("page,phrase,check", CAPABILITIES, ids=[f"{p}:{phrase[:40]}" for p, phrase, _ in CAPABILITIES])
def test_a_stated_capability_is_the_codes(page, phrase, check, hf_dir):  # noqa: F811
    assert phrase in _prose(page), f"docs/{page} no longer says {phrase!r}: the row of CAPABILITIES must follow it"
    wrong = check(hf_dir)
    assert wrong is None, f"docs/{page} says {phrase!r}, but {wrong}"


# Refusals a recipe's comments or a page once stated after the code had lifted them: (phrase, the
# runs that lift it). While those run, no recipe and no page says the phrase.
LIFTED = [
    ("does not split MoE layers", lambda: _runs(*MOE, "--parallelism.tp", "2", "--parallelism.ep", "2",
                                                "--parallelism.dp_shard", "2")),
    ("MoE models with ep 1 only", lambda: _runs(*MOE, "--parallelism.cp", "2", "--parallelism.ep", "2",
                                                "--parallelism.dp_shard", "2")),
    ("would need ep 1", lambda: _runs(*MOE, "--parallelism.cp", "2", "--parallelism.ep", "2",
                                      "--parallelism.dp_shard", "2")),
]


@pytest.mark.parametrize("phrase,lifted", LIFTED, ids=[phrase for phrase, _ in LIFTED])
def test_no_recipe_or_page_states_a_lifted_refusal(phrase, lifted):
    assert lifted() is None, f"the code refuses again what {phrase!r} said: {lifted()}"
    texts = [*(ROOT / "configs").glob("*.toml"), *PAGES]
    saying = [str(path.relative_to(ROOT)) for path in texts  # comments joined across their lines
              if phrase in " ".join(path.read_text().replace("#", " ").split())]
    assert not saying, f"{phrase!r} is no longer true (ep composes with tp and cp), yet {saying} say it"


# ----------------------------------------------------------------------------------------------
# planner.md's hardware tables are the planner's (plan/hardware.py)

UNITS = {"TFLOP/s": 1e12, "GiB": 2**30, "GB": 1e9, "GB/s": 1e9, "TB/s": 1e12}
QUANTITY = re.compile(r"([\d,.]+) (TFLOP/s|GiB|GB/s|TB/s|GB)\b")


def _quantity(cell: str) -> float | None:
    """The first quantity with a unit in a table cell ("none ..." and a cell without one: None)."""
    m = QUANTITY.search(cell)
    return None if cell.startswith("none") or not m else float(m.group(1).replace(",", "")) * UNITS[m.group(2)]


def hardware_rows(header: str) -> dict[str, list[str]]:
    """Hardware name -> cells of planner.md's table whose header row starts with `header`."""
    rows, inside = {}, False
    for line in (DOCS / "planner.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        inside = (inside or cells[:1] == [header]) and bool(cells)
        if inside and cells[0] not in (header, "---"):
            for name in re.split(r",\s*", cells[0]):
                rows[name.split(" ")[0]] = cells[1:]
    return rows


def test_the_hardware_table_is_the_planners():
    """Per chip on the page (v7's two devices together), per device in the planner; the interconnect
    column is the bidirectional figure, twice what a device sends into a ring."""
    rows = hardware_rows("name")
    assert set(HARDWARE) <= set(rows), f"docs/planner.md's hardware table lacks {set(HARDWARE) - set(rows)}"
    failures = []
    for name, hw in HARDWARE.items():
        bf16, fp8, memory, bandwidth, interconnect = (_quantity(c) for c in rows[name][:5])
        chip = hw.devices_per_chip
        truth = {"peak dense bf16": (bf16, hw.peak_flops * chip), "memory": (memory, hw.memory_bytes * chip),
                 "memory bandwidth": (bandwidth, hw.memory_bandwidth * chip),
                 "peak dense fp8": (fp8, hw.fp8_peak_flops and hw.fp8_peak_flops * chip)}
        # v4's cell states the send figure itself, from the pod's all-reduce bandwidth per chip
        truth["interconnect"] = (interconnect, hw.interconnect_bandwidth * (1 if name == "v4" else 2 * chip))
        failures += [f"{name} {column}: the page {said}, plan/hardware.py {want}"
                     for column, (said, want) in truth.items()
                     if (said is None) != (not want) or (want and abs(said - want) > 0.005 * want)]
    assert not failures, "docs/planner.md's hardware table:\n" + "\n".join(failures)


def test_the_network_table_is_the_planners():
    rows = hardware_rows("hardware")
    assert set(HARDWARE) <= set(rows), f"docs/planner.md's network table lacks {set(HARDWARE) - set(rows)}"
    failures = [f"{name}: the page {_quantity(rows[name][0])}, plan/hardware.py {hw.network_bandwidth}"
                for name, hw in HARDWARE.items() if _quantity(rows[name][0]) != hw.network_bandwidth]
    assert not failures, "docs/planner.md's table of the network between nodes or slices:\n" + "\n".join(failures)


@pytest.mark.parametrize("package,pin", [("torch-tpu", "torch_tpu"), ("libtpu", "libtpu")])
def test_the_tpu_guide_names_the_pinned_versions(package, pin):
    """tpu.md says what it checked against ("torch-tpu 0.2.0 registers ..."): the version constraints-tpu.txt pins."""
    pinned = _in_source("constraints-tpu.txt", rf"^{pin}==(\S+)")
    said = set(re.findall(rf"\b{package} (\d+\.\d+\.\d+)", _prose("tpu.md")))
    assert said == {pinned}, f"docs/tpu.md names {package} {sorted(said)}; constraints-tpu.txt pins {pinned}"
