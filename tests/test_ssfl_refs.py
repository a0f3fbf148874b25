"""The SSFL benchmark's supervised references (strategies/ssfl/elastic.py: EASGD, OverlapSGD;
strategies/ssfl/datasharing.py: DataSharing): each one's defining rule against a hand computation,
through the real ClientApp dispatch where the rule lives on the nodes. The conformance matrix
runs all three under every condition (tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.config import ConfigError


def _fake_local_steps(shift_of):
    """A stand-in for the tau local SGD steps: every float entry of the worker's model moves
    by ``shift_of(partition_id)`` (so the elastic/anchor rules can be followed by hand)."""
    def fake(model, env, optimizer, rnd, name):
        with torch.no_grad():
            for v in model.state_dict().values():
                if v.is_floating_point():
                    v.add_(shift_of(env.partition_id))
        return {"train-loss": 0.0, "num-examples": 1.0}
    return fake


def _state(model) -> dict[str, np.ndarray]:
    """The float entries of a model's state (integer buffers, e.g. BN's num_batches_tracked, are not shifted)."""
    return {k: v.detach().cpu().numpy().astype(np.float64) for k, v in model.state_dict().items()
            if v.is_floating_point()}


def _params(model) -> set[str]:
    """The model's parameters: the entries the elastic / anchor rules apply to (not BN's buffers)."""
    return {k for k, _ in model.named_parameters()}


# ----------------------------------------------------------------------------------- EASGD
def test_easgd_elastic_step_by_hand():
    """Two workers, a 2-vector: x_i <- x_i - a (x_i - z), z <- z + a sum_i (x_i - z) with the
    PRE-update x_i, numbers worked out by hand (a = 0.45 = 0.9 / 2)."""
    from strategies.ssfl.elastic import easgd_centre, easgd_worker

    z = {"w": np.array([1.0, 0.0], np.float32)}
    x1 = {"w": np.array([3.0, 2.0], np.float32)}
    x2 = {"w": np.array([0.0, -2.0], np.float32)}
    a = 0.45
    # worker 1: [3, 2] - 0.45 [2, 2] = [2.1, 1.1]; worker 2: [0, -2] - 0.45 [-1, -2] = [0.45, -1.1]
    np.testing.assert_allclose(easgd_worker(x1, z, a)["w"], [2.1, 1.1], rtol=1e-6)
    np.testing.assert_allclose(easgd_worker(x2, z, a)["w"], [0.45, -1.1], rtol=1e-6)
    # centre: [1, 0] + 0.45 ([2, 2] + [-1, -2]) = [1.45, 0]
    np.testing.assert_allclose(easgd_centre(z, [x1, x2], a)["w"], [1.45, 0.0], atol=1e-6)
    # the elastic force is symmetric: each worker moves by -a (x_i - z), the centre by +a sum_i (x_i - z),
    # so sum_i x_i + z is conserved
    before = x1["w"] + x2["w"] + z["w"]
    after = easgd_worker(x1, z, a)["w"] + easgd_worker(x2, z, a)["w"] + easgd_centre(z, [x1, x2], a)["w"]
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_the_elastic_and_anchor_rules_leave_batchnorm_buffers_to_each_worker():
    """As the originals (optimizers over model.parameters()): the rules apply to the entries
    ``params``; any other entry (a BN running mean) keeps the worker's value, is contributed as
    the worker's own to OverlapSGD's all-reduce and has no anchor momentum; EASGD's centre takes
    the mean of the workers' buffers (the server evaluates z)."""
    from strategies.ssfl.elastic import easgd_centre, easgd_worker, overlap_worker

    z = {"w": np.array([1.0], np.float32), "bn.running_mean": np.array([0.0], np.float32)}
    x1 = {"w": np.array([3.0], np.float32), "bn.running_mean": np.array([4.0], np.float32)}
    x2 = {"w": np.array([0.0], np.float32), "bn.running_mean": np.array([1.0], np.float32)}
    a, params = 0.45, {"w"}
    w1 = easgd_worker(x1, z, a, params)
    assert float(w1["w"][0]) == pytest.approx(2.1) and float(w1["bn.running_mean"][0]) == 4.0   # not pulled
    c = easgd_centre(z, [x1, x2], a, params)
    assert float(c["w"][0]) == pytest.approx(1.0 + 0.45 * (2.0 - 1.0))                  # the elastic rule
    assert float(c["bn.running_mean"][0]) == pytest.approx(2.5)                          # the workers' mean
    # without params (every entry): the old all-entries rule, buffers pulled too
    assert float(easgd_worker(x1, z, a)["bn.running_mean"][0]) == pytest.approx(4.0 - 0.45 * 4.0)
    pulled, v, contrib = overlap_worker(x1, None, z, pull=0.6, gmf=0.7, lr=0.5, params=params)
    assert float(pulled["w"][0]) == pytest.approx(0.4 * 3.0 + 0.6 * 1.0)
    assert float(pulled["bn.running_mean"][0]) == 4.0 and float(contrib["bn.running_mean"][0]) == 4.0
    assert set(v) == {"w"}


def test_easgd_round_through_the_nodes_matches_the_hand_rule(monkeypatch):
    """A real round with two nodes (ClientApp dispatch, node state): after the period each node
    keeps x_i = (z + d_i) - a d_i and the server's centre is z + a (d_1 + d_2), a = 0.9 / 2, on
    the parameters; BatchNorm's running statistics (the model has a BatchNorm1d) are not pulled:
    each node keeps its own z + d_i, the centre takes their mean z + (d_1 + d_2) / 2. The next
    round starts each node from its own kept x_i, not from the centre."""
    import strategies.ssfl.elastic as el
    from tests.test_conformance import build

    shift = {0: 0.5, 1: -0.1}
    monkeypatch.setattr(el, "_local_steps", _fake_local_steps(lambda pid: shift[pid]))
    s, grid = build("easgd", nodes=2)
    s.setup(grid)
    z0 = _state(s.model)
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    a = 0.9 / 2
    assert rows[0]["elastic-a"] == pytest.approx(a)
    z1, params = _state(s.model), _params(s.model)
    buffers = set(z0) - params
    assert buffers == {"stages.fc1.2.running_mean", "stages.fc1.2.running_var"}, buffers
    for k in z0:
        want = z0[k] + (a * (shift[0] + shift[1]) if k in params else (shift[0] + shift[1]) / 2)
        np.testing.assert_allclose(z1[k], want, atol=1e-5, err_msg=k)
    for pid, ctx in enumerate(grid.contexts.values()):
        x = {k: ctx.state[el.X_KEY][k].numpy() for k in ctx.state[el.X_KEY].keys()}
        for k in z0:
            want = z0[k] + shift[pid] - (a * shift[pid] if k in params else 0.0)
            np.testing.assert_allclose(x[k], want, atol=1e-5, err_msg=k)
    # round 2: each node's reply is its kept x_i plus its shift (its own model, not the centre)
    replies = []
    grid_handler = grid.handler
    grid.handler = lambda m, c: replies.append((c.node_config["partition-id"], grid_handler(m, c))) or replies[-1][1]
    s.start(grid, num_rounds=2, start_round=2)
    for pid, r in replies:
        got = {k: r.content.array_records["arrays"][k].numpy() for k in z0}
        for k in z0:
            np.testing.assert_allclose(got[k], z0[k] + ((2 - a) if k in params else 2) * shift[pid], atol=1e-5,
                                       err_msg=k)


def test_easgd_unstable_moving_rate_is_a_config_error():
    """m a > 1 makes z <- (1 - m a) z + a sum x_i diverge: a fixed easgd.alpha with K a > 1 is refused,
    naming the key and the allowed values; K a <= 1 runs."""
    from tests.test_conformance import build

    s, grid = build("easgd", **{"easgd.alpha": 0.4})     # 4 nodes: m a = 1.6
    with pytest.raises(ConfigError, match=r"easgd\.alpha=0\.4 .*K=4.*allowed: easgd\.alpha <= 1/K = 0\.25"):
        s.start(grid, num_rounds=1)
    s, grid = build("easgd", **{"easgd.alpha": 0.25})
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert rows[0]["elastic-a"] == 0.25 and rows[0].get("skipped", 0) == 0


# ----------------------------------------------------------------------------------- OverlapSGD
def test_overlap_worker_step_by_hand():
    """x <- (1 - a) x + a z; v <- gmf v + (z - x)/lr; contribution z - lr v (scalars by hand:
    a = 0.6, gmf = 0.7, lr = 0.5)."""
    from strategies.ssfl.elastic import overlap_anchor, overlap_worker

    x, z, v = {"w": np.array([2.0], np.float32)}, {"w": np.array([1.0], np.float32)}, {"w": np.array([0.4])}
    pulled, new_v, contrib = overlap_worker(x, v, z, pull=0.6, gmf=0.7, lr=0.5)
    # pulled = 0.4 * 2 + 0.6 * 1 = 1.4; v = 0.28 + (1 - 1.4)/0.5 = -0.52; contrib = 1 + 0.26 = 1.26
    assert float(pulled["w"][0]) == pytest.approx(1.4, rel=1e-6)
    assert float(new_v["w"][0]) == pytest.approx(-0.52, rel=1e-6)
    assert float(contrib["w"][0]) == pytest.approx(1.26, rel=1e-6)
    # without momentum (first period or gmf = 0) the contribution is the pulled model itself
    p0, _, c0 = overlap_worker(x, None, z, pull=0.6, gmf=0.7, lr=0.5)
    assert float(c0["w"][0]) == pytest.approx(float(p0["w"][0]), rel=1e-6)
    assert float(overlap_anchor([{"w": np.array([1.0])}, {"w": np.array([2.0])}])["w"][0]) == 1.5


def test_overlapsgd_pulls_toward_the_previous_rounds_anchor(monkeypatch):
    """Two nodes, three rounds through the ClientApp dispatch, local steps replaced by a known
    shift d_i. The anchor sent in round r is the mean of round r-1's contributions (one period
    stale), and the whole recursion (pull, anchor momentum, all-reduce) equals an independent
    numpy rollout; a non-stale variant (pulling toward this round's mean) ends elsewhere."""
    import strategies.ssfl.elastic as el
    from tests.test_conformance import build

    shift = {0: 0.3, 1: -0.1}
    monkeypatch.setattr(el, "_local_steps", _fake_local_steps(lambda pid: shift[pid]))
    s, grid = build("overlapsgd", nodes=2)
    s.setup(grid)
    z0 = _state(s.model)
    lr, a, gmf = s.task.lr, 0.6, 0.7
    rounds = 3
    sent, replies = {}, {}
    inner = grid.handler

    def spy(m, c):
        rnd, pid = int(m.content.config_records["config"]["server-round"]), c.node_config["partition-id"]
        if "arrays" in m.content.array_records:
            sent[rnd, pid] = {k: m.content.array_records["arrays"][k].numpy().astype(np.float64) for k in z0}
        r = inner(m, c)
        if not r.has_error() and "arrays" in r.content.array_records:
            replies[rnd, pid] = {k: r.content.array_records["arrays"][k].numpy().astype(np.float64) for k in z0}
        return r

    grid.handler = spy
    s.start(grid, num_rounds=rounds)
    # staleness: the anchor of round r is the mean of round r-1's contributions
    for r in range(2, rounds + 1):
        for k in z0:
            want = (replies[r - 1, 0][k] + replies[r - 1, 1][k]) / 2
            np.testing.assert_allclose(sent[r, 0][k], want, atol=1e-5)
            np.testing.assert_allclose(sent[r, 1][k], want, atol=1e-5)

    params = _params(s.model)

    def rollout(stale: bool) -> dict[str, np.ndarray]:
        """The recursion in numpy; a BatchNorm buffer (not a parameter) is not pulled, has no
        anchor momentum and is contributed as the worker's own."""
        out = {}
        for k in z0:
            anchor = z0[k].copy()
            x = [z0[k].copy(), z0[k].copy()]
            v = [np.zeros_like(z0[k]), np.zeros_like(z0[k])]
            for _ in range(rounds):
                trained = [x[i] + shift[i] for i in range(2)]
                target = anchor if stale else (trained[0] + trained[1]) / 2
                contrib = []
                for i in range(2):
                    if k not in params:
                        x[i] = trained[i]
                        contrib.append(trained[i])
                        continue
                    x[i] = (1 - a) * trained[i] + a * target
                    v[i] = gmf * v[i] + (target - x[i]) / lr
                    contrib.append(target - lr * v[i])
                anchor = (contrib[0] + contrib[1]) / 2
            out[k] = anchor
        return out

    final, stale, fresh = _state(s.model), rollout(True), rollout(False)
    for k in z0:
        np.testing.assert_allclose(final[k], stale[k], atol=1e-4, err_msg=k)
    assert any(not np.allclose(final[k], fresh[k], atol=1e-3) for k in z0)


# ----------------------------------------------------------------------------------- DataSharing
def test_shared_data_dilutes_r_as_the_formula_says():
    """R(D_k + G_k) = R_priv n_priv / (n_priv + alpha |G|) (derived in strategies/ssfl/datasharing.py) for class-balanced
    shares: two nodes with class counts (8, 2) and (2, 8), R_priv = 0.6; each gets 4 of the 8
    samples of a balanced G (alpha = 0.5): R = 0.6 * 10/14, by the library's R metric on the
    merged counts; and alpha_for_target inverts it."""
    from strategies.ssfl.datasharing import alpha_for_target, merged_r
    from tasks.partition.metrics import r_metric

    hist = np.array([[8, 2], [2, 8]])
    assert r_metric(hist) == pytest.approx(0.6)
    g_labels = np.array([0, 1, 0, 1, 0, 1, 0, 1])
    shares = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])]     # 2 + 2 per node
    assert merged_r(hist, g_labels, shares) == pytest.approx(0.6 * 10 / 14)
    # by hand: P_1 = (10, 4)/14, P_2 = (4, 10)/14, R = ||P_1 - P_2||_1 / (K (K-1)) = (12/14) / 2
    assert merged_r(hist, g_labels, shares) == pytest.approx(12 / 14 / 2)
    assert alpha_for_target(0.6, 10, 8, 0.6 * 10 / 14) == pytest.approx(0.5)
    # an unbalanced share does not dilute as much: the formula is for G's uniform distribution
    assert merged_r(hist, g_labels, [np.array([0, 2, 4, 6]), np.array([1, 3, 5, 7])]) > 0.6 * 10 / 14


def test_datasharing_target_r_is_realised_and_reported():
    """datasharing.target-r on the library's R-partition: the chosen alpha brings the realised R of
    the nodes' D_k + G_k (computed from the plan and the shares the server draws) near the
    target, below the private R; alpha, beta and both R are in every round's metrics."""
    from tests.test_conformance import build

    s, grid = build("datasharing", partition="ssfl-r", **{"partition-r": 0.6, "server-labels": 200,
                                                           "datasharing.target-r": 0.21})
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    m = rows[0]
    assert 0.0 < m["datasharing-alpha"] <= 1.0
    # (4 nodes of 10 classes: the R-partition's private R is 0.24 here)
    assert m["private-r"] > 0.2 and m["realised-r"] == pytest.approx(0.21, abs=0.003)
    assert m["datasharing-beta"] == pytest.approx(200 / (200 + sum(len(c.all) for c in s.env.plan.clients)))
    assert m["shared-per-node"] == round(m["datasharing-alpha"] * 200)
    for target in (0.05, 0.3):   # below what |G| can dilute to; above the private R (sharing only dilutes)
        with pytest.raises(ConfigError, match=rf"datasharing\.target-r={target:g} is out of reach.*allowed"):
            build("datasharing", partition="ssfl-r", **{"partition-r": 0.6, "datasharing.target-r": target}
                  )[0].setup(grid)


def test_each_node_gets_its_share_once_and_again_after_losing_it():
    """G_k travels in a node's first training message only (byte kind shared-data, counted in
    round 1 alone), the node trains on |D_k| + |G_k| samples (its FedAvg weight), and a node whose
    state was lost fails one round and receives its share again with its next message."""
    from strategies.ssfl.datasharing import SHARED_KEY, STATE_KEY, share_indices
    from tests.test_conformance import build

    s, grid = build("datasharing", **{"datasharing.alpha": 0.25})
    s.setup(grid)
    shared = s.env.server_labeled()
    got: dict[int, list[int]] = {}
    sizes: dict[tuple[int, int], float] = {}
    inner = grid.handler

    def spy(m, c):
        rnd, pid = int(m.content.config_records["config"]["server-round"]), c.node_config["partition-id"]
        if SHARED_KEY in m.content.array_records:
            got.setdefault(pid, []).append(rnd)
            y = m.content.array_records[SHARED_KEY]["y"].numpy()
            np.testing.assert_array_equal(y, shared.y[share_indices(len(shared), 0.25, s.task.seed, pid)])
        r = inner(m, c)
        if not r.has_error() and m.metadata.message_type == "train":
            sizes[rnd, pid] = float(r.content.metric_records["metrics"]["num-examples"])
        return r

    grid.handler = spy
    victim = grid.contexts[sorted(grid.contexts)[2]]

    def lose_state(rnd, metrics):
        rows.append(dict(metrics))
        if rnd == 1:
            del victim.state[STATE_KEY]

    rows: list[dict] = []
    s.start(grid, num_rounds=3, on_round_end=lose_state)
    assert got == {0: [1], 1: [1], 2: [1, 3], 3: [1]}, got
    assert sorted(grid.contexts)[2] in rows[1]["dropped"] and rows[2]["dropped"] == []
    assert rows[0]["bytes.shared-data.down"] > 0 and "bytes.shared-data.down" not in rows[1]
    per_node = round(0.25 * len(shared))
    for (rnd, pid), n in sizes.items():
        own = len(s.env.plan.clients[pid].all)
        assert n == own + per_node, (rnd, pid)


def test_datasharing_warms_up_on_the_shared_set_unless_given_initial_arrays():
    """w^0 is trained on G before the first broadcast (warmup-epochs passes), so round 1's message
    carries other weights than the initial model; warmup-epochs=0 sends the initial model."""
    from tests.test_conformance import build

    def first_sent(**over):
        s, grid = build("datasharing", **over)
        s.setup(grid)
        init = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
        rows = []
        s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
        m = next(m for m in grid.sent if m.metadata.message_type == "train")
        sent = {k: m.content.array_records["arrays"][k].numpy() for k in init}
        return init, sent, rows[0]

    init, sent, row = first_sent()
    assert row["warmup-steps"] == 5 * int(np.ceil(40 / 8))
    assert any(not np.allclose(sent[k], init[k].numpy()) for k in init)
    init, sent, row = first_sent(**{"datasharing.warmup-epochs": 0})
    assert "warmup-steps" not in row
    assert all(np.array_equal(sent[k], init[k].numpy()) for k in init)
