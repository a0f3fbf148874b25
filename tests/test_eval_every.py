"""Run-config ``eval-every``: the server evaluates the global model every that many rounds and
always after the last one; skipping an evaluation changes nothing that is trained."""
from __future__ import annotations

import pytest

from tasks.config import ConfigError
from tests.test_system import _run


@pytest.mark.parametrize("algo", ["fedavg", "semisfl"])
def test_eval_every_evaluates_every_nth_and_the_last_round_and_trains_the_same(tmp_path, algo):
    small = {"semisfl.k-s": 2, "semisfl.k-u": 2} if algo == "semisfl" else {}   # (a few steps a round)
    every = _run(tmp_path / "a", algo, "none", rounds=4, **small)
    sparse = _run(tmp_path / "b", algo, "none", rounds=4, **small, **{"eval-every": 3})
    assert all("accuracy" in r for r in every)
    assert ["accuracy" in r for r in sparse] == [False, False, True, True]
    for r in (2, 3):   # rounds 3 and 4: the same model, the same test accuracy and loss
        assert sparse[r]["accuracy"] == every[r]["accuracy"] and sparse[r]["loss"] == every[r]["loss"]
    assert [r["train-loss"] for r in sparse if "train-loss" in r] == [r["train-loss"] for r in every if "train-loss" in r]


def test_eval_every_below_one_names_the_key():
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config

    with pytest.raises(ConfigError, match="eval-every"):
        parse_run_config({**fused_run_config(None), "algo": "fedavg", "eval-every": 0})
