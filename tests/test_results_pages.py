"""Every results page in docs/paper-results/ is what `python -m flower_apps.papers <paper> --page`
makes of the run folders committed under docs/paper-results/runs/, and the verdicts follow the rule
the pages state."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flower_apps.pages import paired_t, results_page, runs_dir, t_critical, verdict
from flower_apps.papers import PAPERS, Claim, Paper, Row

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "paper-results"


@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_the_committed_results_page_is_the_one_its_run_folders_make(paper):
    committed = (DOCS / f"{paper}.md").read_text()
    text, groups = results_page(PAPERS[paper], runs_dir(paper, root=DOCS), figure=f"{paper}.png" if
                                (DOCS / f"{paper}.png").exists() else "")
    assert text == committed, (f"docs/paper-results/{paper}.md is stale or edited by hand: regenerate it with "
                               f"`python -m flower_apps.papers {paper} --page`")
    assert bool(groups) == (DOCS / f"{paper}.png").exists(), "the figure goes with the committed runs"


def test_every_claim_and_reported_number_names_a_row_and_method_of_its_paper():
    for p in PAPERS.values():
        methods = {m for ms in p.tables.values() for m in ms}
        assert set(p.reported) <= methods, p.name
        assert p.reference in p.rows_by_name, p.name
        for c in p.claims:
            assert {c.better, c.worse} <= set(p.rows_by_name), (p.name, c)


def test_verdicts_follow_the_paired_t_at_the_two_sided_five_percent_level():
    # t = mean / (std / sqrt n); 3 seeds: 4.303 at 2 degrees of freedom
    assert t_critical(2) == 4.303 and t_critical(4) == 2.776 and t_critical(100) == 1.96
    d = [0.10, 0.11, 0.12]                     # mean 0.11, std 0.01: t = 19.05
    assert paired_t(d) == pytest.approx(0.11 / (0.01 / math.sqrt(3)))
    assert verdict(d) == "reproduced"
    assert verdict([0.05, -0.01, 0.02]) == "in direction only"     # t = 0.99
    assert verdict([0.05]) == "in direction only"                  # one seed decides nothing
    assert verdict([-0.01, 0.005, -0.002]) == "not reproduced"
    assert verdict([-0.10, -0.11, -0.12]) == "not reproduced (reversed, significant)"
    assert verdict([]) == "no committed runs"


def _run(folder: Path, algo: str, seed: int, accs: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed, "run-name": folder.name}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"round": i + 1, "accuracy": a}) + "\n"
                                                  for i, a in enumerate(accs)))


def test_a_page_pairs_seeds_marks_missing_rows_and_shows_the_papers_numbers(tmp_path):
    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, label="A"), Row("b", {"algo": "b"}, label="B"),
                        Row("c", {"algo": "c"}, label="C")),
                  tables={"Table 1": ("A", "B", "C")}, reported={"A": "90.0", "B": "80.0"}, reference="a",
                  claims=(Claim("A > B", "a", "b", "+10"), Claim("A > C", "a", "c", "+5")))
    for s, (x, y) in enumerate([(0.8, 0.7), (0.82, 0.7), (0.81, 0.72)]):
        _run(tmp_path / f"a-s{s}", "a", s, [0.5, x])
        _run(tmp_path / f"b-s{s}", "b", s, [0.4, y])
    text, groups = results_page(paper, tmp_path)
    assert [g.label for g in groups] == ["a", "b"]
    # A - B per seed: 0.10, 0.12, 0.09: mean 0.1033, std 0.0153, t = 11.72 > 4.303
    assert "| A > B | +10 | +0.103 ± 0.015 (seeds 0,1,2) | 3/3 | +11.72 | reproduced |" in text
    assert "| A > C | +5 | not regenerable: no committed runs of `c` |  |  | not regenerable |" in text
    assert "| Table 1 | A | 90.0 | `a` | 0.810 ± 0.010 | 0,1,2 |" in text
    assert "| Table 1 | C |  | `c` | not regenerable: no committed run folder" in text
