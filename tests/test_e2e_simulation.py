"""End to end through Flower's real simulation engine (Ray backend), 3 SuperNodes."""
import json

import pytest
import torch

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e


def test_fedavg_three_supernodes(sim_env):
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

    # supervised-only contacts no node: proven in process (tests/test_conformance.py, no Ray start)


def test_partial_participation_samples_the_same_partitions_whatever_the_node_ids():
    """Simulated node ids are random; sampling must follow partition ids, so runs repeat."""
    import random

    from flower_apps.client_app import dispatch
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config
    from strategies.core.round_policy import RoundPolicy
    from split_layer.transport import LocalGrid
    from tests.faulty_grid import RecordingGrid

    p = parse_run_config({**fused_run_config(None), "algo": "fedavg"})
    picked = []
    for seed in (1, 2):
        ids = random.Random(seed).sample(range(1, 1 << 60), 10)   # random ids, partition i -> ids[i]
        grid = RecordingGrid(10, dispatch, node_ids=ids)
        s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(fraction_train=0.3, min_nodes=2))
        parts = []
        for rnd in (1, 2, 3):
            nodes = s.sample_nodes(grid, rnd)
            parts.append(sorted(grid.contexts[n].node_config["partition-id"] for n in nodes))
        picked.append(parts)
        asked = [m for m in grid.sent if m.metadata.message_type == "query.node_info"]
        assert len(asked) == 10  # each node asked once, not every round
    assert picked[0] == picked[1] and all(len(x) == 3 for x in picked[0])
    assert len({tuple(x) for x in picked[0]}) > 1  # rounds still differ

    # a ClientApp that does not answer node-info: sampling still works (node-id order), no drop
    grid = LocalGrid(4, lambda m, c: (_ for _ in ()).throw(RuntimeError("no such op")))
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(fraction_train=0.5, min_nodes=2))
    assert len(s.sample_nodes(grid, 1)) == 2 and s.dropped == []
