"""The docs cannot drift from the command line: every ``titan-tpu ...`` command that README.md and
docs/*.md show (in code blocks and inline code, ``python -m titan_tpu ...`` counted as
``titan-tpu ...`` and ``make train ARGS=...`` as ``titan-tpu train``) is parsed by the real parser
of its subcommand, its config overrides are checked against the config schema, and commands on a
recipe of this repo build their whole config as the machine they are written for would (validation
included). The launch commands in the recipes' header comments count too. Nothing trains: a command
is parsed, not run, except ``titan-tpu plan``, which is cheap and runs for real, and every TPU or
GPU run shown must fit its hardware by the planner. Every relative link in those files must point
to an existing file (and heading, for a Markdown anchor).

Code blocks fenced as ```text (pictures, output) are not read for commands. Placeholders in the docs
are read as a reader would: ``[--flag X]`` is an optional flag (checked),
``...`` is dropped, ``a|b`` takes ``a``, and an upper-case value (``N``, ``DIR``) stands for any value
of the key's type (the key is still checked).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_tpu import cli
from titan_tpu.config import SECTIONS, Config, load_toml, parse_overrides, set_value

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RECIPE_FILES = sorted((ROOT / "configs").glob("*.toml"))  # their header comments show launch commands
MAKE_TRAIN_CONFIG = "configs/llama3_debug.toml"  # what `make train` passes (Makefile)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|<")  # N, DIR, MODEL; or a <...> such as configs/<recipe>.toml
FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
COMMAND_START = re.compile(r"(?:^|[\s/])titan-tpu\s+([a-z].*)$")
SHELL_OPERATOR = re.compile(r"\s(?:&&|\|\||;|\||>)\s")
MODULE_COMMAND = re.compile(r"-m\s+titan_tpu\s+([a-z].*)$")  # python -m titan_tpu train ... (not titan_tpu.x)
MAKE_TRAIN = re.compile(r"make train ARGS=\"([^\"]*)\"")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, for the failure message
    argv: tuple[str, ...]  # after "titan-tpu": the subcommand first
    ranks: int | None = None  # processes the shown launcher starts (torchrun nnodes x nproc_per_node), if it says

    def __str__(self) -> str:
        return f"{self.where}: titan-tpu {' '.join(self.argv)}"


# ----------------------------------------------------------------------------------------------
# Finding the commands


def _trailing_backslashes(line: str) -> int:
    stripped = line.rstrip()
    return len(stripped) - len(stripped.rstrip("\\"))


def continues(line: str) -> bool:
    """Whether the shell reads the next line as part of this one: an odd number of trailing
    backslashes (an even number is escaped backslashes, and the command ends there)."""
    return _trailing_backslashes(line) % 2 == 1


def _code_blocks_and_prose(text: str):
    """Yield (line number, line, in_code_block) with a code block's continued lines (`\\`) joined.
    A ```text block is a picture or output, not commands: its lines are skipped."""
    in_code, picture, pending, start = False, False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            in_code = not in_code
            picture = in_code and line.strip()[3:].strip() == "text"
            continue
        if picture:
            continue
        if in_code:
            if not pending:
                start = number
            if continues(line):
                pending += line.rstrip()[:-1] + " "
                continue
            yield start, pending + line, True
            pending = ""
        else:
            yield number, line, False


def _tokens(command_line: str) -> list[str]:
    """shlex tokens of a shown command, its placeholders read as a reader would."""
    try:
        raw = shlex.split(command_line, comments=True)
    except ValueError:  # an unbalanced quote in prose: keep the words
        raw = command_line.split()
    tokens = []
    for token in raw:
        token = token.strip("[]")
        if token in ("...", "…") and tokens and tokens[-1] == "--config":
            token = "VALUE"  # "--config ...": some recipe
        if token in ("", "...", "…"):
            continue
        if re.fullmatch(r"[\w.-]+(\|[\w.-]+)+", token):
            token = token.split("|")[0]
        tokens.append(token)
    return tokens


def _inside_quotes(command: str) -> str:
    """A command that another one quotes (`gcloud ... --command "cd x && titan-tpu launch ..."`)
    ends at the quote that closes it."""
    for quote in "\"'":
        if command.count(quote) % 2:
            command = command[:command.rindex(quote)]
    return command


def _commands_in_line(line: str, in_code: bool) -> list[str]:
    """The command lines (after `titan-tpu`) that one doc line shows."""
    spans = [line] if in_code else INLINE_CODE.findall(line)
    found = []
    for span in spans:
        if m := COMMAND_START.search(span):
            found.append(_inside_quotes(SHELL_OPERATOR.split(m.group(1))[0]))
        elif m := MODULE_COMMAND.search(span):
            found.append(m.group(1))
        elif m := MAKE_TRAIN.search(span):
            found.append(f"train --config {MAKE_TRAIN_CONFIG} {m.group(1)}")
    return found


def _launched_ranks(line: str) -> int | None:
    """nnodes x nproc_per_node of a torchrun line whose numbers are written out, else None."""
    if "torchrun" not in line and "torch.distributed.run" not in line:
        return None
    counts = dict(re.findall(r"--(nnodes|nproc_per_node)[ =](\d+)\b", line))
    if "nproc_per_node" not in counts:
        return None
    return int(counts["nproc_per_node"]) * int(counts.get("nnodes", 1))


def _recipe_header_lines(path: Path):
    """(line number, line, is_command) of a recipe's header comment: an indented line ("#   torchrun
    ...") is a command, with its continued lines joined, the rest prose; `--config THIS` is the
    recipe itself."""
    pending, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("#"):
            break
        command = line.startswith("#  ") or bool(pending)
        text = line.lstrip("#").strip().replace("--config THIS", f"--config configs/{path.name}")
        if not pending:
            start = number
        if command and continues(text):
            pending += text[:-1] + " "
            continue
        yield start, pending + text, command
        pending = ""


def _launched_command(argv: list[str]) -> tuple[list[str], int | None]:
    """`launch [OPTIONS] COMMAND ...` is COMMAND as every host starts it: launch's options are parsed
    by its own parser here, and the command is checked as any shown command (with the ranks it
    starts when the options write both numbers out)."""
    from titan_tpu.tools.launch import parser

    namespace = parser().parse_args(argv[1:])
    ranks = namespace.nnodes * namespace.nproc_per_node if namespace.nnodes and namespace.nproc_per_node else None
    return list(namespace.command), ranks


def doc_commands() -> list[DocCommand]:
    commands = []
    sources = [(path, _code_blocks_and_prose(path.read_text())) for path in DOC_FILES]
    sources += [(path, _recipe_header_lines(path)) for path in RECIPE_FILES]
    for path, lines in sources:
        for number, line, in_code in lines:
            for command_line in _commands_in_line(line, in_code):
                argv = _tokens(command_line)
                if argv and not PLACEHOLDER.match(argv[0]):  # "titan-tpu COMMAND --help" names no command
                    ranks = _launched_ranks(line)
                    if argv[0] == "launch" and len(argv) > 1:
                        argv, ranks = _launched_command(argv)
                    commands.append(DocCommand(f"{path.relative_to(ROOT)}:{number}", tuple(argv), ranks))
    return commands


def inline_config_keys() -> list[tuple[str, str]]:
    """(file:line, key) of every `--section.key` shown in inline code outside a command."""
    keys = []
    for path in DOC_FILES:
        for number, line, in_code in _code_blocks_and_prose(path.read_text()):
            if in_code:
                continue
            for span in INLINE_CODE.findall(line):
                if COMMAND_START.search(span) or MODULE_COMMAND.search(span):
                    continue
                for key in re.findall(r"(?:^|\s)--([a-z_]+\.[a-z_0-9]+)", span):
                    if key.split(".")[0] in SECTIONS:
                        keys.append((f"{path.relative_to(ROOT)}:{number}", key))
    return keys


# ----------------------------------------------------------------------------------------------
# The real parsers


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser, known: bool):
        self.parser, self.known = parser, known


def _capture_parser(subcommand: str) -> tuple[argparse.ArgumentParser, bool]:
    """The subcommand's own ArgumentParser, stopped at its first parse (nothing runs), and whether
    it accepts extra arguments (parse_known_args: config overrides) or none (parse_args)."""
    original_known, original_args = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args

    def stop_known(self, *args, **kwargs):
        raise _Captured(self, known=True)

    def stop_args(self, *args, **kwargs):
        raise _Captured(self, known=False)

    argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args = stop_known, stop_args
    try:
        cli.COMMANDS[subcommand]([])
    except _Captured as captured:
        return captured.parser, captured.known
    finally:
        argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.parse_args = original_known, original_args
    raise AssertionError(f"titan-tpu {subcommand} returned without parsing its arguments")


@pytest.fixture(autouse=True)
def cpu_with_bf16(monkeypatch):
    """The docs show bf16 commands for CPUs with bf16 instructions (docs/mixed_precision.md): check
    them as on such a CPU, whichever CPU runs the suite (its refusal elsewhere has its own test in
    tests/test_mixed_precision.py)."""
    from titan_tpu import device_cpu

    monkeypatch.setattr(device_cpu, "cpu_bf16_support", lambda: (True, "the docs' CPU with bf16 instructions"))


@pytest.fixture(scope="module")
def parsers():
    return {name: _capture_parser(name) for name in cli.COMMANDS}


def _parse(parser: argparse.ArgumentParser, argv: list[str]):
    """parse_known_args, with argparse's exit turned into an assertion that carries its message. The
    docs spell every flag out: an abbreviation the command line would accept (`--devic`) fails here."""
    parser.allow_abbrev = False
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return parser.parse_known_args(argv)
        except SystemExit:
            raise AssertionError(stderr.getvalue().strip().splitlines()[-1]) from None


def check_overrides(extras: list[str]) -> None:
    """Every override names a config key, with a value of its type (placeholders: any value)."""
    cfg = Config()
    for key, value in parse_overrides(extras):
        if PLACEHOLDER.match(value):
            section, _, name = key.partition(".")
            value = getattr(getattr(cfg, section, None), name, None) if name else cfg.output_dir
            value = value if value is not None else "x"
        set_value(cfg, key, value)


def _recipe(namespace) -> str | None:
    config = getattr(namespace, "config", None)
    return config if config and (ROOT / config).is_file() else None


def _builds_here(namespace, extras: list[str], takes_overrides: bool) -> bool:
    """Whether the command's whole config can be built here: a recipe of this repo, concrete values,
    and no Hugging Face model (its directory is on the reader's machine)."""
    recipe = _recipe(namespace)
    if not (recipe and takes_overrides and _is_concrete(extras)) or getattr(namespace, "calibrate", False):
        return False
    model_name = dict(parse_overrides(extras)).get("model.name", load_toml(ROOT / recipe).get("model", {}).get("name"))
    return model_name != "hf"


def _is_concrete(extras: list[str]) -> bool:
    """No placeholder values and no example paths that exist only on the reader's machine."""
    return not any(PLACEHOLDER.match(v) or "path/to" in v or v.startswith("~") for _, v in parse_overrides(extras))


# ----------------------------------------------------------------------------------------------
# Tests


COMMANDS = doc_commands()


def test_docs_show_commands():
    subcommands = {c.argv[0] for c in COMMANDS}
    assert {"train", "plan", "report", "verify", "convert", "kernels", "graph"} <= subcommands, subcommands


@pytest.mark.parametrize("subcommand", sorted(cli.COMMANDS))
def test_help(subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([subcommand, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_shown_command_parses(parsers, monkeypatch):
    monkeypatch.chdir(ROOT)
    from titan_tpu.plan.setting import for_planning

    failures = []
    for command in COMMANDS:
        subcommand, argv = command.argv[0], list(command.argv[1:])
        if subcommand not in cli.COMMANDS:
            failures.append(f"{command}: no such subcommand; titan-tpu has {', '.join(cli.COMMANDS)}")
            continue
        if not argv:  # the command named in prose ("made with `titan-tpu convert`"): test_help covers it
            continue
        parser, takes_overrides = parsers[subcommand]
        try:
            namespace, extras = _parse(parser, argv)
            if extras and not takes_overrides:
                raise AssertionError(f"unrecognized arguments: {' '.join(extras)}")
            check_overrides(extras)
            recipe = _recipe(namespace)
            config = getattr(namespace, "config", None)
            if config and config.startswith("configs/") and not PLACEHOLDER.search(config) and recipe is None:
                raise AssertionError(f"{config} does not exist")
            if _builds_here(namespace, extras, takes_overrides):
                for_planning(recipe, extras)
        except (AssertionError, ValueError, FileNotFoundError) as e:
            failures.append(f"{command}: {e}")
    assert not failures, "\n".join(failures)


def test_shown_plans_run(parsers, capsys, monkeypatch):
    """`titan-tpu plan` is cheap (no training): the shown plans on this repo's recipes run for real."""
    monkeypatch.chdir(ROOT)
    plans = []
    for c in COMMANDS:
        if c.argv[0] != "plan":
            continue
        namespace, extras = _parse(parsers["plan"][0], list(c.argv[1:]))
        # --certify compiles each candidate with XLA (minutes, .venv-tpu): parsed, not run here.
        if _recipe(namespace) and not namespace.calibrate and not namespace.certify and _is_concrete(extras):
            plans.append(c)
    assert plans
    failures = []
    for command in plans:
        code = cli.main(list(command.argv))
        out, err = capsys.readouterr()
        # A plan may end in a one-line error the doc shows on purpose ("nothing fits ..."): then the doc
        # must show that error's start.
        shown = " ".join((ROOT / command.where.split(":")[0]).read_text().split())
        if code != 0 and err.removeprefix("error: ")[:40] not in shown:
            failures.append(f"{command}: exit {code}: {err.strip()}")
    assert not failures, "\n".join(failures)


def test_shown_accelerator_commands_fit(parsers, monkeypatch):
    """Every TPU or GPU run the docs and the recipes' headers show (train or plan, on a recipe of this
    repo) fits its hardware by the planner: the hardware the command names (--hardware) or the
    recipe's description, with as many devices as the shown torchrun starts. A command a reader
    copies must not be one that runs out of memory. Plans the docs show not fitting on purpose are
    the exception, and they must say so next to the command ("does not fit")."""
    monkeypatch.chdir(ROOT)
    from titan_tpu.plan import plan_config, resolve_hardware
    from titan_tpu.plan.search import search
    from titan_tpu.plan.setting import default_hardware, for_planning

    checked, failures = [], []
    for command in COMMANDS:
        subcommand = command.argv[0]
        if subcommand not in ("train", "plan"):
            continue
        namespace, extras = _parse(parsers[subcommand][0], list(command.argv[1:]))
        if not _builds_here(namespace, extras, takes_overrides=True):
            continue
        cfg = for_planning(_recipe(namespace), extras)
        if cfg.training.device not in ("tpu", "cuda"):
            continue
        hardware, chips = (resolve_hardware(namespace.hardware) if getattr(namespace, "hardware", None)
                           else default_hardware(cfg, measure=False))
        if command.ranks is not None:
            chips = command.ranks // hardware.devices_per_chip
        checked.append(command)
        file, line = command.where.split(":")
        nearby = " ".join((ROOT / file).read_text().splitlines()[max(int(line) - 3, 0):int(line) + 2]).lower()
        try:
            if getattr(namespace, "search", False):  # the search lays out its own meshes
                search(cfg, hardware, chips=chips, measure=False)
                continue
            plan = plan_config(cfg, hardware, chips=chips, measure=False)
        except ValueError as e:  # e.g. a mesh that is not the devices the launcher starts; nothing fits
            if "nothing fits" not in nearby or "nothing fits" not in str(e):
                failures.append(f"{command}: {e}")
            continue
        if not plan.fits and "does not fit" not in nearby:
            failures.append(f"{command}: {plan.peak_bytes / 1e9:.1f} GB per device at {plan.peak_phase} on "
                            f"{plan.devices} x {hardware.name} ({plan.capacity_bytes / 1e9:.1f} GB)")
    assert len(checked) >= 10, [str(c) for c in checked]
    assert not failures, "\n".join(failures)


def test_named_flavors_exist():
    """Every native `family/flavor` the docs and skills name in code (`titan-tpu verify qwen3_moe/30b_a3b`,
    a label in prose) is a flavor of the table: flavor names are case-sensitive."""
    from titan_tpu.models.registry import MODEL_FLAVORS

    pattern = re.compile(r"\b(" + "|".join(sorted(MODEL_FLAVORS, key=len, reverse=True)) + r")/([A-Za-z0-9_.-]+)")
    failures = []
    for path in DOC_FILES + sorted((ROOT / "skills").rglob("*.md")):
        for number, line, in_code in _code_blocks_and_prose(path.read_text()):
            for span in [line] if in_code else INLINE_CODE.findall(line):
                for family, flavor in pattern.findall(span):
                    flavor = flavor.rstrip(".")
                    if flavor not in MODEL_FLAVORS[family] and not PLACEHOLDER.match(flavor):
                        failures.append(f"{path.relative_to(ROOT)}:{number}: {family}/{flavor} is not a flavor; "
                                        f"{family} has {', '.join(MODEL_FLAVORS[family])}")
    assert not failures, "\n".join(failures)


def test_inline_config_keys_exist():
    cfg = Config()
    failures = []
    for where, key in inline_config_keys():
        section, _, name = key.partition(".")
        if not hasattr(getattr(cfg, section), name):
            failures.append(f"{where}: --{key} is not a config key")
    assert not failures, "\n".join(failures)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces to -."""
    anchors = set()
    for _, line, in_code in _code_blocks_and_prose(path.read_text()):
        if not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_exist():
    """Every relative link names an existing file and, for a Markdown file, an existing heading."""
    failures = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = path.parent / file_part if file_part else path
                if not linked.exists():
                    failures.append(f"{path.relative_to(ROOT)}:{number}: link to {target}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                    failures.append(f"{path.relative_to(ROOT)}:{number}: link to {target}: no such heading")
    assert not failures, "\n".join(failures)


def test_index_lists_every_page():
    """docs/README.md is the guide's table of contents: a new page must be added to it."""
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {target.partition("#")[0] for target in LINK.findall(index)}
    pages = {path.name for path in DOC_FILES if path.parent.name == "docs" and path.name != "README.md"}
    assert not pages - linked, f"docs/README.md does not link {', '.join(sorted(pages - linked))}"


# ----------------------------------------------------------------------------------------------
# The launchers and installers around titan-tpu: torchrun and pip lines parse as their own tools
# parse them, and each shown command is one shell command.


def _raw_lines(path: Path):
    """(line number, raw line, is a command line) of a page's code blocks or a recipe's header."""
    if path.suffix == ".toml":
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.startswith("#"):
                break
            yield number, line.lstrip("#"), line.startswith("#  ")
        return
    in_code, picture = False, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            in_code = not in_code
            picture = in_code and line.strip()[3:].strip() == "text"
        elif in_code and not picture:
            yield number, line, True


def test_shown_commands_continue_as_the_shell_reads_them():
    """A line of a shown command that ends in an even number of backslashes ends the command there
    (the shell reads `\\\\` as one escaped backslash), so the next line runs as a command of its own;
    and a recipe's header command continued onto a line that is not indented as a command loses its
    tail when copied."""
    failures = []
    for path in DOC_FILES + RECIPE_FILES:
        previous_continues = False
        for number, line, command in _raw_lines(path):
            where = f"{path.relative_to(ROOT)}:{number}"
            if command and _trailing_backslashes(line) >= 2 and not continues(line):
                failures.append(f"{where}: ends in {_trailing_backslashes(line)} backslashes; one continues a command")
            if previous_continues and not command:
                failures.append(f"{where}: continues the command above but is not indented as a command line")
            previous_continues = command and continues(line)
    assert not failures, "\n".join(failures)


def _segments(command_line: str, tool: re.Pattern) -> list[list[str]]:
    """The tokens after each invocation of `tool` in a shown command line, up to a shell operator."""
    found = []
    command_line = re.split(r"(?:^|\s)#", command_line)[0]  # a shell comment is not run
    for part in re.split(r"\s(?:&&|\|\||;|\|)\s", command_line):
        if m := tool.search(part):
            found.append(_tokens(part[m.end():]))
    return found


def _shown(tool: re.Pattern, *, needs: re.Pattern) -> list[tuple[str, list[str]]]:
    """(file:line, argv after the tool) of every shown `tool` command: code blocks, recipe headers,
    and inline code that spells a whole command (`needs` matches)."""
    shown = []
    for path in DOC_FILES + RECIPE_FILES:
        lines = (_recipe_header_lines(path) if path.suffix == ".toml" else _code_blocks_and_prose(path.read_text()))
        for number, line, in_code in lines:
            spans = [line] if in_code else [s for s in INLINE_CODE.findall(line) if needs.search(s)]
            for span in spans:
                shown += [(f"{path.relative_to(ROOT)}:{number}", argv) for argv in _segments(span, tool)]
    return shown


TORCHRUN = re.compile(r"(?:^|[\s/])(?:torchrun|python3? -m torch\.distributed\.run)\s")
PIP_INSTALL = re.compile(r"(?:^|[\s/])(?:pip3?|python3? -m pip) install\s")


def _placeholders_filled(argv: list[str]) -> list[str]:
    """$HOST0, HOST_INDEX, N: a value a reader would put there (a number fits every torchrun flag)."""
    return ["1" if token.startswith("$") or PLACEHOLDER.match(token) else token for token in argv]


def test_shown_torchrun_commands_parse():
    """Every torchrun command shown parses with torchrun's own parser and launches an existing
    module or script of this repository (the training arguments are checked above)."""
    from torch.distributed.run import get_args_parser

    shown = _shown(TORCHRUN, needs=re.compile(r"\s-m\s|\.py\b"))
    assert len(shown) >= 20, shown
    failures = []
    for where, argv in shown:
        parser = get_args_parser()
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = parser.parse_args(_placeholders_filled(argv))
        except SystemExit:
            failures.append(f"{where}: torchrun {' '.join(argv)}: {stderr.getvalue().strip().splitlines()[-1]}")
            continue
        target = (ROOT / args.training_script.replace(".", "/")).with_suffix(".py") if args.module else \
            ROOT / args.training_script
        package = target.with_suffix("") / "__main__.py"
        if not (target.is_file() or package.is_file()):
            failures.append(f"{where}: torchrun launches {args.training_script}, which is not in this repository")
    assert not failures, "\n".join(failures)


def test_shown_pip_installs_parse():
    """Every `pip install` shown parses with pip's own parser; the requirement and constraint files
    it names exist, and the extras of `.[...]` are extras of pyproject.toml."""
    import tomllib

    from pip._internal.commands import create_command

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    shown = _shown(PIP_INSTALL, needs=re.compile(r"install"))
    assert shown
    failures = []
    for where, argv in shown:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                options, packages = create_command("install", isolated=True).parse_args(argv)
        except SystemExit:
            failures.append(f"{where}: pip install {' '.join(argv)}: {stderr.getvalue().strip().splitlines()[-1]}")
            continue
        for name in options.requirements + options.constraints:
            if not (ROOT / name).is_file():
                failures.append(f"{where}: pip install names {name}, which is not a file of this repository")
        for target in options.editables + packages:
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", target):
                unknown = set(m.group(1).split(",")) - extras
                if unknown:
                    failures.append(f"{where}: extras {', '.join(sorted(unknown))} are not in pyproject.toml "
                                    f"(it has {', '.join(sorted(extras))})")
    assert not failures, "\n".join(failures)
