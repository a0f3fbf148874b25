"""End to end through Flower's real simulation engine (Ray backend), 3 SuperNodes."""
import json

import pytest
import torch

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e


def test_fedavg_and_supervised_only_three_supernodes(sim_env):
    base = {"num-rounds": 2, "local-steps": 15, "server-labels": 200, "seed": 1}
    folder = run_simulation_inprocess({**base, "algo": "fedavg"}, sim_env / "results", 3, "fedavg")
    rows = read_metrics(folder)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["participants"] == 3 and r["dropped"] == [] for r in rows)
    assert rows[-1]["accuracy"] > 0.5  # 2 rounds of 3 x 15 steps on MNIST-5k: well above chance
    # bytes: every round sends the whole state dict to 3 nodes and gets 3 back
    state = torch.load(folder / "model.pt")
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert rows[0]["bytes.weights.down"] == rows[0]["bytes.weights.up"] == 3 * model_bytes
    for name in ("config.json", "metrics.jsonl", "checkpoint.pt", "model.pt", "curves.png", "partition.json"):
        assert (folder / name).stat().st_size > 0, name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["algo"] == "fedavg" and cfg["local-steps"] == 15 and cfg["dataset"] == "mnist5k"

    folder2 = run_simulation_inprocess({**base, "algo": "supervised-only"}, sim_env / "results", 3, "sup")
    rows2 = read_metrics(folder2)
    assert rows2[-1]["bytes.total"] == 0 and rows2[-1]["accuracy"] > 0.3
