"""flower_apps.papers: one command per paper's comparison, several seeds, one table."""
from __future__ import annotations

import json

import pytest

from flower_apps.config import parse_run_config, preflight
from flower_apps.papers import PAPERS, main, row_config, run_paper, write_report
from strategies.registry import algorithm_names
from tests.datasets import needs_dataset


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
    assert main(["scala", "--rows", "scala", "--paired", "fedavg"]) == 2
    assert "--paired 'fedavg' is not one of the --rows" in capsys.readouterr().err
    assert main(["--list"]) == 0
    assert "splitfed-v2" in capsys.readouterr().out


@pytest.mark.parametrize("paper", ["semisfl", "ssfl", "umpfssl", "scala"])
def test_every_method_of_the_papers_tables_has_a_row(paper, capsys):
    """``--list`` names every method of the paper's comparison tables with the rows that rerun
    it; a method without a row is allowed only where ``missing`` names the open issue that
    adds it (SCALA's split baselines and SCALA-PE: issue 27)."""
    p = PAPERS[paper]
    assert p.tables
    uncovered = {m for _, m, rows in p.coverage() if not rows}
    assert uncovered == set(p.missing), f"{paper}: methods without a row: {sorted(uncovered - set(p.missing))}"
    assert all(v.startswith("issue 27") for v in p.missing.values())
    labels = {m for r in p.rows for m in r.methods if not r.probe}
    stray = {m for m in labels if m != m.lower() and not any(m in ms for ms in p.tables.values())}
    assert not stray, f"{paper}: row labels not in any table: {stray}"
    assert main([paper, "--list"]) == 0
    out = capsys.readouterr().out
    for table, method, rows in p.coverage():
        assert table in out and method in out
        for r in rows:
            assert f"- {r} [" in out
