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
