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


def test_a_budget_judges_each_claim_beside_the_first_and_has_its_own_section(tmp_path):
    from flower_apps.papers import Budget

    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, label="A"), Row("b", {"algo": "b"}, label="B")),
                  tables={"Table 1": ("A", "B")}, reference="a", claims=(Claim("A > B", "a", "b", "+10"),),
                  datasets={"fashion-mnist": Budget({"dataset": "fashion-mnist"}, "full data")},
                  budgets={"long": Budget({"num-rounds": 3}, "three rounds", dataset="fashion-mnist", target=0.75)})
    first, long = tmp_path / "toy-fmnist", tmp_path / "toy-fmnist-long"
    for s in range(3):   # 2 rounds: A behind B; 3 rounds: A ahead (0.80/0.81/0.82 vs 0.70)
        _run(first / f"a-s{s}", "a", s, [0.5, 0.6])
        _run(first / f"b-s{s}", "b", s, [0.5, 0.65])
        _run(long / f"a-s{s}", "a", s, [0.5, 0.7, 0.80 + s / 100])
        _run(long / f"b-s{s}", "b", s, [0.5, 0.6, 0.70])
    text, _ = results_page(paper, first, "fashion-mnist", figure="toy.png")
    # the base comparison's settings stand under the dataset's budget, which names the keys it sets over them
    assert "Budget: full data.\n" in text
    assert ("Settings of the base comparison, under the budget above, which sets `dataset = 'fashion-mnist'` "
            "over them: s.\n") in text
    head = next(ln for ln in text.splitlines() if ln.startswith("| claim |"))
    assert head.endswith("| verdict | long: A - B (final) | long: seeds A ahead | long: paired t | long: verdict |")
    line = next(ln for ln in text.splitlines() if ln.startswith("| A > B |"))
    assert "| -0.050 ± 0.000 (seeds 0,1,2) | 0/3 | -inf | not reproduced (reversed, significant) |" in line
    assert line.endswith("| +0.110 ± 0.010 (seeds 0,1,2) | 3/3 | +19.05 | reproduced |")
    section = text.split("## At the budget `long`", 1)[1]
    assert "runs/toy-fmnist-long/" in section and "three rounds." in section
    assert "`python -m flower_apps.papers toy --budget long --seeds 0 1 2` (the committed seeds;" in section
    assert "Time and bytes to accuracy >= 0.75" in section   # a (round 3) reaches it, b never does
    assert "| a | a | 3/3 |" in section and "| b | b | 0/3 |" in section
    assert "(toy-long-accuracy.png)" in section and "mask-rate" not in section   # no such metric logged


def test_a_budget_must_be_on_one_of_the_papers_datasets(tmp_path):
    from flower_apps.papers import load_paper

    f = tmp_path / "toy.toml"
    f.write_text('title = "t"\nsupernodes = 2\nexpected = "e"\nbase = {}\n'
                 '[datasets.fashion-mnist]\noverrides = {}\nsettings = "s"\n'
                 '[budgets.long]\ndataset = "cifar10"\noverrides = {}\nsettings = "s"\n')
    with pytest.raises(ValueError, match=r"\[budgets.long\] dataset='cifar10' is not one of its \[datasets.\*\]: "
                                         "fashion-mnist"):
        load_paper(f)


def _timed_run(folder: Path, algo: str, seed: int, accs: list[float], seconds_per_round: float) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed, "run-name": folder.name,
                                                    "system": "t"}))
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"round": i + 1, "accuracy": a, "sim-seconds-total": seconds_per_round * (i + 1)}) + "\n"
        for i, a in enumerate(accs)))


def test_a_time_claim_is_judged_on_the_paired_log_times_to_the_budgets_target(tmp_path):
    from flower_apps.pages import time_claim_table
    from flower_apps.report import read_run, seed_groups

    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}), Row("b", {"algo": "b"}), Row("c", {"algo": "c"})),
                  claims=(Claim("A > B", "a", "b", "+1", paper_time="3.0x sooner"),
                          Claim("A > C", "a", "c", "+1", paper_time="2x sooner"), Claim("no time", "a", "b", "+1")))
    for s in range(3):
        # a reaches 0.8 in round 2 at 10 s/round (20 s); b in round 4 at 10 + s s/round; c never in 3 rounds of 50 s
        _timed_run(tmp_path / f"a-s{s}", "a", s, [0.5, 0.8, 0.8], 10.0)
        _timed_run(tmp_path / f"b-s{s}", "b", s, [0.5, 0.6, 0.7, 0.85], 10.0 + s)
        _timed_run(tmp_path / f"c-s{s}", "c", s, [0.5, 0.6, 0.7], 50.0)
    by_label = {g.label: g for g in seed_groups([read_run(d) for d in sorted(tmp_path.iterdir())])}
    text = time_claim_table(paper, by_label, 0.8)
    lines = text.splitlines()
    # B/A per seed: 40/20, 44/20, 48/20 -> geometric mean of 2.0, 2.2, 2.4
    gm = math.exp(sum(math.log(r) for r in (2.0, 2.2, 2.4)) / 3)
    d = [math.log(r) for r in (2.0, 2.2, 2.4)]
    assert f"| A > B | 3.0x sooner | {gm:.2f}x (seeds 0,1,2) | 3/3 and 3/3 | {paired_t(d):+.2f} | reproduced |" in lines
    # C never reaches it: its whole 150 s counts, the ratio 7.5x is a lower bound
    assert "| A > C | 2x sooner | >= 7.50x (seeds 0,1,2) | 3/3 and 0/3 | +inf | reproduced |" in lines
    assert not any(ln.startswith("| no time |") for ln in lines)   # a claim without a time claim is not listed
    assert "a bound supports only a verdict in its own direction" in text


def test_a_time_bound_supports_a_verdict_only_in_its_own_direction(tmp_path):
    from flower_apps.pages import time_claim_table
    from flower_apps.report import read_run, seed_groups

    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}), Row("b", {"algo": "b"})),
                  claims=(Claim("A > B", "a", "b", "+1", paper_time="5x sooner"),
                          Claim("B > A", "b", "a", "+1", paper_time="5x sooner")))
    for s in range(3):
        # a reaches 0.8 in round 10 at 10 s/round (100 s); b is faster per round (1 s) but reaches it on seed 0
        # only (round 4), and stops at round 10 + s below it on seeds 1, 2: its 11 and 12 s are lower bounds
        _timed_run(tmp_path / f"a-s{s}", "a", s, [0.5] * 9 + [0.8], 10.0)
        _timed_run(tmp_path / f"b-s{s}", "b", s, [0.5, 0.6, 0.7, 0.85] if s == 0 else [0.5] * (10 + s), 1.0)
    by_label = {g.label: g for g in seed_groups([read_run(d) for d in sorted(tmp_path.iterdir())])}
    lines = time_claim_table(paper, by_label, 0.8).splitlines()
    # B/A: 4/100, >= 11/100, >= 12/100: B looks sooner, but on seeds 1, 2 it may never get there
    a_b = next(ln for ln in lines if ln.startswith("| A > B |"))
    assert "| >= 0.08x (seeds 0,1,2) | 3/3 and 1/3 |" in a_b and a_b.endswith("| not reproduced (a bound on seeds 1,2) |")
    assert verdict([math.log(r) for r in (0.04, 0.11, 0.12)]) == "not reproduced (reversed, significant)"
    # judged the other way round (A = b), the same times are upper bounds on A's: "reproduced" cannot stand;
    # the ratio is 1 / the geometric mean of 0.04, 0.11, 0.12 = 12.37
    b_a = next(ln for ln in lines if ln.startswith("| B > A |"))
    assert f"| <= {(0.04 * 0.11 * 0.12) ** (-1 / 3):.2f}x (seeds 0,1,2) | 1/3 and 3/3 |" in b_a and b_a.endswith("| in direction only (a bound on seeds 1,2) |")


def test_the_target_tables_ratios_pair_the_seeds_both_rows_reached_it_on(tmp_path):
    from flower_apps.report import read_run, seed_groups, target_table

    # a reaches 0.8 in round 2 on every seed, at 10 s/round on seed 0 and 100 s/round on seed 1;
    # b reaches it in round 4 on seed 0 only (10 s/round): paired, b takes 40/20 = 2x a's time;
    # means over the seeds each reached it on would say 40 / ((20 + 200) / 2) = 0.36x
    _timed_run(tmp_path / "a-s0", "a", 0, [0.5, 0.8], 10.0)
    _timed_run(tmp_path / "a-s1", "a", 1, [0.5, 0.8], 100.0)
    _timed_run(tmp_path / "b-s0", "b", 0, [0.5, 0.6, 0.7, 0.85], 10.0)
    _timed_run(tmp_path / "b-s1", "b", 1, [0.5, 0.6, 0.7], 10.0)
    _timed_run(tmp_path / "c-s1", "c", 1, [0.5, 0.6, 0.8], 10.0)
    groups = seed_groups([read_run(d) for d in sorted(tmp_path.iterdir())])
    lines = target_table(groups, 0.8, reference="a").splitlines()
    assert any(ln.startswith("| a | a | 2/2 |") and ln.endswith("| 1.00x (seeds 0,1) | n/a |") for ln in lines)
    assert any(ln.startswith("| b | b | 1/2 |") and "| 2.00x (seeds 0) |" in ln for ln in lines)
    # c reached it on seed 1 only, a on seed 1 in 200 s: 30 / 200
    assert any(ln.startswith("| c | c | 1/1 |") and "| 0.15x (seeds 1) |" in ln for ln in lines)


def test_a_corrected_baseline_stands_beside_its_former_self_with_what_changed(tmp_path):
    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, former="a-old"),
                        Row("a-old", {"algo": "a"}, probe=True, note="evaluated the old way"),
                        Row("b", {"algo": "b"})))
    for s, (x, y) in enumerate([(0.2, 0.5), (0.25, 0.45)]):
        _run(tmp_path / f"a-s{s}", "a", s, [0.1, x])
        _run(tmp_path / f"a-old-s{s}", "a-old", s, [0.1, y])
    text, _ = results_page(paper, tmp_path)
    section = text.split("## Baselines corrected to their originals", 1)[1]
    # now - former per seed: -0.30, -0.20
    assert ("| `a` | 0.225 ± 0.035 | `a-old` | 0.475 ± 0.035 | -0.250 ± 0.071 (seeds 0,1) | evaluated the old way |"
            in section)
    bare = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="e", rows=(Row("b", {"algo": "b"}),))
    assert "Baselines corrected" not in results_page(bare, tmp_path)[0]   # no row names a former self


def test_another_attackers_record_stands_beside_the_default_ones_paired_by_seed(tmp_path):
    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="e",
                  rows=(Row("a", {"algo": "a"}), Row("b", {"algo": "b"})))

    def rec(decoder: str, mse: float, ssim: float, psnr: float) -> str:
        return json.dumps({"decoder": decoder, "attack-mse": mse, "attack-ssim": ssim, "attack-psnr": psnr})

    # seeds 0, 1 hold both records, seed 2 the default only (left out of the pairing); b has no other record
    for s, (new, old) in enumerate([((0.010, 0.60, 20.0), (0.007, 0.80, 22.0)),
                                    ((0.012, 0.64, 19.0), (0.009, 0.76, 21.0)), ((0.5, 0.1, 5.0), None)]):
        _run(tmp_path / f"a-s{s}", "a", s, [0.1, 0.2])
        (tmp_path / f"a-s{s}" / "attack.json").write_text(rec("shallow", *new))
        if old:
            (tmp_path / f"a-s{s}" / "attack-deep.json").write_text(rec("deep", *old))
    _run(tmp_path / "b-s0", "b", 0, [0.1, 0.2])
    (tmp_path / "b-s0" / "attack.json").write_text(rec("shallow", 0.02, 0.5, 17.0))
    text, _ = results_page(paper, tmp_path)
    section = text.split("## Baselines corrected to their originals", 1)[1]
    assert ("| `a` | shallow (default) | `attack.json` | 0,1 | 0.0110 ± 0.0014 | 0.620 ± 0.028 | 19.50 ± 0.71 |  |"
            in section)
    # deep - shallow per seed: MSE -0.003, -0.003; SSIM +0.20, +0.12; PSNR +2, +2
    assert ("| `a` | deep | `attack-deep.json` | 0,1 | 0.0080 ± 0.0014 | 0.780 ± 0.028 | 21.50 ± 0.71 | "
            "-0.0030 ± 0.0000 / +0.160 ± 0.057 / +2.00 ± 0.00 |" in section)
    assert "| `b` |" not in section
    for f in tmp_path.glob("a-s*/attack-deep.json"):
        f.unlink()
    assert "Baselines corrected" not in results_page(paper, tmp_path)[0]


def test_a_former_row_must_be_another_row_of_the_paper(tmp_path):
    from flower_apps.papers import load_paper

    f = tmp_path / "toy.toml"
    f.write_text('title = "t"\nsupernodes = 2\nexpected = "e"\nbase = {}\n'
                 '[[rows]]\nname = "a"\noverrides = {algo = "a"}\nformer = "a-old"\n')
    with pytest.raises(ValueError, match=r"row 'a' former='a-old' is not another row of the paper"):
        load_paper(f)
    assert PAPERS["umpfssl"].rows_by_name["pfedme-fix"].former == "pfedme-fix-theta"


def test_the_round_cost_table_splits_a_rounds_simulated_time_into_links_and_compute(tmp_path):
    from flower_apps.report import read_run, round_cost_table, seed_groups

    def timed(folder: Path, algo: str, seed: int, rounds: list[tuple[float, float, float, float]]) -> None:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"algo": algo, "seed": seed, "system": "t"}))
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"round": i + 1, "accuracy": 0.5, "sim-seconds": s, "sim-node-compute-seconds": c,
                        "sim-server-seconds": v, "bytes.total": b}) + "\n" for i, (s, c, v, b) in enumerate(rounds)))

    # a-s0: 10 s + 30 s, 2 + 6 s of compute, 0 + 2 s of server: links 30/40; 1 MB + 3 MB a round
    timed(tmp_path / "a-s0", "a", 0, [(10.0, 2.0, 0.0, 1e6), (30.0, 6.0, 2.0, 3e6)])
    # a-s1: 20 s a round, all of it links; 2 MB
    timed(tmp_path / "a-s1", "a", 1, [(20.0, 0.0, 0.0, 2e6)])
    _run(tmp_path / "b-s0", "b", 0, [0.5])   # untimed: no line
    text = round_cost_table(seed_groups([read_run(d) for d in sorted(tmp_path.iterdir())]))
    assert "| a | a | 2 | 20.0 ± 0.0 | 2.0 ± 0.0 | 0.875 ± 0.177 |" in text   # links 0.75 and 1.0
    assert "| b |" not in text
    assert round_cost_table(seed_groups([read_run(tmp_path / "b-s0")])) == ""


def test_a_row_marked_reconstruction_is_tagged_in_the_papers_tables(tmp_path):
    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, label="A", reconstruction=True),
                        Row("b", {"algo": "b"}, label="B", note="not a reconstruction of anything")),
                  tables={"Table 1": ("A", "B")})
    _run(tmp_path / "a-s0", "a", 0, [0.5, 0.8])
    _run(tmp_path / "b-s0", "b", 0, [0.5, 0.7])
    text, _ = results_page(paper, tmp_path)
    assert "| Table 1 | A |  | `a` (reconstruction) | 0.800 ± 0.000 | 0 |" in text
    assert "| Table 1 | B |  | `b` | 0.700 ± 0.000 | 0 |" in text   # a note's wording tags nothing
    assert {p: [r.name for r in PAPERS[p].rows if r.reconstruction] for p in ("semisfl", "scala")} == \
        {"semisfl": ["fedswitch"], "scala": ["sfl-local-loss", "cs-sfl"]}


def test_a_page_draws_each_curve_its_runs_report_and_links_it(tmp_path):
    from flower_apps.pages import write_page

    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, label="A"), Row("b", {"algo": "b"}, label="B")),
                  tables={"Table 1": ("A", "B")}, reference="a")
    folder = runs_dir("toy", root=tmp_path)
    for s in range(2):
        _run(folder / f"a-s{s}", "a", s, [0.5, 0.6])
        _run(folder / f"b-s{s}", "b", s, [0.4, 0.5])
    with open(folder / "a-s0" / "metrics.jsonl", "a") as f:   # one run of one row logs a mask rate
        f.write(json.dumps({"round": 3, "accuracy": 0.7, "mask-rate": 0.4}) + "\n")
    text = write_page(paper, root=tmp_path).read_text()
    assert "(toy.png)" in text and "(toy-mask-rate.png)" in text
    assert (tmp_path / "toy.png").stat().st_size > 0 and (tmp_path / "toy-mask-rate.png").stat().st_size > 0
    assert "pseudo-label-accuracy" not in text and not (tmp_path / "toy-pseudo-label-accuracy.png").exists()
