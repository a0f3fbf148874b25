"""UM-pFSSL end to end through Flower's real simulation engine (Ray backend), 3 SuperNodes."""

import pytest

from tests.flower_harness import read_metrics, run_simulation_inprocess

pytestmark = pytest.mark.e2e


@pytest.fixture()
def sim_env(sim_env, monkeypatch):  # noqa: F811 - the conftest fixture, single-threaded
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models; Ray workers inherit it
    return sim_env


def test_umpfssl_three_supernodes(sim_env):
    cfg = {"algo": "umpfssl", "num-rounds": 2, "seed": 2, "partition": "dirichlet", "partition-alpha": 0.5,
           "test-fraction": 0.9, "model": "mlp", "norm": "none", "dropout": 0.5, "local-steps": 2,
           "umpfssl.helpers": 3, "umpfssl.replace": 1, "umpfssl.search-rounds": 1,
           "umpfssl.update-period": 2, "umpfssl.mc-samples": 2, "umpfssl.warmup-epochs": 1}
    rows = read_metrics(run_simulation_inprocess(cfg, sim_env / "results", 3, "umpfssl"))
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["participants"] == 3 and r["dropped"] == [] for r in rows)
    # round 1: warm-up uploads, fill M-1 = 2 and replace R = 1 per client (pool of 3: only 0 left)
    assert rows[0]["transfers.warmup-upload"] == 3 and rows[0]["transfers.fill"] == 6
    assert rows[0].get("transfers.replace", 0) == 0 and rows[0]["transfers.upload"] == 3
    # round 2 = nu: each client refreshes its M-1-R = 1 stale member outside the lowest R
    assert rows[1]["transfers.refresh"] == 3 and rows[1]["transfers.upload"] == 3
    for r in rows:
        # one personalised accuracy per client, by partition id; the round's accuracy is their
        # unweighted mean and client-accuracy-var their population variance (the paper's fairness)
        accs = r["client-accuracies"]
        assert r["client-ids"] == [0, 1, 2] and len(accs) == 3 and all(0.0 <= a <= 1.0 for a in accs)
        assert r["accuracy"] == pytest.approx(sum(accs) / 3, rel=1e-9)
        assert r["client-accuracy-var"] == pytest.approx(sum((a - sum(accs) / 3) ** 2 for a in accs) / 3,
                                                         rel=1e-9, abs=1e-15)
        assert r["client-accuracy-min"] == min(accs)
        assert r["bytes.own-weights.down"] > 0 and r["bytes.eval-weights.down"] > 0
    # (learning quality is not asserted: 500 training images over 3 clients and 2 steps per pass)
