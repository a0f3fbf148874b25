"""Tests for tasks/partition/ (partitioners, labeled/unlabeled splits, make_plan)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
from datasets import ClassLabel, Dataset, Features, Value

from tasks.partition import (
    CONFIG_KEYS,
    LABEL_MODES,
    SCHEMES,
    ClassDirichletPartitioner,
    IidSplitPartitioner,
    MainClassPartitioner,
    PartitionConfig,
    QuantitySkewPartitioner,
    class_histograms,
    dir2_labeled_split,
    dirichlet_partition,
    iid_partition,
    main_class_partition,
    make_plan,
    matched_test_split,
    mismatch_partition,
    plan_summary,
    quantity_skew_partition,
    r_metric,
    server_labeled_split,
)

C = 10
MNIST5K = np.repeat(np.arange(C), 400)      # MNIST-5k train after the 20% hold-out
MNIST_LIKE = np.repeat(np.arange(C), 500)   # balanced, 500 per class
TEST = np.repeat(np.arange(C), 100)


def _shuffled(labels: np.ndarray, seed: int = 123) -> np.ndarray:
    """Labels in a random order, so index bookkeeping mistakes cannot hide."""
    return np.random.default_rng(seed).permutation(labels)


def _assert_disjoint_cover(parts, n, cover=True):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "partitions overlap"
    assert allidx.min() >= 0 and allidx.max() < n
    if cover:
        assert len(allidx) == n, "not every sample assigned"
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices not sorted"


# ------------------------------------------------------------------------------ R metric
def test_r_metric_extremes_and_hand_computed():
    assert r_metric(np.eye(4)) == pytest.approx(1.0, abs=1e-12)
    assert r_metric(np.full((5, 3), 1 / 3)) == pytest.approx(0.0, abs=1e-12)
    # Hand computed: P1=(1,0), P2=(0.5,0.5), P3=(0,1): L1 distances 1, 2, 1 -> sum 4;
    # R = 4 / (3 * 2) = 2/3.
    p = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    assert r_metric(p) == pytest.approx(2 / 3, abs=1e-12)
    # Counts are normalised per row: same result.
    assert r_metric(p * np.array([[10], [4], [7]])) == pytest.approx(2 / 3, abs=1e-12)
    # Two users (0.7, 0.3) and (0.2, 0.8): ||.||_1 = 1.0, R = 1 / 2.
    assert r_metric(np.array([[0.7, 0.3], [0.2, 0.8]])) == pytest.approx(0.5, abs=1e-12)
    assert r_metric(np.ones((1, 3))) == 0.0


# ------------------------------------------------------------------------------ SSFL construction
@pytest.mark.parametrize("target", [0.0, 0.2, 0.4, 0.8, 1.0])
def test_ssfl_realised_r_equals_target_when_k_equals_d(target):
    labels = _shuffled(MNIST_LIKE)
    parts = main_class_partition(labels, C, target, seed=3)
    _assert_disjoint_cover(parts, len(labels))
    hist = class_histograms(labels, parts, C)
    assert r_metric(hist) == pytest.approx(target, abs=0.02)
    # every user holds n_j/m_j = 500 samples and its main class has R + q_j(1-R) share
    assert np.all(hist.sum(axis=1) == 500)
    assert np.allclose(np.sort(hist.max(axis=1) / 500), target + 0.1 * (1 - target), atol=0.01)


@pytest.mark.parametrize("target", [0.3, 0.6, 0.9])
def test_ssfl_realised_r_for_k_twice_d(target):
    k = 2 * C
    m = k // C
    parts = main_class_partition(MNIST_LIKE, k, target, seed=0)
    _assert_disjoint_cover(parts, len(MNIST_LIKE))
    expected = target * (1 - C * m * (m - 1) / (k * (k - 1)))
    assert r_metric(class_histograms(MNIST_LIKE, parts, C)) == pytest.approx(expected, abs=0.02)
    assert expected == pytest.approx(0.947 * target, abs=1e-3)  # 1 - 10*2*1/(20*19) = 0.947


def test_ssfl_uneven_and_fewer_users_than_classes():
    for k in (7, 13):  # K < d and K not a multiple of d
        parts = main_class_partition(MNIST5K, k, 0.5, seed=1)
        _assert_disjoint_cover(parts, len(MNIST5K))
        assert 0.0 < r_metric(class_histograms(MNIST5K, parts, C)) <= 0.6


# ------------------------------------------------------------------------------ IID / Dirichlet
def test_iid_near_equal_and_deterministic():
    labels = _shuffled(MNIST5K)
    parts = iid_partition(labels, 7, seed=5)
    _assert_disjoint_cover(parts, len(labels))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = iid_partition(labels, 7, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = iid_partition(labels, 7, seed=6)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))
    assert r_metric(class_histograms(labels, parts, C)) < 0.15


def test_dirichlet_conserves_counts_and_skew_grows_as_alpha_shrinks():
    labels = _shuffled(MNIST5K)
    rs = {}
    for alpha in (0.1, 1.0, 100.0):
        vals = []
        for seed in range(5):
            parts, q = dirichlet_partition(labels, 10, alpha, seed=seed, return_proportions=True)
            _assert_disjoint_cover(parts, len(labels))
            hist = class_histograms(labels, parts, C)
            assert np.array_equal(hist.sum(axis=0), np.bincount(labels))
            # realised class shares follow q within one sample of rounding
            assert np.all(np.abs(hist.T - 400 * q) <= 1.0 + 1e-9)
            vals.append(r_metric(hist))
        rs[alpha] = np.mean(vals)
    assert rs[0.1] > rs[1.0] > rs[100.0]
    assert rs[0.1] > 0.7 and rs[100.0] < 0.1


def test_dirichlet_min_size_resamples_then_raises():
    labels = np.repeat(np.arange(2), 10)
    parts = dirichlet_partition(labels, 4, 0.5, min_size=3, seed=0)
    assert min(len(p) for p in parts) >= 3
    with pytest.raises(ValueError, match="partition-min-size"):
        dirichlet_partition(labels, 4, 0.01, min_size=5, max_retries=5, seed=0)


# ------------------------------------------------------------------------------ quantity skew
@pytest.mark.parametrize("k_clients,k", [(10, 2), (20, 2), (10, 3), (40, 6), (100, 2)])
def test_quantity_skew_divisible(k_clients, k):
    labels = _shuffled(np.repeat(np.arange(C), 600))
    parts = quantity_skew_partition(labels, k_clients, k, seed=2)
    _assert_disjoint_cover(parts, len(labels))
    hist = class_histograms(labels, parts, C)
    assert np.all((hist > 0).sum(axis=1) == k)
    assert np.all((hist > 0).sum(axis=0) == k_clients * k // C)
    # equal shards: every held class contributes 600 / (K k / C) samples (+-1)
    shard = 600 / (k_clients * k / C)
    assert np.all(np.abs(hist[hist > 0] - shard) <= 1)


def test_quantity_skew_non_divisible_spreads_evenly():
    parts = quantity_skew_partition(MNIST5K, 7, 3, seed=0)  # 21 slots over 10 classes
    _assert_disjoint_cover(parts, len(MNIST5K))
    hist = class_histograms(MNIST5K, parts, C)
    assert np.all((hist > 0).sum(axis=1) == 3)
    assert sorted(set((hist > 0).sum(axis=0).tolist())) == [2, 3]
    # the surplus shards go to randomly chosen classes, not always the same ones
    held = [tuple(class_histograms(MNIST5K, quantity_skew_partition(MNIST5K, 7, 3, seed=s), C).astype(bool).sum(0))
            for s in range(6)]
    assert len(set(held)) > 1


def test_quantity_skew_assignment_is_random():
    sets = {tuple(map(tuple, class_histograms(MNIST5K, quantity_skew_partition(MNIST5K, 10, 2, seed=s), C) > 0))
            for s in range(5)}
    assert len(sets) > 1


# ------------------------------------------------------------------------------ labeled / unlabeled
@pytest.mark.parametrize("n_s", [200, 500, 1000])
def test_server_split_balanced_and_disjoint(n_s):
    labels = _shuffled(MNIST5K)
    server, rest = server_labeled_split(labels, n_s, seed=0)
    assert np.array_equal(np.bincount(labels[server], minlength=C), np.full(C, n_s // C))
    plan = make_plan(labels, 10, PartitionConfig(scheme="dirichlet", alpha=0.1, server_labels=n_s), "server")
    assert np.array_equal(np.bincount(labels[plan.server_labeled], minlength=C), np.full(C, n_s // C))
    clients = np.concatenate([c.unlabeled for c in plan.clients])
    assert not np.intersect1d(clients, plan.server_labeled).size
    assert len(clients) + n_s == len(labels)
    assert all(len(c.labeled) == 0 for c in plan.clients)


def test_server_split_errors():
    with pytest.raises(ValueError, match="server-labels=205.*multiple"):
        server_labeled_split(MNIST5K, 205)
    with pytest.raises(ValueError, match="server-labels=5000"):
        server_labeled_split(MNIST5K, 5000)
    with pytest.raises(ValueError, match="server-labels"):
        make_plan(MNIST5K, 10, PartitionConfig(server_labels=0), "server")


def test_dir2_labeled_ratio():
    parts = iid_partition(MNIST5K, 20, seed=0)
    lab, unl, p_s = dir2_labeled_split(parts, 0.5, seed=4)
    for p, a, b, ps in zip(parts, lab, unl, p_s):
        assert np.array_equal(np.sort(np.concatenate([a, b])), p)
        assert not np.intersect1d(a, b).size
        assert len(a) / len(p) == pytest.approx(ps, abs=1 / len(p))
    # Dir_2(0.5) = Beta(0.5, 0.5): mean 1/2, U-shaped (many ratios near 0 or 1)
    draws = dir2_labeled_split([np.arange(100)] * 2000, 0.5, seed=0)[2]
    assert draws.mean() == pytest.approx(0.5, abs=0.03)
    assert np.mean((draws < 0.1) | (draws > 0.9)) > 0.35
    plan = make_plan(MNIST5K, 10, PartitionConfig(scheme="dirichlet", labeled_alpha=0.5), "dir2")
    assert np.allclose(plan.report["labeled_ratio"], plan.report["drawn_labeled_ratio"], atol=0.01)


@pytest.mark.parametrize("r", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_mismatch_realised_ratio(r, scheme):
    labels = _shuffled(MNIST5K)
    cfg = PartitionConfig(scheme=scheme, alpha=0.5, mismatch_ratio=r, labeled_per_client=60,
                          labeled_classes_per_client=2, seed=1)
    plan = make_plan(labels, 10, cfg, "mismatch")
    for k, cs in enumerate(plan.clients):
        lab_classes = set(np.unique(labels[cs.labeled]).tolist())
        assert lab_classes == {k % C, (k + 1) % C}
        assert np.array_equal(np.bincount(labels[cs.labeled], minlength=C)[sorted(lab_classes)], [30, 30])
        absent = ~np.isin(labels[cs.unlabeled], list(lab_classes))
        assert absent.mean() == pytest.approx(r, abs=0.05)
        assert plan.report["mismatch"]["per_client"][k] == pytest.approx(absent.mean())
    everything = np.concatenate([np.concatenate([c.labeled, c.unlabeled]) for c in plan.clients])
    assert len(np.unique(everything)) == len(everything)
    assert len(everything) + plan.report["unassigned"] == len(labels)
    if scheme == "iid":  # supply is balanced: nearly the whole pool is used
        assert plan.report["unassigned"] <= 0.02 * len(labels)


def test_mismatch_sizes_follow_dirichlet_with_floor():
    ms = mismatch_partition(MNIST5K, 10, mismatch_ratio=0.5, size_alpha=0.5, seed=0)
    floor = int(0.4 * (len(MNIST5K) - 600) / 10)
    assert ms.target_sizes.min() >= floor
    assert ms.target_sizes.sum() == len(MNIST5K) - 600
    assert ms.target_sizes.max() > 2 * floor  # sizes really are unequal
    assert np.all(np.abs(ms.realised_mismatch - 0.5) <= 0.05)


def test_matched_test_split_follows_client_distribution():
    labels = _shuffled(MNIST_LIKE)
    test = _shuffled(np.repeat(np.arange(C), 200), seed=9)
    parts, q = dirichlet_partition(labels, 10, 0.5, seed=0, return_proportions=True)
    tparts = matched_test_split(test, q, seed=0)
    _assert_disjoint_cover(tparts, len(test))
    h_train = class_histograms(labels, parts, C)
    h_test = class_histograms(test, tparts, C)
    p_train = h_train / h_train.sum(1, keepdims=True)
    p_test = h_test / h_test.sum(1, keepdims=True)
    tv = 0.5 * np.abs(p_train - p_test).sum(1)
    assert tv.max() < 0.05
    # a test split from a different client is far away (the check can fail)
    assert 0.5 * np.abs(p_train - np.roll(p_test, 1, axis=0)).sum(1).mean() > 0.2
    plan = make_plan(labels, 10, PartitionConfig(scheme="dirichlet", alpha=0.5), "dir2", test_labels=test)
    assert max(plan.report["test_tv"]) < 0.05
    assert sum(len(c.test) for c in plan.clients) == len(test)


# ------------------------------------------------------------------------------ flwr-datasets
def _hf_dataset(labels, class_label=False):
    data = {"label": labels.tolist(), "x": np.arange(len(labels)).tolist()}
    if class_label:
        feats = Features({"label": ClassLabel(num_classes=C), "x": Value("int64")})
        return Dataset.from_dict(data, features=feats)
    return Dataset.from_dict(data)


@pytest.mark.parametrize(
    "make_partitioner,fn",
    [
        (lambda: IidSplitPartitioner(6, seed=3), lambda y: iid_partition(y, 6, seed=3)),
        (lambda: ClassDirichletPartitioner(6, alpha=0.3, seed=3), lambda y: dirichlet_partition(y, 6, 0.3, seed=3)),
        (lambda: QuantitySkewPartitioner(10, classes_per_partition=2, seed=3),
         lambda y: quantity_skew_partition(y, 10, 2, seed=3)),
        (lambda: MainClassPartitioner(10, r=0.5, seed=3), lambda y: main_class_partition(y, 10, 0.5, seed=3)),
    ],
)
@pytest.mark.parametrize("class_label", [False, True])
def test_flwr_partitioners_match_functions(make_partitioner, fn, class_label):
    labels = _shuffled(np.repeat(np.arange(C), 40))
    ds = _hf_dataset(labels, class_label)
    part = make_partitioner()
    part.dataset = ds
    expected = fn(labels)
    assert part.num_partitions == len(expected)
    for pid, idx in enumerate(expected):
        assert np.array_equal(part.partition_indices[pid], idx)
        sub = part.load_partition(pid)
        assert sub["x"] == idx.tolist()
        assert sub["label"] == labels[idx].tolist()
    rep = part.report()
    assert rep["r"] == pytest.approx(r_metric(class_histograms(labels, expected, C)))
    assert sum(rep["sizes"]) == len(labels)
    json.dumps(rep)


def test_flwr_partitioner_with_federated_dataset_style_use():
    ds = _hf_dataset(MNIST5K)
    part = QuantitySkewPartitioner(10, partition_by="label", classes_per_partition=2, seed=0)
    part.dataset = ds
    for pid in range(10):
        assert len(set(part.load_partition(pid)["label"])) == 2
    with pytest.raises(ValueError, match="partition_id"):
        part.load_partition(10)


# ------------------------------------------------------------------------------ make_plan
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", LABEL_MODES)
def test_make_plan_all_combinations(scheme, mode):
    labels = _shuffled(MNIST5K)
    cfg = PartitionConfig(scheme=scheme, alpha=0.1, server_labels=500 if mode == "server" else 0,
                          mismatch_ratio=0.5, seed=7)
    if mode == "mismatch" and scheme in ("quantity", "ssfl-r"):
        with pytest.raises(ValueError, match="partition="):
            make_plan(labels, 10, cfg, mode)
        return
    plan = make_plan(labels, 10, cfg, mode, test_labels=TEST)
    assert len(plan.clients) == 10
    chunks = [plan.server_labeled] + [np.concatenate([c.labeled, c.unlabeled]) for c in plan.clients]
    allidx = np.concatenate(chunks)
    assert len(np.unique(allidx)) == len(allidx)
    assert len(allidx) + plan.report["unassigned"] == len(labels)
    assert all(len(c.labeled) + len(c.unlabeled) > 0 for c in plan.clients)
    if mode == "all":
        assert all(len(c.unlabeled) == 0 for c in plan.clients)
    if mode == "none":
        assert all(len(c.labeled) == 0 for c in plan.clients)
    assert sum(len(c.test) for c in plan.clients) == len(TEST)
    json.dumps(plan.report)
    assert plan.report["scheme"] == scheme
    line = plan_summary(plan)
    assert "\n" not in line and f"label_mode={mode}" in line
    again = make_plan(labels, 10, cfg, mode, test_labels=TEST)
    for a, b in zip(plan.clients, again.clients):
        assert np.array_equal(a.labeled, b.labeled) and np.array_equal(a.unlabeled, b.unlabeled)
        assert np.array_equal(a.test, b.test)


def test_make_plan_all_equals_scheme_function():
    labels = _shuffled(MNIST5K)
    plan = make_plan(labels, 10, PartitionConfig(scheme="dirichlet", alpha=0.3, seed=11), "all")
    parts = dirichlet_partition(labels, 10, 0.3, seed=11)
    assert all(np.array_equal(c.labeled, p) for c, p in zip(plan.clients, parts))
    assert plan.clients[0].test is None


def test_make_plan_ssfl_reports_target_and_expected_r():
    plan = make_plan(MNIST_LIKE, 20, PartitionConfig(scheme="ssfl-r", r=0.6), "none")
    rep = plan.report
    assert rep["target_r"] == 0.6
    assert rep["expected_r"] == pytest.approx(0.6 * (1 - 10 * 2 * 1 / (20 * 19)), abs=1e-9)
    assert rep["realised_r"] == pytest.approx(rep["expected_r"], abs=0.02)


def test_make_plan_is_fast():
    labels = np.random.default_rng(0).integers(0, 10, 60_000)
    test = np.random.default_rng(1).integers(0, 10, 10_000)
    for scheme in SCHEMES:
        cfg = PartitionConfig(scheme=scheme, alpha=0.1, server_labels=1000)
        make_plan(labels, 100, cfg, "server", test_labels=test)  # warm-up
        t0 = time.perf_counter()
        make_plan(labels, 100, cfg, "server", test_labels=test)
        assert time.perf_counter() - t0 < 0.5, scheme
    t0 = time.perf_counter()
    make_plan(labels, 100, PartitionConfig(scheme="dirichlet", mismatch_ratio=0.5), "mismatch", test)
    assert time.perf_counter() - t0 < 0.5


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs,mode,pattern",
    [
        ({"scheme": "foo"}, "all", r"partition='foo' is not one of: iid, dirichlet, quantity, ssfl-r"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "all", r"partition-alpha=0.0 is out of range; allowed \(0.0, inf\]"),
        ({"scheme": "dirichlet", "alpha": -1}, "all", r"partition-alpha"),
        ({"scheme": "quantity", "classes_per_client": 0}, "all", r"partition-classes-per-client=0"),
        ({"scheme": "quantity", "classes_per_client": 11}, "all", r"partition-classes-per-client=11 must be in \[1, 10\]"),
        ({"scheme": "quantity", "classes_per_client": 1}, "all", r"partition-classes-per-client=1 with 5 clients"),
        ({"scheme": "ssfl-r", "r": 1.5}, "all", r"partition-r=1.5 is out of range; allowed \[0.0, 1.0\]"),
        ({"server_labels": -10}, "server", r"server-labels=-10"),
        ({"server_labels": 123}, "server", r"server-labels=123 must be a multiple"),
        ({"server_labels": 4010}, "server", r"server-labels=4010"),
        ({"labeled_alpha": 0}, "dir2", r"labeled-alpha"),
        ({"mismatch_ratio": 2.0}, "mismatch", r"mismatch-ratio=2.0"),
        ({"mismatch_ratio": 0.5, "labeled_classes_per_client": 10}, "mismatch", r"mismatch-ratio=0.5 needs"),
        ({"labeled_per_client": 5000}, "mismatch", r"labeled-per-client=5000"),
        ({"min_size": -1}, "all", r"partition-min-size"),
    ],
)
def test_errors_name_the_key(kwargs, mode, pattern):
    n_clients = 5 if kwargs.get("classes_per_client") == 1 else 10
    with pytest.raises(ValueError, match=pattern):
        make_plan(MNIST5K, n_clients, PartitionConfig(**kwargs), mode)


def test_impossible_splits_raise():
    with pytest.raises(ValueError, match="num_clients=50"):
        make_plan(np.arange(10) % 3, 50, PartitionConfig(), "all")
    with pytest.raises(ValueError, match="label_mode='bogus' is not one of"):
        make_plan(MNIST5K, 10, PartitionConfig(), "bogus")
    with pytest.raises(ValueError, match="server-labels=4000"):  # nothing left for clients
        make_plan(MNIST5K, 10, PartitionConfig(server_labels=4000), "server")
    with pytest.raises(ValueError, match="class 1 has 1 samples"):
        quantity_skew_partition(np.array([0] * 50 + [1]), 4, 1)
    with pytest.raises(ValueError, match="integer class ids"):
        make_plan(np.array([0.5, 1.0]), 1, PartitionConfig(), "all")


def test_config_keys_and_from_run_config():
    rc = {"partition": "quantity", "partition-classes-per-client": 3, "partition-alpha": 1,
          "server-labels": 100, "seed": 4, "unrelated": 1}
    cfg = PartitionConfig.from_run_config(rc)
    assert (cfg.scheme, cfg.classes_per_client, cfg.alpha, cfg.server_labels, cfg.seed) == ("quantity", 3, 1, 100, 4)
    assert set(CONFIG_KEYS) == set(PartitionConfig.__dataclass_fields__)


def test_make_plan_path_does_not_import_flower_packages():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, numpy as np; import tasks.partition as P; "
            "P.make_plan(np.arange(100) % 10, 4, P.PartitionConfig(), 'all'); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('flwr', 'flwr_datasets', 'datasets')]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_partitioner_pickles():
    import pickle

    part = ClassDirichletPartitioner(4, alpha=0.5, seed=1)
    part.dataset = _hf_dataset(MNIST5K)
    clone = pickle.loads(pickle.dumps(part))
    assert all(np.array_equal(a, b) for a, b in zip(clone.partition_indices, part.partition_indices))
