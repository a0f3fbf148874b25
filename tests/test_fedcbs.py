"""Fed-CBS (strategies/scala/fedcbs.py, tasks/client_sampling.py): QCID and the sequential sampling
probabilities against hand computations, balanced sets preferred, seeded and resumable
sampling through the real ClientApp dispatch. The conformance matrix runs ``fedcbs`` under every
condition (tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest

from tasks.client_sampling import QCID_FLOOR, cbs_sample, cbs_step_probabilities, qcid, qcid_inner
from tasks.config import ConfigError

# four clients, two classes (no pair and no triple is exactly balanced, so no QCID is floored)
C4 = np.array([[5, 0], [0, 3], [3, 1], [2, 1]])


def test_qcid_both_forms_match_a_hand_computation():
    """Two clients, three classes: counts (6, 2, 0) and (0, 2, 2)."""
    counts = np.array([[6, 2, 0], [0, 2, 2]])
    # pooled (6, 4, 2) / 12 = (1/2, 1/3, 1/6): (1/6)^2 + 0 + (1/6)^2 = 1/18
    assert qcid(counts) == pytest.approx(1 / 18, rel=1e-12)
    # (3/4, 1/4, 0) - 1/3 = (5/12, -1/12, -1/3): (25 + 1 + 16) / 144 = 7/24;  (0, 1/2, 1/2): 1/9 + 2/36 = 1/6
    assert qcid(counts, [0]) == pytest.approx(7 / 24, rel=1e-12)
    assert qcid(counts, [1]) == pytest.approx(1 / 6, rel=1e-12)
    # the inner-product form: n = (8, 4), <a0,a0> = 5/8, <a1,a1> = 1/2, <a0,a1> = 1/8:
    # (64 * 5/8 + 16 * 1/2 + 2 * 32 * 1/8) / 144 - 1/3 = 56/144 - 48/144 = 1/18
    alphas = counts / counts.sum(1, keepdims=True)
    assert qcid_inner([8, 4], alphas) == pytest.approx(1 / 18, rel=1e-12)
    rng = np.random.default_rng(0)   # and on random histograms, the two forms agree
    for _ in range(20):
        c = rng.integers(0, 9, size=(4, 5)) + np.eye(4, 5, dtype=int)
        sub = [0, 2, 3]
        assert qcid(c, sub) == pytest.approx(qcid_inner(c[sub].sum(1), c[sub] / c[sub].sum(1, keepdims=True)),
                                             abs=1e-12)
    assert qcid(np.array([[2, 2], [1, 1]])) == 0.0      # balanced: 0 (floored in the probabilities)


def test_first_pick_probabilities_by_hand():
    """P_1(n) ~ 1/QCID({n}) + lambda sqrt(3 ln(t+1) / (2 T_n)). Singletons (M = 2: 2 (p_0 - 1/2)^2):
    (5,0) and (0,3): 1/2; (3,1): 1/8; (2,1): 1/18, so 1/QCID = 2, 2, 8, 18."""
    p = cbs_step_probabilities(C4, [], t=0, selections=[1, 1, 1, 1], lam=10.0)   # round 1: ln 1 = 0
    np.testing.assert_allclose(p, np.array([2, 2, 8, 18]) / 30, rtol=1e-12)
    # t = 1 (round 2), T = (1, 2, 1, 4): the bonus 10 sqrt(3 ln 2 / (2 T_n)) favours the rarely chosen
    bonus = [10 * math.sqrt(1.5 * math.log(2) / T) for T in (1, 2, 1, 4)]   # 10.197, 7.210, 10.197, 5.098
    s = np.array([2, 2, 8, 18]) + np.array(bonus)
    p = cbs_step_probabilities(C4, [], t=1, selections=[1, 2, 1, 4], lam=10.0)
    np.testing.assert_allclose(p, s / s.sum(), rtol=1e-12)
    assert p[0] > p[1]    # same QCID, chosen less often


def test_second_and_third_pick_probabilities_by_hand():
    """P_2(n) ~ QCID({c1, n})^-2 / P_1(n) and P_3(n) ~ QCID(S_2)^2 / QCID(S_2 + {n})^3, c1 = client 0."""
    # {0,1}: (5,3)/8 -> 2 (1/8)^2 = 1/32; {0,2}: (8,1)/9 -> 2 (7/18)^2 = 49/162; {0,3}: (7,1)/8 -> 2 (3/8)^2 = 9/32
    p1 = np.array([2, 2, 8, 18]) / 30
    s = np.array([0.0, 32 ** 2 / p1[1], (162 / 49) ** 2 / p1[2], (32 / 9) ** 2 / p1[3]])
    p = cbs_step_probabilities(C4, [0], t=0, selections=[1, 1, 1, 1], lam=10.0)
    np.testing.assert_allclose(p, s / s.sum(), rtol=1e-12)
    assert p[0] == 0.0 and p[1] > 0.99    # the client of the missing class balances the set
    # S_2 = {0, 1} (QCID 1/32): {0,1,2}: (8,4)/12 -> 2 (1/6)^2 = 1/18; {0,1,3}: (7,4)/11 -> 2 (3/22)^2 = 9/242
    s = np.array([0.0, 0.0, (1 / 32) ** 2 / (1 / 18) ** 3, (1 / 32) ** 2 / (9 / 242) ** 3])
    p = cbs_step_probabilities(C4, [0, 1], t=0, selections=[1, 1, 1, 1], lam=10.0)
    np.testing.assert_allclose(p, s / s.sum(), rtol=1e-12)
    # a set that is exactly balanced has QCID 0: floored, it takes (almost) all the mass, no overflow
    p = cbs_step_probabilities(np.array([[4, 0], [0, 4], [3, 1]]), [0], t=0, selections=[1, 1, 1], lam=10.0)
    assert p[1] == pytest.approx(1.0) and np.isfinite(p).all() and QCID_FLOOR > 0


def test_balanced_sets_are_preferred_in_expectation():
    """Four clients, one of them the only holder of class 1: uniform sampling of 2 includes it with
    probability 1/2; Fed-CBS with 1/4 + 3/4 * 1024/1032 (first pick uniform, all singletons have
    QCID 1/2; then (10,6) has QCID 1/32 against 1/2 for (20,0)), and over 4000 draws it does."""
    counts = np.array([[10, 0], [0, 6], [10, 0], [10, 0]])
    want = 0.25 + 0.75 * 1024 / (1024 + 4 + 4)
    rng = np.random.default_rng(7)
    hits = sum(1 in cbs_sample(counts, 2, 0, [1] * 4, 10.0, rng) for _ in range(4000))
    assert hits / 4000 == pytest.approx(want, abs=0.01)
    assert hits / 4000 > 0.9   # uniform: 0.5


def test_draws_are_distinct_and_reproducible():
    rng = lambda s: np.random.default_rng(s)  # noqa: E731
    c = np.random.default_rng(3).integers(1, 9, size=(10, 4))
    a, b = cbs_sample(c, 6, 2, [1] * 10, 10.0, rng(5)), cbs_sample(c, 6, 2, [1] * 10, 10.0, rng(5))
    assert a == b and len(set(a)) == 6
    assert any(cbs_sample(c, 6, 2, [1] * 10, 10.0, rng(s)) != a for s in range(6, 12))


# ---------------------------------------------------------------------------- through the ClientApp
def _quantity(**over):
    from tests.test_conformance import build

    return build("fedcbs", fraction=0.5, nodes=over.pop("nodes", 6), grid_kw=over.pop("grid_kw", None),
                 partition="quantity", **{"partition-classes-per-client": 2}, **over)


def _record_samples(s) -> dict[int, list[int]]:
    """Wrap ``s.sample_nodes``: round -> the partitions it chose."""
    out: dict[int, list[int]] = {}
    inner = s.sample_nodes

    def spy(grid, rnd):
        chosen = inner(grid, rnd)
        out[rnd] = sorted(s.partition_of[n] for n in chosen)
        return chosen

    s.sample_nodes = spy
    return out


def test_sampling_is_seeded_by_partition_and_varies_over_rounds():
    """The same seed chooses the same partitions whatever the node ids; other rounds choose other
    sets; each node is asked for its histogram once, and its bytes are counted."""
    from strategies.core.records import action_of

    s1, g1 = _quantity()
    seen1 = _record_samples(s1)
    rows: list[dict] = []
    s1.start(g1, num_rounds=4, on_round_end=lambda r, m: rows.append(dict(m)))
    s2, g2 = _quantity(grid_kw={"node_ids": [9000 - 7 * i for i in range(6)]})
    seen2 = _record_samples(s2)
    s2.start(g2, num_rounds=4)
    assert seen1 == seen2
    assert all(len(v) == 3 for v in seen1.values())
    assert len({tuple(v) for v in seen1.values()}) > 1, seen1
    queries = [m for m in g1.sent if action_of(m) == "label-histogram"]
    assert sorted(m.metadata.dst_node_id for m in queries) == sorted(g1.get_node_ids())   # once per node
    assert rows[0]["bytes.histogram.up"] == 6 * 8 * s1.env.num_classes   # 6 nodes, float64 [M]
    assert all("bytes.histogram.up" not in r for r in rows[1:])
    assert all(0.0 <= r["sampled-qcid"] <= 1.0 for r in rows)
    assert sum(s1.selections.values()) == 4 * 3


def test_sampled_sets_are_more_balanced_than_uniform():
    """Quantity skew, 2 classes per client: the mean QCID of Fed-CBS's sets over 40 rounds is below
    that of the seeded uniform sampler over the same rounds (lambda = 0: QCID alone)."""
    import random

    from tasks.training import derive_seed

    s, grid = _quantity(nodes=10, **{"fedcbs.ucb-lambda": 0.0, "num-rounds": 40})
    s.setup(grid)
    s.learn_histograms(grid, sorted(grid.get_node_ids()), 1)
    nodes = sorted(grid.get_node_ids(), key=lambda n: s.partition_of[n])
    counts = {n: s.histogram_of(n) for n in nodes}
    cbs, uni = [], []
    for rnd in range(1, 41):
        chosen = s.sample_nodes(grid, rnd)
        cbs.append(qcid(np.stack([counts[n] for n in chosen])))
        pick = random.Random(derive_seed(s.task.seed, "sample", rnd)).sample(nodes, len(chosen))
        uni.append(qcid(np.stack([counts[n] for n in pick])))
    assert np.mean(cbs) < 0.7 * np.mean(uni), (np.mean(cbs), np.mean(uni))


def test_resume_restores_the_selection_counts_and_draws():
    """Rounds 1-3 uninterrupted against round 1, checkpoint, a new strategy on new nodes, rounds
    2-3: the same partitions each round (T_n from the checkpoint) and the same weights (the
    probabilities' dependence on T_n: test_first_pick_probabilities_by_hand)."""
    s, g = _quantity(**{"fedcbs.ucb-lambda": 100.0})   # a large lambda: T_n matters
    full = _record_samples(s)
    res = s.start(g, num_rounds=3)
    s1, g1 = _quantity(**{"fedcbs.ucb-lambda": 100.0})
    ck = {}

    class Crash(Exception):
        pass

    def crash(rnd, metrics):
        ck["state"] = copy.deepcopy(s1.state_dict())
        raise Crash

    with pytest.raises(Crash):
        s1.start(g1, num_rounds=3, on_round_end=crash)
    assert ck["state"]["extra"]["selections"] and sum(ck["state"]["extra"]["selections"].values()) == 3
    s2, g2 = _quantity(**{"fedcbs.ucb-lambda": 100.0})
    s2.setup(g2)
    s2.load_state_dict(ck["state"])
    resumed = _record_samples(s2)
    res2 = s2.start(g2, num_rounds=3, start_round=2)
    assert resumed == {r: full[r] for r in (2, 3)}
    for k in res.arrays.keys():
        np.testing.assert_allclose(res2.arrays[k].numpy(), res.arrays[k].numpy(), rtol=0, atol=1e-6, err_msg=k)
    # T_n went on from the checkpoint: the counts after round 3 are the uninterrupted run's
    assert s2.selections == s.selections and sum(s.selections.values()) == 9


def test_a_node_without_a_histogram_is_sampled_only_to_fill(caplog):
    """One node fails the histogram query: it is logged, never chosen while enough nodes have a
    histogram; when too few do, the round fills up uniformly, with a warning."""
    from strategies.core.records import action_of
    from tests.faulty_grid import inject_failures

    s, grid = _quantity()
    victim = sorted(grid.get_node_ids())[2]
    inject_failures(grid, lambda msg, ctx: ctx.node_id == victim and action_of(msg) == "label-histogram")
    rows: list[dict] = []
    with caplog.at_level(logging.WARNING):
        s.start(grid, num_rounds=4, on_round_end=lambda r, m: rows.append(dict(m)))
    assert "gave no label histogram" in caplog.text
    assert all(r["participants"] == 3 for r in rows)
    assert rows[0]["dropped"] == [victim] and all(r["dropped"] == [] for r in rows[1:])   # (it failed the query)
    assert s.histogram_of(victim) is None
    assert all(victim not in s.sample_nodes(grid, rnd) for rnd in range(5, 15))

    s, grid = _quantity()
    s.setup(grid)
    bad = set(sorted(grid.get_node_ids())[:4])   # 2 of 6 answer, 3 are needed
    inject_failures(grid, lambda msg, ctx: ctx.node_id in bad and action_of(msg) == "label-histogram")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        chosen = s.sample_nodes(grid, 1)
    assert len(chosen) == 3 and "drawn uniformly" in caplog.text
    assert set(grid.get_node_ids()) - bad <= set(chosen)


def test_bad_lambda_is_a_config_error_naming_the_key():
    from flower_apps.config import parse_run_config
    from strategies.scala.fedcbs import FedCBSStrategy
    from tests.test_conformance import config

    with pytest.raises(ConfigError, match="ucb-lambda"):
        parse_run_config(config("fedcbs", **{"fedcbs.ucb-lambda": -1.0}))
    with pytest.raises(ConfigError, match="ucb_lambda|ucb-lambda"):
        FedCBSStrategy(ucb_lambda=-1.0)
    assert FedCBSStrategy().cfg.ucb_lambda == 10.0
