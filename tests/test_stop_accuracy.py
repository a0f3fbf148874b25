"""Run-config ``stop-accuracy``: a time-to-target run stops after the first evaluated round whose
accuracy reaches the target, every round before it as the full run has it; a resume does not go
past it, a sweep keeps it as finished, and a results page neither pairs nor judges its final value."""
from __future__ import annotations

import json

import pytest

from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from tasks.config import ConfigError
from tests.test_system import _run


def _first_new_high(accs: list[float]) -> int:
    """The first round index (from 1) whose accuracy is above every earlier round's."""
    return next(i for i in range(1, len(accs)) if accs[i] > max(accs[:i]))


def test_a_run_stops_at_the_first_round_that_reaches_the_target_as_the_full_run_has_it(tmp_path):
    full = _run(tmp_path / "full", "fedavg", "none", rounds=5)
    accs = [r["accuracy"] for r in full]
    k = _first_new_high(accs)          # rounds 1..k+1 run; round k+1 is the first to reach accs[k]
    stopped = _run(tmp_path / "stop", "fedavg", "none", rounds=5, **{"stop-accuracy": accs[k]})
    assert len(stopped) == k + 1 < 5
    assert [r.get("stopped-at-target") for r in stopped] == [None] * k + [1]
    for a, b in zip(stopped, full):   # what happened before the stop is the full run's
        assert a["accuracy"] == b["accuracy"] and a["train-loss"] == b["train-loss"] and a["loss"] == b["loss"]
    folder = tmp_path / "stop" / "fedavg"
    assert (folder / "model.pt").exists()

    from flower_apps.papers import _finished, run_one

    assert _finished(folder, 5) and not _finished(tmp_path / "full" / "fedavg", 6)
    cfg = {**json.loads((folder / "config.json").read_text()), "resume": True}
    run_one(cfg, set(cfg), 2, "inprocess")   # a resume runs no round past the stop
    again = [json.loads(ln) for ln in (folder / "metrics.jsonl").read_text().splitlines()]
    assert again == stopped


def test_stop_accuracy_zero_runs_every_round_and_out_of_range_names_the_key(tmp_path):
    rows = _run(tmp_path, "fedavg", "none", rounds=2, **{"stop-accuracy": 0.0})
    assert len(rows) == 2 and not any("stopped-at-target" in r for r in rows)
    for bad in (-0.1, 1.5, "high"):
        with pytest.raises(ConfigError, match="stop-accuracy"):
            parse_run_config({**fused_run_config(None), "algo": "fedavg", "stop-accuracy": bad})


def test_a_page_judges_no_claim_and_pairs_no_row_whose_runs_stopped_at_the_target(tmp_path):
    from flower_apps.pages import results_page
    from flower_apps.papers import Claim, Paper, Row
    from tests.test_results_pages import _run as _fake_run

    paper = Paper(name="toy", title="Toy", base={}, supernodes=2, expected="A > B", settings="s",
                  rows=(Row("a", {"algo": "a"}, label="A"), Row("b", {"algo": "b"}, label="B")),
                  tables={"Table 1": ("A", "B")}, reference="a", claims=(Claim("A > B", "a", "b", "+10"),))
    for s in range(2):
        _fake_run(tmp_path / f"a-s{s}", "a", s, [0.5, 0.7, 0.8])
        _fake_run(tmp_path / f"b-s{s}", "b", s, [0.5, 0.85])
        with open(tmp_path / f"b-s{s}" / "metrics.jsonl", "a") as f:   # b stops at its target
            f.write(json.dumps({"round": 3, "accuracy": 0.9, "stopped-at-target": 1}) + "\n")
    text, _ = results_page(paper, tmp_path)
    assert ("| A > B | +10 | time-to-target runs of `b` (stopped at stop-accuracy): no final accuracy |  |  "
            "| not judged |") in text
    assert "| 3 (stopped at stop-accuracy) |" in text
    assert "Paired differences" in text and "\n| b | 0,1 |" not in text
