"""Tests for tasks/aggregate.py on hand-made states and a deterministic quadratic toy."""
from __future__ import annotations

import numpy as np
import pytest

from tasks.aggregate import (
    contiguous_groups,
    fednova_aggregate,
    grouped_average,
    mean_including_server,
    personalized_weighted,
    state_delta,
    vr_correction_update,
    weight_diversity,
    weighted_mean,
)


def _state(v, nbt=0, dtype=np.float32):
    return {
        "w": np.full((2, 3), v, dtype=dtype),
        "b": np.array([v, -v], dtype=dtype),
        "bn.running_mean": np.array([10 * v], dtype=dtype),
        "bn.num_batches_tracked": np.array(nbt, dtype=np.int64),
    }


# ---------------------------------------------------------------------------
# FedAvg family
# ---------------------------------------------------------------------------
def test_weighted_mean_normalises_and_handles_dtypes():
    states = [_state(1.0, 10), _state(2.0, 20), _state(4.0, 31)]
    out = weighted_mean(states, [1, 1, 2])
    np.testing.assert_allclose(out["w"], np.full((2, 3), (1 + 2 + 8) / 4))
    assert out["w"].dtype == np.float32
    assert out["bn.num_batches_tracked"].dtype == np.int64
    assert int(out["bn.num_batches_tracked"]) == round((10 + 20 + 62) / 4)  # 23
    # uniform by default; keys subset leaves the rest out
    out2 = weighted_mean(states, keys=["w", "b"])
    assert set(out2) == {"w", "b"}
    np.testing.assert_allclose(out2["b"], [7 / 3, -7 / 3], rtol=1e-6)
    # lists in, list out
    lst = weighted_mean([[np.ones(2), np.zeros(1)], [3 * np.ones(2), np.ones(1)]], [3, 1])
    assert isinstance(lst, list)
    np.testing.assert_allclose(lst[0], [1.5, 1.5])
    np.testing.assert_allclose(lst[1], [0.25])
    with pytest.raises(ValueError):
        weighted_mean(states, [0, 0, 0])
    with pytest.raises(ValueError):
        weighted_mean(states, [1, -1, 1])


def test_personalized_weighted_is_corr_weighted():
    states = [_state(1.0), _state(3.0), _state(-2.0)]
    corr = [2.5, 0.5, 1.0]
    out = personalized_weighted(states, corr)
    expected = (2.5 * 1 + 0.5 * 3 - 1.0 * 2) / 4.0
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)


def test_mean_including_server_eq5():
    server = _state(0.0, 5)
    clients = [_state(1.0, 100), _state(2.0, 100), _state(6.0, 100)]
    out = mean_including_server(server, clients)
    np.testing.assert_allclose(out["w"], (0 + 1 + 2 + 6) / 4)
    # parameters only: BN buffers keep the server's labeled-data statistics
    out_p = mean_including_server(server, clients, keys=["w", "b"])
    np.testing.assert_allclose(out_p["b"], [9 / 4, -9 / 4])
    np.testing.assert_array_equal(out_p["bn.running_mean"], server["bn.running_mean"])
    assert int(out_p["bn.num_batches_tracked"]) == 5


def test_grouped_average_eq6_hand_made():
    server = {"w": np.array([0.0, 0.0])}
    clients = [{"w": np.array([1.0, 0.0])}, {"w": np.array([2.0, 0.0])},
               {"w": np.array([3.0, 3.0])}, {"w": np.array([4.0, 3.0])}]
    server_avg, per_group = grouped_average(server, clients, [[0, 1], [2, 3]])
    np.testing.assert_allclose(per_group[0]["w"], [1.0, 0.0])         # (0+1+2)/3
    np.testing.assert_allclose(per_group[1]["w"], [7 / 3, 2.0])       # (0+3+4)/3, (0+3+3)/3
    np.testing.assert_allclose(server_avg["w"], [(1 + 7 / 3) / 2, 1.0])
    # differs from plain Eq. 5 FedAvg including the server: (0+1+2+3+4)/5 = 2
    assert not np.allclose(server_avg["w"], mean_including_server(server, clients)["w"])
    # a single group is Eq. 5
    s1, _ = grouped_average(server, clients, [[0, 1, 2, 3]])
    np.testing.assert_allclose(s1["w"], mean_including_server(server, clients)["w"])
    # dict of client id -> state; empty group contributes w_s
    by_id = {10 + i: c for i, c in enumerate(clients)}
    s2, g2 = grouped_average(server, by_id, [[10, 11], []])
    np.testing.assert_allclose(g2[1]["w"], server["w"])
    np.testing.assert_allclose(s2["w"], [0.5, 0.0])


def test_contiguous_groups():
    assert contiguous_groups([5, 3, 1, 2, 4], 2) == [[1, 2, 3], [4, 5]]
    assert contiguous_groups(range(10), 5) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert contiguous_groups(range(47), 5)[0] == list(range(10))
    assert sum(len(g) for g in contiguous_groups(range(47), 5)) == 47
    assert contiguous_groups([0, 1], 3) == [[0], [1], []]


# ---------------------------------------------------------------------------
# weight diversity
# ---------------------------------------------------------------------------
def test_weight_diversity():
    u = {"fc": np.array([1.0, 2.0, -1.0])}
    K = 4
    assert weight_diversity([u] * K) == pytest.approx(1 / K)
    assert weight_diversity([u] * K, times_k=True) == pytest.approx(1.0)
    eye = np.eye(K) * 3.0
    ortho = [{"fc": eye[i]} for i in range(K)]
    assert weight_diversity(ortho) == pytest.approx(1.0)
    assert weight_diversity(ortho, times_k=True) == pytest.approx(K)
    # hand value: u1 = (1, 0), u2 = (1, 1): (1 + 2) / |(2, 1)|^2 = 3/5
    assert weight_diversity([{"a": np.array([1.0, 0.0])}, {"a": np.array([1.0, 1.0])}]) == pytest.approx(0.6)
    # key subset (classifier layer only)
    ups = [{"fc": np.array([1.0, 0.0]), "conv": np.array([5.0])}, {"fc": np.array([0.0, 1.0]), "conv": np.array([5.0])}]
    assert weight_diversity(ups, keys=["fc"]) == pytest.approx(1.0)
    assert weight_diversity([{"a": np.array([1.0])}, {"a": np.array([-1.0])}]) == float("inf")
    # from states via state_delta
    prev = {"fc": np.zeros(2)}
    d = [state_delta({"fc": np.array([2.0, 0.0])}, prev), state_delta({"fc": np.array([0.0, 2.0])}, prev)]
    assert weight_diversity(d) == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# FedNova + correction
# ---------------------------------------------------------------------------
def test_fednova_equal_taus_is_weighted_fedavg():
    rng = np.random.default_rng(0)
    prev = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2)}
    clients = [{k: v + rng.normal(size=v.shape) for k, v in prev.items()} for _ in range(4)]
    omegas = np.array([1.0, 2.0, 3.0, 4.0])
    new = fednova_aggregate(prev, clients, taus=[7, 7, 7, 7], omegas=omegas)
    avg = weighted_mean(clients, omegas)
    for k in prev:
        np.testing.assert_allclose(new[k], avg[k], rtol=1e-12, atol=1e-12)


def test_fednova_heterogeneous_hand_formula_and_identity():
    prev = {"w": np.array([1.0, -1.0]), "rm": np.array([0.0]), "nbt": np.array(4, dtype=np.int64)}
    c1 = {"w": np.array([0.0, 0.0]), "rm": np.array([2.0]), "nbt": np.array(10, dtype=np.int64)}
    c2 = {"w": np.array([3.0, 1.0]), "rm": np.array([4.0]), "nbt": np.array(20, dtype=np.int64)}
    om, taus = np.array([0.25, 0.75]), np.array([2.0, 8.0])
    tau = 0.25 * 2 + 0.75 * 8  # 6.5
    new = fednova_aggregate(prev, [c1, c2], taus, om, mean_keys=["rm", "nbt"])
    expected_w = prev["w"] - tau * (0.25 * (prev["w"] - c1["w"]) / 2 + 0.75 * (prev["w"] - c2["w"]) / 8)
    np.testing.assert_allclose(new["w"], expected_w)
    np.testing.assert_allclose(new["rm"], [0.25 * 2 + 0.75 * 4])   # plain omega-weighted mean
    assert int(new["nbt"]) == round(0.25 * 10 + 0.75 * 20)
    # unnormalised omegas give the same answer
    new2 = fednova_aggregate(prev, [c1, c2], taus, [1, 3], mean_keys=["rm", "nbt"])
    np.testing.assert_allclose(new2["w"], new["w"])
    # round 1: clients still hold theta^0 -> theta^1 = theta^0
    same = fednova_aggregate(prev, [prev, prev], taus, om)
    np.testing.assert_allclose(same["w"], prev["w"])


def test_vr_corrections_sum_to_zero():
    rng = np.random.default_rng(1)
    K = 5
    omegas = rng.uniform(0.5, 2.0, size=K)
    omegas = omegas / omegas.sum()
    taus = rng.integers(3, 40, size=K).astype(float)
    tau = float(np.sum(omegas * taus))
    lr = 0.01
    prev = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}
    d = [None] * K
    for _ in range(3):  # several rounds, starting from d = 0
        clients = [{k: v + rng.normal(size=v.shape) * 0.1 for k, v in prev.items()} for _ in range(K)]
        new = fednova_aggregate(prev, clients, taus, omegas)
        d = [vr_correction_update(d[k], prev, clients[k], new, taus[k], tau, lr) for k in range(K)]
        for key in prev:
            total = sum(omegas[k] * d[k][key] for k in range(K))
            scale = max(np.abs(d[k][key]).max() for k in range(K))
            assert np.abs(total).max() <= 1e-12 * scale
        prev = new
    assert max(np.abs(d[k]["w"]).max() for k in range(K)) > 1.0  # non-trivial corrections
    # plain averaging instead of FedNova breaks the invariant (heterogeneous taus)
    clients = [{k: v + rng.normal(size=v.shape) * 0.1 for k, v in prev.items()} for _ in range(K)]
    avg = weighted_mean(clients, omegas)
    dd = [vr_correction_update(None, prev, clients[k], avg, taus[k], tau, lr) for k in range(K)]
    assert np.abs(sum(omegas[k] * dd[k]["w"] for k in range(K))).max() > 1e-3


def _quadratic_toy(server: str, correction: bool, rounds: int = 300, d_sign: float = -1.0):
    """f_k(x) = 0.5 a_k ||x - b_k||^2, full-batch local SGD with tau_k steps."""
    rng = np.random.default_rng(0)
    a = np.array([1.0, 2.0, 4.0])
    b = rng.normal(size=(3, 2)) * 3.0
    taus = np.array([2, 5, 10])
    omegas = np.array([0.2, 0.3, 0.5])
    eta = 0.1
    x_star = (omegas[:, None] * a[:, None] * b).sum(0) / (omegas * a).sum()
    tau = float(np.sum(omegas * taus))
    prev = {"x": np.zeros(2)}
    uploads = [{"x": prev["x"].copy()} for _ in range(3)]  # theta_k^{0,tau_k} = theta^0
    d = [None] * 3
    for _ in range(rounds):
        if server == "fednova":
            new = fednova_aggregate(prev, uploads, taus, omegas)
        else:
            new = weighted_mean(uploads, omegas)
        if correction:
            d = [vr_correction_update(d[k], prev, uploads[k], new, taus[k], tau, eta) for k in range(3)]
        for k in range(3):
            x = new["x"].copy()
            dk = d[k]["x"] if d[k] is not None else 0.0
            for _ in range(taus[k]):
                x = x - eta * (a[k] * (x - b[k]) + d_sign * dk)  # the local step: theta -= eta (g - d_k)
            uploads[k] = {"x": x}
        prev = new
    return float(np.linalg.norm(prev["x"] - x_star))


def test_quadratic_toy_fednova_with_correction_is_unbiased():
    assert _quadratic_toy("fednova", True) < 1e-9
    # every ablation keeps a clear residual bias
    assert _quadratic_toy("fedavg", False) > 1e-2
    assert _quadratic_toy("fednova", False) > 1e-2
    assert _quadratic_toy("fedavg", True) > 1e-2
    # the [D] sign of the local step matters: theta -= eta (g + d_k) diverges
    assert not _quadratic_toy("fednova", True, rounds=60, d_sign=+1.0) < 1.0
