"""flower_apps.report: run folders in, one markdown table and one figure out."""
import json

import pytest

from flower_apps.report import find_runs, main, markdown_table


def _write_run(folder, cfg, accs, bytes_per_round=1000, secs=2.0):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    with open(folder / "metrics.jsonl", "w") as fh:
        for i, a in enumerate(accs, start=1):
            fh.write(json.dumps({"round": i, "accuracy": a, "bytes.total": bytes_per_round,
                                 "wall-seconds": secs * i}) + "\n")
        fh.write('{"round": 9, "accur')  # torn line from a killed run: ignored


def test_table_and_figure(tmp_path, capsys):
    base = {"algo": "ssfl", "norm": "gn", "seed": 0, "run-name": "x", "results-dir": "r"}
    _write_run(tmp_path / "runs" / "a", {**base}, [0.2, 0.6, 0.5], 2_000_000, 3.0)
    _write_run(tmp_path / "runs" / "b", {**base, "norm": "bn", "run-name": "y", "ssfl.tau": 0.9}, [0.3, 0.4])
    out, fig = tmp_path / "r.md", tmp_path / "r.png"
    assert main([str(tmp_path / "runs"), "--out", str(out), "--figure", str(fig)]) == 0
    table = out.read_text()
    lines = table.strip().splitlines()
    assert lines[0] == ("| run | algo | norm | final accuracy | best accuracy (round) | rounds | bytes "
                        "| wall time |")
    assert lines[2] == "| a | ssfl | gn | 0.5000 | 0.6000 (2) | 3 | 6.0 MB | 9 s |"
    assert lines[3] == "| b | ssfl | bn | 0.4000 | 0.4000 (2) | 2 | 2.0 KB | 4 s |"
    assert fig.stat().st_size > 1000 and fig.read_bytes()[:4] == b"\x89PNG"
    assert "| a | ssfl |" in capsys.readouterr().out


def test_explicit_folders_and_errors(tmp_path):
    _write_run(tmp_path / "a", {"algo": "fedavg"}, [0.1])
    runs = find_runs([tmp_path / "a"])
    assert [r.name for r in runs] == ["a"]
    assert "| a | fedavg | 0.1000 | 0.1000 (1) | 1 | 1.0 KB | 2 s |" in markdown_table(runs)
    assert main([str(tmp_path / "missing"), "--out", "-", "--figure", ""]) == 2
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no run folders"):
        find_runs([tmp_path / "emptydir"])


def test_by_seed_mean_and_sample_std(tmp_path):
    """Runs that differ only in seed are one row: mean ± sample std (ddof 1) of the final,
    best and last-5-round accuracy; a run with another config is its own row."""
    base = {"algo": "scala", "lr": 0.01, "results-dir": "r"}
    _write_run(tmp_path / "runs" / "scala-s0", {**base, "seed": 0, "run-name": "scala-s0"}, [0.2, 0.6, 0.5])
    _write_run(tmp_path / "runs" / "scala-s1", {**base, "seed": 1, "run-name": "scala-s1"}, [0.3, 0.4, 0.7])
    _write_run(tmp_path / "runs" / "scala-s2", {**base, "seed": 2, "run-name": "scala-s2"}, [0.1, 0.5, 0.6])
    _write_run(tmp_path / "runs" / "fast-s0", {**base, "lr": 0.1, "seed": 0, "run-name": "fast-s0"}, [0.9])
    out, fig = tmp_path / "r.md", tmp_path / "r.png"
    assert main([str(tmp_path / "runs"), "--by-seed", "--out", str(out), "--figure", str(fig)]) == 0
    lines = out.read_text().strip().splitlines()
    assert lines[0].startswith("| row | algo | lr | seeds | final accuracy | best accuracy | last-5 mean |")
    # the folders are read sorted: fast-s0 first, then scala-s0..s2
    assert lines[2].startswith("| fast | scala | 0.1 | 0 | 0.900 ± 0.000 | 0.900 ± 0.000 | 0.900 ± 0.000 | 1 |")
    # finals 0.5, 0.7, 0.6: mean 0.6, sample std 0.1; bests 0.6, 0.7, 0.6: 0.633 ± 0.058;
    # 3-round means 0.4333, 0.4667, 0.4: 0.433 ± 0.033
    assert lines[3].startswith("| scala | scala | 0.01 | 0,1,2 | 0.600 ± 0.100 | 0.633 ± 0.058 | 0.433 ± 0.033 | 3 |")
    assert fig.read_bytes()[:4] == b"\x89PNG"


def test_paired_differences_seed_by_seed(tmp_path, capsys):
    """``--paired ROW``: per seed, row - ROW on the final and last-5 accuracy; mean ± sample std over
    the shared seeds, seeds ahead, and the paired t (mean / (std / sqrt n)), by hand."""
    base = {"algo": "x", "results-dir": "r"}
    for seed, (a, b) in enumerate([(0.50, 0.52), (0.60, 0.65), (0.70, 0.69)]):
        _write_run(tmp_path / "runs" / f"ref-s{seed}", {**base, "lr": 0.1, "seed": seed, "run-name": f"ref-s{seed}"}, [a])
        _write_run(tmp_path / "runs" / f"new-s{seed}", {**base, "lr": 0.2, "seed": seed, "run-name": f"new-s{seed}"}, [b])
    _write_run(tmp_path / "runs" / "lone-s7", {**base, "lr": 0.3, "seed": 7, "run-name": "lone-s7"}, [0.9])
    out = tmp_path / "r.md"
    assert main([str(tmp_path / "runs"), "--by-seed", "--paired", "ref", "--out", str(out), "--figure", ""]) == 0
    text = out.read_text()
    # differences 0.02, 0.05, -0.01: mean 0.02, sample std 0.03; t = 0.02 / (0.03 / sqrt 3) = 1.15
    assert "| new | 0,1,2 | 0.020 ± 0.030 | 0.020 ± 0.030 | 2/3 | +1.15 |" in text
    assert "| lone |  | n/a | n/a | 0/0 | n/a |" in text          # no seed in common: nothing paired
    assert main([str(tmp_path / "runs"), "--by-seed", "--paired", "nope", "--out", "-", "--figure", ""]) == 2
    assert "reference='nope' is not one of the rows" in capsys.readouterr().err
    assert main([str(tmp_path / "runs"), "--paired", "ref", "--out", "-", "--figure", ""]) == 2


def test_onset_of_the_first_confident_pseudo_labels(tmp_path):
    """``--onset``: the first round with a confident pseudo-label, its classes and main share, the
    classes 3 rounds later and the accuracy around it; a run without any shows 'none'."""
    rows = [{"round": 1, "accuracy": 0.5}, {"round": 2, "accuracy": 0.7, "pseudo-hist": [0.0, 0.0, 0.0]},
            {"round": 3, "accuracy": 0.72, "pseudo-hist": [0.0, 30.0, 10.0]}, {"round": 4, "accuracy": 0.4},
            {"round": 5, "accuracy": 0.1, "pseudo-hist": [0.0, 90.0, 0.0]},
            {"round": 6, "accuracy": 0.2, "pseudo-hist": [0.0, 99.0, 0.0]}]
    for name, rs in (("a", rows), ("b", [{"round": 1, "accuracy": 0.6}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    out = tmp_path / "r.md"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--onset", "--out", str(out), "--figure", ""]) == 0
    text = out.read_text()
    assert "| a | 3 | 2 | 1 : 0.75 | 1 | 0.700 | 0.100 | 0.200 |" in text
    assert "| b | none |  |  |  |  |  | 0.600 |" in text
    (tmp_path / "w").mkdir()   # onset in round 1 of a warm-started run: 'before' is the warm model's accuracy
    (tmp_path / "w" / "metrics.jsonl").write_text(json.dumps(
        {"round": 1, "accuracy": 0.3, "warm-accuracy": 0.8, "pseudo-hist": [5.0, 5.0]}) + "\n")
    assert main([str(tmp_path / "w"), "--onset", "--out", str(out), "--figure", ""]) == 0
    assert "| w | 1 | 2 | 0 : 0.50 | n/a | 0.800 | 0.300 | 0.300 |" in out.read_text()


def test_at_round_compares_runs_of_unequal_length(tmp_path):
    """--at-round: each run's accuracy at the rounds asked, n/a past a run's last round."""
    _write_run(tmp_path / "runs" / "long", {"algo": "umpfssl", "seed": 0}, [0.1, 0.2, 0.3, 0.4])
    _write_run(tmp_path / "runs" / "short", {"algo": "local-only", "seed": 0}, [0.15, 0.35])
    out = tmp_path / "r.md"
    assert main([str(tmp_path / "runs"), "--out", str(out), "--figure", "", "--at-round", "2", "4"]) == 0
    text = out.read_text()
    assert "| run | accuracy at round 2 | accuracy at round 4 |" in text
    assert "| long | 0.2000 | 0.4000 |" in text and "| short | 0.3500 | n/a |" in text


def test_a_key_a_run_predates_groups_at_its_default(tmp_path):
    """A run written before a run-config key existed (no such key in its config.json) is the same
    experiment as a later run with the key at its default, and another one at another value."""
    from flower_apps.report import read_run, seed_groups
    from flower_apps.simulate import fused_run_config

    defaults = fused_run_config(None)
    base = {**defaults, "algo": "fedavg", "results-dir": "r"}
    old = {k: v for k, v in base.items() if k not in ("deterministic", "max-in-flight")}
    _write_run(tmp_path / "a-s0", {**old, "seed": 0, "run-name": "a-s0"}, [0.5])
    _write_run(tmp_path / "a-s1", {**base, "seed": 1, "run-name": "a-s1"}, [0.6])
    _write_run(tmp_path / "b-s0", {**base, "max-in-flight": 3, "seed": 0, "run-name": "b-s0"}, [0.7])
    groups = seed_groups([read_run(tmp_path / n) for n in ("a-s0", "a-s1", "b-s0")])
    assert [(g.label, [r.config["seed"] for r in g.runs]) for g in groups] == [("a", [0, 1]), ("b", [0])]


def test_runs_that_differ_only_in_how_their_exchanges_travel_are_one_experiments_seeds(tmp_path):
    """The split transport (messages or the stream, which give the same weights bit for bit) and the
    waits do not make another experiment; a key that changes the training does."""
    from flower_apps.report import read_run, seed_groups, seed_table
    from flower_apps.simulate import fused_run_config

    base = {**fused_run_config(None), "algo": "semisfl", "results-dir": "r"}
    _write_run(tmp_path / "a-s0", {**base, "split-transport": "message", "wait-for-nodes": 60.0, "seed": 0,
                                   "run-name": "a-s0"}, [0.5])
    _write_run(tmp_path / "a-s1", {**base, "split-transport": "auto", "seed": 1, "run-name": "a-s1"}, [0.6])
    _write_run(tmp_path / "b-s0", {**base, "lr": 0.5, "seed": 0, "run-name": "b-s0"}, [0.7])
    groups = seed_groups([read_run(tmp_path / n) for n in ("a-s0", "a-s1", "b-s0")])
    assert [(g.label, [r.config["seed"] for r in g.runs]) for g in groups] == [("a", [0, 1]), ("b", [0])]
    # the table's columns are the keys that tell the rows apart: lr, not the transport or the seed
    head = seed_table(groups).splitlines()[0]
    assert head.startswith("| row | algo | lr | seeds |")


def test_every_round_axis_is_ticked_at_whole_rounds(monkeypatch, tmp_path):
    """A 4-round run's figures tick 1, 2, 3, 4 on the round axis, never 1.5 or 2.5: the run folder's
    curves.png (flower_apps.results) and the seed-group figure of a report."""
    from flower_apps import plotting, report, results

    figs = []
    monkeypatch.setattr(plotting, "png", lambda fig: figs.append(fig) or b"")   # the run folder's curves.png
    monkeypatch.setattr(plotting, "png", lambda fig: figs.append(fig) or b"")   # (the run folder's curves.png)
    monkeypatch.setattr(report, "_save", lambda fig, out: figs.append(fig) or out)
    run = tmp_path / "fedavg-s0"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algo": "fedavg", "seed": 0}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": k, "accuracy": 0.1 * k, "loss": 1.0 / k}) + "\n"
                                               for k in range(1, 5)))
    assert results.RunFolder(run).plot() is not None
    report.plot_seed_groups(report.seed_groups([report.read_run(run)]), tmp_path / "r.png")
    assert len(figs) == 2
    for fig in figs:
        fig.canvas.draw()
        for ax in fig.axes:
            if ax.get_xlabel() == "round":
                lo, hi = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert ticks and all(float(t).is_integer() for t in ticks), ticks
