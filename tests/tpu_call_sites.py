"""Every use of TorchTPU (`torch.tpu.*`, `torch_tpu.*`) in the project's source, found by reading the
AST, so a new call is checked without anyone keeping a list.

Used twice: the main suite checks *where* the uses are (a small, named set of modules, never at
module level, so the project imports where torch_tpu is absent or would abort the process);
tests/tpu/ checks *what* they are against the real package (each name exists, each call's
arguments bind to its signature). This module imports neither torch nor torch_tpu.

What counts as a use:
* an attribute chain starting at `torch.tpu` or `torch_tpu` (`torch.tpu.ops.splash_sdpa(...)`);
* a name bound by `from torch.tpu.x import y` / `from torch_tpu... import y`, where it is used;
* `import torch_tpu...` and `importlib.import_module("torch_tpu...")`.
A call records how many positional arguments it passes and its keyword names; `*args` or
`**kwargs` in a call are recorded too (such a call cannot be bound statically: the checker says so).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shipped code: the package and the benchmarks. Tests are left out on purpose: they fake
# torch.tpu to test our logic without the package.
SOURCE_DIRS = ("titan_tpu", "bench")
PREFIXES = ("torch.tpu", "torch_tpu")


@dataclass(frozen=True)
class Site:
    path: str  # relative to the repository root
    line: int
    name: str  # dotted name in the real package, e.g. "torch.tpu.ops.splash_sdpa"
    called: bool
    num_positional: int = 0
    keywords: tuple[str, ...] = ()
    starred: bool = False  # *args or **kwargs in the call: its arguments cannot be bound statically
    module_level: bool = False  # outside any function: would run at import time

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _dotted(node: ast.AST) -> str | None:
    """"a.b.c" for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _is_tpu(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PREFIXES)


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path = path
        self.sites: list[Site] = []
        self.imported: dict[str, str] = {}  # local name -> dotted name, from `from torch.tpu... import`
        self.depth = 0  # function nesting: 0 = module level (or class body)
        self.seen: set[int] = set()  # ids of nodes already recorded as a call's callee

    def _add(self, node: ast.AST, name: str, call: ast.Call | None = None) -> None:
        kw = dict(called=False)
        if call is not None:
            kw = dict(called=True, num_positional=sum(not isinstance(a, ast.Starred) for a in call.args),
                      keywords=tuple(k.arg for k in call.keywords if k.arg is not None),
                      starred=any(isinstance(a, ast.Starred) for a in call.args)
                      or any(k.arg is None for k in call.keywords))
        self.sites.append(Site(self.path, node.lineno, name, module_level=self.depth == 0, **kw))

    def _resolve(self, node: ast.AST) -> str | None:
        """The TorchTPU name an expression refers to (an attribute chain or an imported name)."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in self.imported:
            dotted = self.imported[head] + ("." + rest if rest else "")
        return dotted if _is_tpu(dotted) else None

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            if _is_tpu(alias.name):
                self._add(node, alias.name)

    def visit_ImportFrom(self, node):
        if node.module and _is_tpu(node.module):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                self.imported[alias.asname or alias.name] = full
                self._add(node, full)

    def visit_Call(self, node):
        name = self._resolve(node.func)
        if name is not None:
            self._add(node, name, node)
            self.seen.add(id(node.func))
        elif _dotted(node.func) == "importlib.import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and _is_tpu(node.args[0].value):
            self._add(node, node.args[0].value)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        # Record only the whole chain (torch.tpu.ops.x, not also torch.tpu.ops and torch.tpu).
        name = self._resolve(node)
        if name is not None:
            if id(node) not in self.seen:
                self._add(node, name)
            return  # the inner links of the chain are part of this use
        self.generic_visit(node)

    def visit_Name(self, node):
        if node.id in self.imported and id(node) not in self.seen and isinstance(node.ctx, ast.Load):
            self._add(node, self.imported[node.id])


def find_sites(root: Path = ROOT, dirs: tuple[str, ...] = SOURCE_DIRS) -> list[Site]:
    """Every TorchTPU use in the .py files under `dirs`, in path and line order."""
    sites = []
    for d in dirs:
        for path in sorted((root / d).rglob("*.py")):
            finder = _Finder(str(path.relative_to(root)))
            finder.visit(ast.parse(path.read_text(), filename=str(path)))
            sites += finder.sites
    return sorted(sites, key=lambda s: (s.path, s.line, s.name))
