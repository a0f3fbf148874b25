"""Fed-SHVR end to end through Flower's real simulation engine (Ray backend), 3 SuperNodes."""
import json

import pytest

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e


def test_fedshvr_two_rounds_three_supernodes(sim_env):
    cfg = {"algo": "fedshvr", "num-rounds": 2, "seed": 1, "model": "mlp", "norm": "none", "lr": 0.01,
           "momentum": 0.0, "local-epochs": 1, "partition": "dirichlet", "partition-mismatch-ratio": 0.5,
           "partition-labeled-per-client": 30, "fedshvr.unlabeled-batch-size": 64}
    folder = run_simulation_inprocess(cfg, sim_env / "results", 3, "fedshvr")
    rows = read_metrics(folder)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["participants"] == 3 and r["dropped"] == [] for r in rows)
    # round 1 starts from d_k = 0; in round 2 every client applies its correction (state kept
    # in context.state across messages by the engine)
    assert rows[0]["vr-applied"] == 0 and rows[1]["vr-applied"] == 3 and rows[1]["vr-reset"] == 0
    assert rows[1]["d-norm"] > 0 and rows[1]["tau-min"] < rows[1]["tau-max"]
    assert rows[1]["accuracy"] > 0.2  # chance is 0.1
    # only the model travels, as in the paper: same bytes down and up
    assert rows[1]["bytes.weights.down"] == rows[1]["bytes.weights.up"] > 0
    part = json.loads((folder / "partition.json").read_text())
    assert part["label_mode"] == "mismatch" and abs(part["mismatch"]["mean"] - 0.5) < 0.05
    resolved = json.loads((folder / "config.json").read_text())
    assert resolved["fedshvr.alpha1"] == 0.75 and resolved["fedshvr.correction"] is True
