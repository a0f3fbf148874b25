"""SSFL end to end through Flower's simulation engine: 3 SuperNodes, 2 rounds, BN + grouping."""
import json

import pytest
import torch

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e


def test_ssfl_grouping_bn_three_supernodes(sim_env):
    cfg = {"algo": "ssfl", "num-rounds": 2, "local-steps": 3, "batch-size": 16, "server-labels": 60,
           "partition": "ssfl-r", "model": "mlp", "norm": "bn", "ssfl.groups": 2, "ssfl.tau": 0.5, "seed": 3}
    folder = run_simulation_inprocess(cfg, sim_env / "results", 3, "ssfl")
    rows = read_metrics(folder)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["participants"] == 3 and r["dropped"] == [] and r["period"] == 3 for r in rows)
    # only trainable parameters travel (BN buffers stay on the nodes): 4 bytes per parameter
    # (+ a small .npy header per array), well below the full state with its running stats
    state = torch.load(folder / "model.pt")
    buffers = [k for k in state if "running" in k or "num_batches" in k]
    assert buffers
    n_params = sum(v.numel() for k, v in state.items() if k not in buffers)
    n_buffer_bytes = sum(state[k].numel() * state[k].element_size() for k in buffers)
    for r in rows:
        assert r["bytes.weights.up"] == r["bytes.weights.down"]
        assert 3 * 4 * n_params <= r["bytes.weights.up"] < 3 * (4 * n_params + n_buffer_bytes)
        assert 0.0 <= r["mask-rate"] <= 1.0 and r["server-train-loss"] > 0
        assert r["accuracy"] > 0.15  # server labels alone lift it above chance
    # tau = 0.5: the users keep pseudo-labels by round 2, so their updates differ and are measured
    assert rows[-1]["mask-rate"] > 0 and rows[-1]["weight-diversity"] > 0, rows[-1]
    cfg_out = json.loads((folder / "config.json").read_text())
    assert cfg_out["ssfl.groups"] == 2 and cfg_out["algo"] == "ssfl"
