"""flower_apps.papers: one command per paper's comparison, several seeds, one table."""
from __future__ import annotations

import json

import pytest

from flower_apps.config import parse_run_config, preflight
import flower_apps.papers as papers_module
from flower_apps.papers import (PAPERS, PAPERS_ENV, Budget, Claim, Paper, PapersNotFound, Row, find_papers_dir,
                                load_paper, main, papers, row_config, run_paper, write_report)
from strategies.registry import algorithm_names
from tests.datasets import needs_dataset
from tests.flower_harness import ROOT


@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_every_row_is_a_valid_run_at_the_papers_settings(paper, tmp_path):
    """Every row parses (no key contradicts its variant) and passes the pre-flight checks with
    the paper's number of SuperNodes; rows are distinct experiments."""
    p = PAPERS[paper]
    seen = set()
    for row in p.rows:
        cfg, explicit = row_config(p, row, 0, tmp_path)
        assert cfg["algo"] in algorithm_names()
        preflight(parse_run_config(cfg, explicit), p.supernodes)
        key = json.dumps({k: v for k, v in cfg.items() if k != "run-name"}, sort_keys=True)
        assert key not in seen, row.name
        seen.add(key)
        cfg1, _ = row_config(p, row, 1, tmp_path)
        assert cfg1["seed"] == 1 and cfg1["run-name"] == f"{row.name}-s1"


@needs_dataset("fashion-mnist")   # the pre-flight checks that the dataset's files are there
@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_every_paper_has_a_fashion_mnist_budget_whose_rows_are_valid(paper, tmp_path):
    """``--dataset fashion-mnist``: every paper records the budget of its Fashion-MNIST rerun, and every
    row is a valid run there (the pre-flight checks do not read the data)."""
    p = PAPERS[paper]
    budget = p.datasets["fashion-mnist"]
    assert budget.overrides["dataset"] == "fashion-mnist" and budget.settings
    assert set(budget.rows) <= set(p.rows_by_name), "a dataset's row overrides name no row"
    for row in p.rows:
        cfg, explicit = row_config(p, row, 0, tmp_path, sets=budget.overrides, row_sets=budget.rows.get(row.name))
        assert all(cfg[k] == v for k, v in budget.overrides.items() if k not in row.overrides)
        assert all(cfg[k] == v for k, v in budget.rows.get(row.name, {}).items())   # over the row's own keys
        preflight(parse_run_config(cfg, explicit), p.supernodes)
    if paper == "ssfl":   # DataSharing's G is 5% of the users' data on either dataset
        assert budget.rows["datasharing-gn"]["server-labels"] == 2950


@pytest.mark.parametrize("paper", sorted(p for p in PAPERS if PAPERS[p].budgets))
def test_a_budget_runs_every_row_over_its_datasets_keys_and_its_own(paper, tmp_path, monkeypatch):
    """``--budget NAME``: each row runs with the dataset's keys, then the budget's, then the row's
    own, then the budget's keys for that row; every such run is valid."""
    p = PAPERS[paper]
    seen: dict[str, dict] = {}
    monkeypatch.setattr(papers_module, "run_one",
                        lambda cfg, explicit, *a: seen.setdefault(cfg["run-name"], (cfg, explicit)))
    monkeypatch.setattr(papers_module, "write_report", lambda *a, **k: "")
    for name, b in p.budgets.items():
        seen.clear()
        run_paper(p, seeds=[0], out=tmp_path / name, budget=name, log=lambda m: None)
        assert set(seen) == {f"{r.name}-s0" for r in p.rows}
        for row in p.rows:
            cfg, explicit = seen[f"{row.name}-s0"]
            for k, v in {**p.datasets[b.dataset].overrides, **b.overrides}.items():
                assert cfg[k] == row.overrides.get(k, v), (row.name, k)
            assert all(cfg[k] == v for k, v in b.rows.get(row.name, {}).items()), row.name
            parse_run_config(cfg, explicit)
    if paper == "semisfl":   # the full-model rows' client steps are the budget's K_u
        assert seen["semifl-s0"][0]["local-steps"] == 50 and seen["semisfl-s0"][0]["semisfl.k-u"] == 50


def test_run_paper_writes_mean_std_table_and_restarts(tmp_path):
    logs = []
    out = run_paper("fedshvr", seeds=[0, 1], out=tmp_path, rows=["fed-sl"], rounds=2, log=logs.append)
    report = (out / "report.md").read_text()
    assert "| fed-sl | fed-sl |" in report and "| 0,1 |" in report and " ± " in report
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) == \
        ["fed-sl-s0", "fed-sl-s1"]
    # seeds give different runs (the seed also draws the partition)
    acc = [json.loads((out / f"fed-sl-s{s}" / "metrics.jsonl").read_text().splitlines()[-1])["accuracy"]
           for s in (0, 1)]
    assert acc[0] != acc[1]
    logs.clear()
    run_paper("fedshvr", seeds=[0, 1], out=tmp_path, rows=["fed-sl"], rounds=2, log=logs.append)
    assert sum("done (2 rounds), kept" in m for m in logs) == 2  # nothing re-run
    assert "--set" not in (out / "report.md").read_text()
    # keys set on every row are named under the title (the settings text is the paper's budget)
    text = write_report(PAPERS["fedshvr"], out, ["fed-sl"], [0, 1], sets={"server-labels": 250, "lr": 0.02})
    assert text.splitlines()[2] == ("Set on every row (`--set server-labels=250 lr=0.02`): where the settings "
                                    "below say otherwise, these hold.")
    assert (out / "report.md").read_text() == text


def test_cli_errors(capsys):
    assert main(["scala", "--rows", "nope"]) == 2
    assert "not in scala's rows" in capsys.readouterr().err
    assert main(["scala", "--dataset", "cifar10"]) == 2
    assert "--dataset 'cifar10': scala has a budget for fashion-mnist" in capsys.readouterr().err
    assert main(["semisfl", "--budget", "nope"]) == 2
    assert "--budget 'nope' is not one of semisfl's budgets: long" in capsys.readouterr().err
    assert main(["semisfl", "--budget", "long", "--dataset", "cifar10"]) == 2
    assert "--budget 'long' is on --dataset 'fashion-mnist', not 'cifar10'" in capsys.readouterr().err
    assert main(["scala", "--rows", "scala", "--paired", "fedavg"]) == 2
    assert "--paired 'fedavg' is not one of the --rows" in capsys.readouterr().err
    assert main(["--list"]) == 0
    assert "splitfed-v2" in capsys.readouterr().out


@pytest.mark.parametrize("paper", sorted(p for p in PAPERS if PAPERS[p].tables))
def test_every_method_of_the_papers_tables_has_a_row(paper, capsys):
    """``--list`` names every method of the paper's comparison tables with the rows that rerun
    it; every method has a (non-probe) row, and a row's table label is a method of the tables."""
    p = PAPERS[paper]
    without = {m for _, m, rows in p.coverage() if not rows}
    assert without == set(), f"{paper}: methods without a row"
    # a reason why a method has no row (``missing``) only for a method that has none
    assert set(p.missing) <= without, f"{paper}: listed as missing but rerun: {sorted(set(p.missing) - without)}"
    labels = {m for r in p.rows for m in r.methods if not r.probe}
    stray = {m for m in labels if m != m.lower() and not any(m in ms for ms in p.tables.values())}
    assert not stray, f"{paper}: row labels not in any table: {stray}"
    assert main([paper, "--list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "no row yet" not in out, f"{paper}: --list shows a method without a row"
    for table, method, rows in p.coverage():
        # each method's line of --list names the rows that rerun it
        assert f"  {table}:" in lines and f"    {method:<22} -> {', '.join(rows)}" in lines, (table, method)
        for r in rows:
            assert f"- {r} [" in out


def test_a_method_without_a_row_is_listed_with_why():
    """``missing``: a method of the paper's tables that no row reruns is listed as such, with the
    reason the tables give (or "not implemented")."""
    p = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B",
              rows=(Row("a", {"algo": "fedavg"}, label="A"), Row("a2", {"algo": "fedavg"}, probe=True, label="B")),
              tables={"Table 1": ("A", "B", "C")}, missing={"B": "needs a server optimiser"})
    assert p.coverage() == [("Table 1", "A", ["a"]), ("Table 1", "B", []), ("Table 1", "C", [])]
    listing = p.listing()
    assert "    A                      -> a\n" in listing
    assert "    B                      -> no row yet (needs a server optimiser)\n" in listing
    assert "    C                      -> no row yet (not implemented)\n" in listing


def test_the_tables_are_read_from_conf_papers_into_the_dataclasses():
    """Every conf/papers/<paper>.toml is a Paper whose rows, claims and budgets are the dataclasses
    with tuples where the code reads tuples; the files' ``order`` is the listing's."""
    folder = ROOT / "conf" / "papers"
    assert find_papers_dir() == folder
    assert list(PAPERS) == ["semisfl", "ssfl", "fedshvr", "umpfssl", "scala"]
    assert sorted(f.stem for f in folder.glob("*.toml")) == sorted(PAPERS)
    for name, p in PAPERS.items():
        assert p == load_paper(folder / f"{name}.toml") and p.name == name
        assert isinstance(p.rows, tuple) and all(isinstance(r, Row) for r in p.rows)
        assert isinstance(p.claims, tuple) and all(isinstance(c, Claim) for c in p.claims)
        assert all(isinstance(ms, tuple) for ms in p.tables.values())
        assert all(isinstance(b, Budget) for b in p.datasets.values())
        assert all(isinstance(r.label, (str, tuple)) for r in p.rows)
    assert PAPERS["semisfl"].rows_by_name["semisfl"].label == ("Semi-SFL", "w/ K_s controller")


def test_the_tables_ship_in_the_sdist_not_in_the_wheel():
    """conf/ (the paper tables among the experiment configs) is in the source distribution; the
    wheel holds the four packages only, so the tables are not in the installed library."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as fh:
        targets = tomllib.load(fh)["tool"]["hatch"]["build"]["targets"]
    assert "conf" in targets["sdist"]["include"]
    assert sorted(targets["wheel"]["packages"]) == ["flower_apps", "split_layer", "strategies", "tasks"]
    assert not list((ROOT / "flower_apps").rglob("*.toml"))


def test_without_the_tables_the_command_says_where_it_looked_and_how_to_point_elsewhere(
        tmp_path, monkeypatch, capsys):
    """As from a wheel (no conf/ beside the package, none in the working directory): exit 2 with
    the folders looked in and the option and variable that point elsewhere; both then work."""
    monkeypatch.setattr(papers_module, "__file__", str(tmp_path / "site-packages" / "flower_apps" / "papers.py"))
    monkeypatch.delenv(PAPERS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["scala", "--list"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "site-packages" / "conf" / "papers") in err and str(tmp_path / "conf" / "papers") in err
    assert "--tables DIR" in err and f"{PAPERS_ENV}=DIR" in err
    with pytest.raises(PapersNotFound):
        papers()
    assert main(["scala", "--list", "--tables", str(ROOT / "conf" / "papers")]) == 0
    assert "scala: SCALA" in capsys.readouterr().out
    monkeypatch.setenv(PAPERS_ENV, str(ROOT / "conf" / "papers"))
    assert main(["scala", "--list"]) == 0
    assert "scala: SCALA" in capsys.readouterr().out


def test_a_key_no_dataclass_takes_is_an_error_naming_the_file_and_key(tmp_path, capsys):
    (tmp_path / "toy.toml").write_text('title = "Toy"\nsupernodes = 2\nexpected = "A > B"\n[base]\n'
                                       '[[rows]]\nname = "a"\noverides = {algo = "fedavg"}\n')
    with pytest.raises(ValueError, match=r"toy.toml: .*unexpected keyword argument 'overides'"):
        load_paper(tmp_path / "toy.toml")
    assert main(["--list", "--tables", str(tmp_path)]) == 2
    assert "toy.toml" in capsys.readouterr().err
    (tmp_path / "toy.toml").write_text('title = "Toy\n')
    with pytest.raises(ValueError, match=r"toy.toml: not valid TOML"):
        load_paper(tmp_path / "toy.toml")



def test_an_unknown_paper_is_refused_naming_the_papers(capsys):
    with pytest.raises(SystemExit) as e:
        main(["nosuch", "--list"])
    assert e.value.code == 2
    assert "invalid choice: 'nosuch' (choose from 'fedshvr', 'scala', 'semisfl', 'ssfl', 'umpfssl')" in \
        capsys.readouterr().err
