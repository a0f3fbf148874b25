"""Semi-SFL end to end through Flower's simulation engine (3 SuperNodes), and its
no-clustering ablation through the same runtime in-process (LocalGrid, no Ray)."""
import math

import pytest

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e

SMALL = {"server-labels": 100, "batch-size": 8, "seed": 1, "partition": "dirichlet", "partition-alpha": 0.1,
         "semisfl.k-s": 3, "semisfl.k-u": 2, "semisfl.labeled-batch-size": 16, "semisfl.proj-dim": 16,
         "semisfl.proj-hidden": 64, "semisfl.tau": 0.5}


def test_semisfl_three_supernodes(sim_env):
    folder = run_simulation_inprocess({**SMALL, "algo": "semisfl", "num-rounds": 2}, sim_env / "results", 3,
                                      "semisfl")
    rows = read_metrics(folder)
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert r["participants"] == 3 and r["dropped"] == [] and r["cross-iterations"] == 2
        assert r["ks"] == 3 and 0 <= r["mask-rate"] <= 1
        assert "pseudo-label-accuracy" not in r and "impurity" not in r  # no node consented (the default)
        assert 0 <= r["teacher-accuracy"] <= 1 and 0 <= r["student-accuracy"] <= 1
        assert r["accuracy"] == r["teacher-accuracy"]  # the run's result is the global teacher
        assert math.isfinite(r["sup-loss"]) and r["sup-supcon"] > 0 and math.isfinite(r["unsup-cluster"])
        # per node and step: student + teacher features up (8 x 64x4x4 float32 each), one gradient down
        feat = 8 * 64 * 4 * 4 * 4
        assert r["bytes.activations.up"] == 3 * 2 * 2 * feat
        assert r["bytes.gradients.down"] == 3 * 2 * feat
        assert r["bytes.teacher-weights.down"] == r["bytes.weights.down"] == r["bytes.weights.up"] > 0
        assert r["bytes.metrics.down"] == 3 * 2 * 8 * 3  # pseudo-labels (int16) + mask (uint8) for the nodes' counts
        assert "bytes.labels.up" not in r and "bytes.metrics.up" not in r  # no label leaves a node
    assert rows[1]["queue-size"] > rows[0]["queue-size"] > 0


def test_no_cluster_variant_in_process():
    from flower_apps.client_app import dispatch
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config
    from strategies.core.round_policy import RoundPolicy
    from split_layer.transport import LocalGrid

    cfg = {**fused_run_config(None), **SMALL, "algo": "semisfl-no-cluster", "semisfl.hidden-label-metrics": False,
           "semisfl.k-u": 1, "device": "cpu"}
    p = parse_run_config(cfg)
    assert not p.algo.clustering and not p.algo.supcon and not p.algo.adaptive_ks
    grid = LocalGrid(2, dispatch, run_config=cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60))
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(m))
    (m,) = rows
    assert m["participants"] == 2 and m["sup-supcon"] == 0 and m["unsup-cluster"] == 0
    assert m["queue-size"] == 0 and "impurity" not in m and "bytes.metrics.down" not in m
    # no label histogram is asked (Semi-SFL does not use one) and none is sent
    assert "bytes.histogram.up" not in m and all("hist" not in e for e in s.directory.values())
