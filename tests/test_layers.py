"""Layers point down: a module imports from its own layer and the layers below it, never above.

`LAYERS` is the one place the order is written; docs/architecture.md ("Layers") says what lives
in each. Every import that runs counts: at the top of a module and inside a function (a lazy
import still ties the two layers together). Imports under `if TYPE_CHECKING:` do not: they name
a type for an annotation (a component's `from_config(section)` naming config.py's dataclass) and
never run. Imports are read with `ast`, so nothing is imported to check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "titan_tpu"

# Bottom to top. A module belongs to the layer of its longest matching prefix: titan_tpu.train
# holds the training parts (optimizer, step contract, objectives, checkpoints, metrics) that graph/
# builds on; the kinds of training (kinds/: each kind's record, data and objective builders) sit
# above the data and objectives they build and below the run setup that checks a config against
# them; the run's assembly (components/) sits above everything it builds, and the loops (loops/:
# pre-training and SFT, preference pairs, GRPO) above the assembly they drive. The evaluation
# (evaluation/: `titan-tpu eval` and the [evaluation] tasks) sits above the checkpoints it loads
# and below the loops, which score its tasks during training. config.py (the
# schema every layer reads) sits under every component: it reads only the kernel choices, the
# family names and the data source records; the checks that ask components sit in the run setup.
LAYERS = (
    ("base", ("titan_tpu", "titan_tpu.errors", "titan_tpu.files", "titan_tpu.extras", "titan_tpu.device",
              "titan_tpu.device_peaks", "titan_tpu.device_cpu", "titan_tpu.jax_start", "titan_tpu.tracing",
              "titan_tpu.tensors", "titan_tpu.model_contract", "titan_tpu.data.sources")),
    ("kernels", ("titan_tpu.kernels",)),
    ("models", ("titan_tpu.models",)),
    ("config", ("titan_tpu.config",)),
    ("parallel", ("titan_tpu.parallel",)),
    ("model specs", ("titan_tpu.models.spec_base", "titan_tpu.models.spec", "titan_tpu.models.hf.spec")),
    ("data", ("titan_tpu.data",)),
    ("generate", ("titan_tpu.generate",)),
    ("train", ("titan_tpu.train",)),
    ("graph", ("titan_tpu.graph",)),
    ("xla readers", ("titan_tpu.xla",)),
    ("convert", ("titan_tpu.convert", "titan_tpu.export_files")),
    ("evaluation", ("titan_tpu.evaluation",)),
    ("kinds", ("titan_tpu.kinds",)),
    ("run", ("titan_tpu.run",)),
    ("plan", ("titan_tpu.plan",)),
    ("components", ("titan_tpu.components",)),
    ("loops", ("titan_tpu.loops",)),
    ("calibration", ("titan_tpu.plan.calibrate",)),
    ("tools", ("titan_tpu.tools",)),
    ("entry points", ("titan_tpu.cli", "titan_tpu.__main__")),
)

LAYER_OF_PREFIX = {prefix: (rank, name) for rank, (name, prefixes) in enumerate(LAYERS) for prefix in prefixes}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, name) of the module's layer. The bare package name matches only itself, so a new
    top-level module has no layer until it is placed in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYER_OF_PREFIX and (prefix != "titan_tpu" or module == "titan_tpu"):
            return LAYER_OF_PREFIX[prefix]
    return None


def imported_modules(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement loads: `from titan_tpu import device` loads the
    module titan_tpu.device, `from titan_tpu.kernels import KernelConfig` the package itself."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "titan_tpu"]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    if base.split(".")[0] != "titan_tpu":
        return []
    targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return list(dict.fromkeys(targets))  # one per module: `from titan_tpu.x import a, b` loads x once


def is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth, except in the body of `if TYPE_CHECKING:`."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif is_type_checking_block(node):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return sorted(found, key=lambda n: n.lineno)


def import_edges() -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every import of a package module that runs."""
    edges = []
    for module, path in MODULES.items():
        for node in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            edges += [(module, node.lineno, target) for target in imported_modules(module, node)]
    return edges


def test_every_module_has_a_layer():
    unplaced = [module for module in MODULES if layer_of(module) is None]
    assert not unplaced, f"modules in no layer: {unplaced}; add them to LAYERS in tests/test_layers.py"


def test_every_layer_prefix_names_a_module():
    stale = [prefix for _, prefixes in LAYERS for prefix in prefixes if prefix not in MODULES]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_point_down():
    upward = []
    for module, line, target in import_edges():
        if layer_of(module) is None or layer_of(target) is None:
            continue  # test_every_module_has_a_layer names it
        (rank, name), (target_rank, target_name) = layer_of(module), layer_of(target)
        if target_rank > rank:
            path = MODULES[module].relative_to(PACKAGE_DIR.parent)
            upward.append(f"{path}:{line} imports {target}: layer {name} reaches up into layer {target_name}")
    if upward:
        pytest.fail("imports from a lower layer into a higher one (order: LAYERS in tests/test_layers.py):\n"
                    + "\n".join(upward), pytrace=False)


def test_no_import_cycles():
    """Within a layer too, no two modules depend on each other (directly or around a circle)."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, _, target in import_edges():
        if target != module:
            graph[module].add(target)
    cycles = [cycle for module in MODULES if (cycle := cycle_from(module, graph))]
    if cycles:
        pytest.fail(f"import cycle: {' -> '.join(cycles[0])}", pytrace=False)


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start along the import graph, or None."""
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop()
        for target in sorted(graph[path[-1]]):
            if target == start:
                return [*path, start]
            if target not in seen:
                seen.add(target)
                paths.append([*path, target])
    return None


def test_lazy_imports_count_and_type_checking_ones_do_not():
    tree = ast.parse("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from titan_tpu.config import Config\n"
                     "def f():\n    from titan_tpu.loops.pretrain import PretrainLoop\n")
    found = [(node.lineno, node.module) for node in runtime_imports(tree)]
    assert found == [(1, "typing"), (5, "titan_tpu.loops.pretrain")]
