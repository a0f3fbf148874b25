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


LIBRARY = ("strategies", "split_layer", "tasks", "flower_apps")
PAPERS = ("semisfl", "ssfl", "fedshvr", "umpfssl", "scala")


def _py(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_class_in_the_library_has_more_than_25_methods():
    big = []
    for path in _py(*LIBRARY):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > 25:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {len(methods)} methods")
    assert not big, big


def test_the_base_strategy_module_is_short():
    assert len((ROOT / "strategies" / "base.py").read_text().splitlines()) < 300


@pytest.mark.parametrize("layer", ["strategies", "tasks"])
def test_a_papers_folder_imports_no_other_paper_and_the_generic_modules_import_none(layer):
    """``strategies/<paper>/`` and ``tasks/<paper>/`` hold one paper's algorithm and its
    baselines; they build on the generic modules, never on another paper's folder, and the
    generic modules never import a paper's folder."""
    bad = []
    for path in _py(layer):
        rel = path.relative_to(ROOT)
        own = rel.parts[1] if len(rel.parts) > 2 and rel.parts[1] in PAPERS else None
        tree = ast.parse(path.read_text(), str(path))
        package = ".".join(rel.parent.parts)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    names = [node.module]
                else:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    names = [".".join([*base, *([node.module] if node.module else [])])]
            for name in names:
                parts = name.split(".")
                if len(parts) >= 2 and parts[0] == layer and parts[1] in PAPERS:
                    paper = parts[1]
                    if own is None and not (len(rel.parts) == 2 and rel.name == "registry.py"):
                        bad.append(f"{rel}:{node.lineno} (generic) imports {name}")
                    elif own is not None and paper != own:
                        bad.append(f"{rel}:{node.lineno} ({own}) imports {name}")
    assert not bad, "\n".join(bad)


def test_the_layout_in_the_docs_names_every_module_where_it_is():
    """docs/testing.md's Layout names each folder of strategies/ and tasks/ and every module in it."""
    text = (ROOT / "docs" / "testing.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    blocks: dict[str, str] = {}
    current = None
    for line in layout.splitlines():
        head = line.split()[0] if line and not line[0].isspace() else None
        if head and head.endswith("/"):
            current = head
        if current:
            blocks[current] = blocks.get(current, "") + "\n" + line
    missing = []
    for folder in ("strategies", "tasks"):
        for path in _py(folder):
            rel = path.relative_to(ROOT)
            if path.name == "__init__.py" or "partition" in rel.parts[1:-1]:
                continue
            key = "/".join(rel.parts[:-1]) + "/"
            if key not in blocks or path.name not in blocks[key]:
                missing.append(f"{rel} (under {key})")
    assert not missing, missing
