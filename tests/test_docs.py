"""README and docs/ as a new user meets them: a README read in two minutes that leads with the
own-app example, reference pages with no development history, and no link that leads nowhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: how a development diary reads: numbered work sessions, issue numbers, dates
HISTORY = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)) "
                     r"session\b|\bissues? #?\d+|\(#\d+\)|\b20\d\d-\d\d-\d\d\b|\bstint\b", re.IGNORECASE)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines():
        m = re.match(r"^#+\s+(.*)", line)
        if m:
            s = _slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_the_readme_is_short_and_leads_with_the_own_app_example():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_000
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("## Use an algorithm in your own Flower app"))
    assert at < 80 and lines[at + 2] == "```python"
    assert "pip install -e . && flwr run . --stream" in text
    assert 'pip install -e ".[test]" && python -m pytest' in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_narrates_how_the_project_was_developed(page):
    hits = [f"{i}: {m.group(0)}" for i, line in enumerate(page.read_text().splitlines(), 1)
            for m in HISTORY.finditer(line)]
    assert not hits, hits


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            broken.append(link)
    assert not broken, broken


def test_the_history_pattern_catches_a_diary_line():
    assert HISTORY.search("measured in the eighth session (2026-11-26), issue 29")
    assert not HISTORY.search("a node's earlier session's token is refused")


def test_the_walkthrough_is_the_module_it_describes():
    """docs/adding-an-algorithm.md's FixProx code: the same imports (public names only) and the
    same classes and registration as strategies/umpfssl/fixprox.py."""
    import ast
    import re

    doc = (ROOT / "docs" / "adding-an-algorithm.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    src = (ROOT / "strategies" / "umpfssl" / "fixprox.py").read_text()

    def imports(text):
        return {(n.module, n.level, tuple(a.name for a in n.names)) for n in ast.parse(text).body
                if isinstance(n, ast.ImportFrom) and n.module != "__future__"}

    def classes(text):
        return {n.name: [ast.unparse(b) for b in n.bases] for n in ast.parse(text).body if isinstance(n, ast.ClassDef)}

    assert imports(code) <= imports(src), imports(code) - imports(src)
    assert not [name for _, _, names in imports(code) for name in names if name.startswith("_")]
    assert classes(code) == classes(src)
    assert "ALGORITHMS = register(" in code and "ALGORITHMS = register(" in src
