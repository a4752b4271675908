"""`titan-tpu config`: every config key with its type, default and meaning, read from the schema.

The meaning of a key is the comment the schema (config.py, and the section classes it composes)
writes for it: the comment at the end of the field's line, else the comment block right above it.
So the reference cannot drift from the code: a new key documents itself where it is declared, and
tests/test_cli.py fails on a key without a comment.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass

from titan_tpu.config import SECTIONS, Config

__all__ = ["KeyDoc", "config_reference", "format_reference", "main"]

_FIELD = re.compile(r"^\s+(\w+):\s*[^=#]+?(?:=.*?)?(?:\s+#\s*(?P<comment>.*))?$")


@dataclass(frozen=True)
class KeyDoc:
    key: str  # section.key, or output_dir
    type: str  # int, float, bool, str, list of str, or the choices
    default: str  # as it would be written on the command line
    help: str  # the schema's comment for it ("" when it has none)


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if origin is list:
        return f"list of {typing.get_args(annotation)[0].__name__}"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) if all(isinstance(v, str) for v in value) else "(TOML only)"
    return '""' if value == "" else str(value)


def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment written for it in the class's source (module docstring)."""
    out, block = {}, []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match and not stripped.startswith(("def ", "@")):
            out[match.group(1)] = match.group("comment") or " ".join(block)
        block = []
    return out


def config_reference() -> list[KeyDoc]:
    """Every key of the schema, section by section in the schema's order."""
    cfg, docs = Config(), []
    for section in SECTIONS:
        section_obj = getattr(cfg, section)
        cls = type(section_obj)
        hints, comments = typing.get_type_hints(cls), _comments(cls)
        for f in dataclasses.fields(cls):
            docs.append(KeyDoc(f"{section}.{f.name}", _type_name(hints[f.name]),
                               _default_text(getattr(section_obj, f.name)), comments.get(f.name, "")))
    docs.append(KeyDoc("output_dir", "str", '""', _comments(Config).get("output_dir", "")))
    return docs


def format_reference(docs: list[KeyDoc], *, section: str | None = None) -> str:
    """The listing `titan-tpu config` prints: one key per line, its meaning indented below."""
    lines = []
    for doc in docs:
        if section and not doc.key.startswith(section + "."):
            continue
        lines.append(f"--{doc.key} ({doc.type}; default {doc.default})")
        if doc.help:
            lines += textwrap.wrap(doc.help, width=100, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="titan-tpu config",
        description="List every config key with its type, default and meaning. Each is a TOML key of its section "
                    "in a recipe and an override on the command line of train, plan, graph and prepare-data "
                    "(--section.key VALUE).")
    parser.add_argument("section", nargs="?", choices=SECTIONS, help="only this section's keys")
    args = parser.parse_args(argv)
    print(format_reference(config_reference(), section=args.section))
    return 0
