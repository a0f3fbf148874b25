"""Imports point down only (README "Layout and tests").

flower_apps/ -> strategies/ -> split_layer/ -> strategies/core/ -> tasks/. The core of the round
loop (``strategies/core/``: records, round policy, node directory, the loop and its parts) knows
nothing of split learning nor of the algorithms: the split layer builds on it. ``tasks/`` is
plain torch: no Flower, and flwr-datasets only where it adapts to it (the Partitioner classes,
the hub loader). Every import statement counts, also one inside a function.
"""
import ast

import pytest

from tests.flower_harness import ROOT

CORE = "strategies.core"
FORBIDDEN = {
    "tasks": {"flwr", "flwr_datasets", "split_layer", "strategies", CORE, "flower_apps"},
    "strategies/core": {"split_layer", "strategies", "flower_apps"},
    "split_layer": {"strategies", "flower_apps"},
    "strategies": {"flower_apps"},
}
# the flwr-datasets adapters: the one place each of tasks/ may import it
ALLOWED = {("tasks/partition/partitioners.py", "flwr_datasets"), ("tasks/data.py", "flwr_datasets")}


def _layer(module: str) -> str:
    """The layer an imported module belongs to: the core (``strategies.core...``) or its top package."""
    return CORE if module == CORE or module.startswith(CORE + ".") else module.split(".")[0]


def _imports(path):
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, _layer(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.lineno, _layer(node.module)
            else:   # relative: from the file's own package, up level - 1
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                yield node.lineno, _layer(".".join([*base, *([node.module] if node.module else [])]))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, top in _imports(path):
            if top in FORBIDDEN[package] and (rel, top) not in ALLOWED:
                bad.append(f"{rel}:{line} imports {top}")
    assert not bad, "\n".join(bad)


def test_the_example_app_uses_the_public_api_only():
    bad = []
    for path in sorted((ROOT / "examples").rglob("*.py")):
        for line, top in _imports(path):
            if top == "flower_apps":
                bad.append(f"{path.relative_to(ROOT)}:{line}")
    assert not bad, bad


def test_the_base_strategy_lives_with_the_strategies():
    """``split_layer/`` defines no Flower Strategy: the base strategy and its round
    loop are ``strategies.base``'s; the split layer states what it needs (``RoundHost``)."""
    bad = []
    for path in sorted((ROOT / "split_layer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if node.name.endswith("Strategy") or "Strategy" in bases:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}")
    assert not bad, bad
    from split_layer.runtime import SplitRuntime
    from strategies.base import BaseStrategy
    from strategies.split_base import SplitStrategy
    assert SplitStrategy.__mro__[1:3] == (SplitRuntime, BaseStrategy)
