"""SSFL (strategies/ssfl/ssfl.py) against the paper's formulas (Sec. 3.3 Eqs. 3-6, Sec. 4.2 Eq. 7,
Appendix A.3 Eq. 10)."""
import math

import numpy as np
import pytest
import torch
from torch import nn

from flower_apps.config import parse_run_config
from strategies.ssfl.ssfl import (
    SSFLConfig,
    SSFLStrategy,
    lr_function,
    schedule_config,
    user_loss,
)
from tasks.config import ConfigError, TaskConfig
from tasks.schedules import cosine_lr

DT = torch.float64


# --------------------------------------------------------------------------- user loss (Eq. 3, 4)
def _identity_model(c: int) -> nn.Module:
    """Logits = input, so confidences are set by hand."""
    m = nn.Linear(c, c, bias=False).double()
    with torch.no_grad():
        m.weight.copy_(torch.eye(c, dtype=DT))
    return m


def test_crl_masks_exactly_the_samples_under_tau_and_normalises_by_full_batch():
    torch.manual_seed(0)
    c, tau = 3, 0.95
    # weak-view logits: softmax confidences 0.99 (kept), 0.6 (masked), 0.97 (kept), ~0.949 (masked)
    conf = [0.99, 0.6, 0.97, 0.949]
    cls = [0, 2, 1, 0]
    xw = torch.full((4, c), -30.0, dtype=DT)
    for i, (p, k) in enumerate(zip(conf, cls)):
        # two classes share 1-p, the main class gets p: logit = log p (others log((1-p)/2))
        xw[i] = torch.log(torch.tensor([(1 - p) / 2] * c, dtype=DT))
        xw[i, k] = math.log(p)
    xw.requires_grad_(True)
    xs = torch.randn(4, c, dtype=DT, requires_grad=True)
    model = _identity_model(c)
    loss, mask, pseudo = user_loss(model, xw, xs, tau, "crl")
    assert mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert pseudo.tolist() == cls
    expected = sum(-torch.log_softmax(xs.detach()[i], 0)[cls[i]].item() for i in (0, 2)) / 4  # full batch N_b
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert loss.item() != pytest.approx(expected * 4 / 2)  # not normalised by the kept count
    loss.backward()
    assert torch.all(xs.grad[1] == 0) and torch.all(xs.grad[3] == 0)  # masked samples: no gradient
    assert torch.any(xs.grad[0] != 0) and torch.any(xs.grad[2] != 0)
    assert xw.grad is None or torch.all(xw.grad == 0)  # the weak view is a constant target


def test_self_training_uses_the_weak_view_for_label_and_loss():
    c = 3
    xw = torch.tensor([[5.0, 0.0, 0.0], [0.1, 0.0, 0.0]], dtype=DT, requires_grad=True)
    model = _identity_model(c)
    loss, mask, _ = user_loss(model, xw, None, 0.95, "self-training")
    assert mask.tolist() == [1.0, 0.0]
    expected = -torch.log_softmax(xw.detach()[0], 0)[0].item() / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="strong view"):
        user_loss(model, xw, None, 0.95, "crl")


# --------------------------------------------------------------------------- aggregation (Eq. 5, 6, 7)
def _strategy(groups: int) -> SSFLStrategy:
    s = SSFLStrategy(TaskConfig(server_labels=100), SSFLConfig(groups=groups), "ssfl")
    torch.manual_seed(0)
    s.model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).double()  # "0." = classifier here
    s.keys = [k for k, _ in s.model.named_parameters()]
    s.classifier_keys = ["0.weight", "0.bias"]
    with torch.no_grad():
        s.model[1].running_mean.fill_(7.0)  # server BN statistics: must survive averaging
    return s


def _rand_params(s, rng):
    return {k: rng.normal(size=tuple(v.shape)) for k, v in s.model.named_parameters()}


def _set_server(s, params):
    sd = s.model.state_dict()
    for k, v in params.items():
        sd[k].copy_(torch.from_numpy(v))


def _server_now(s):
    sd = s.model.state_dict()
    return {k: sd[k].numpy().copy() for k in s.keys}


def test_grouped_average_equals_eq6_in_the_strategy_path():
    rng = np.random.default_rng(1)
    s = _strategy(groups=2)
    base = [_rand_params(s, rng), _rand_params(s, rng)]
    s.group_params = [dict(b) for b in base]
    ws = _rand_params(s, rng)
    _set_server(s, ws)
    users = {11: _rand_params(s, rng), 12: _rand_params(s, rng), 13: _rand_params(s, rng)}
    sent = {11: 0, 12: 0, 13: 1}
    s.aggregate_users(users, sent)
    for k in s.keys:
        g0 = (ws[k] + users[11][k] + users[12][k]) / 3
        g1 = (ws[k] + users[13][k]) / 2
        np.testing.assert_allclose(s.group_params[0][k], g0, rtol=1e-12)
        np.testing.assert_allclose(s.group_params[1][k], g1, rtol=1e-12)
        np.testing.assert_allclose(_server_now(s)[k], (g0 + g1) / 2, rtol=1e-12)
    assert torch.all(s.model[1].running_mean == 7.0)  # buffers are not averaged


def test_fedavg_including_server_equals_eq5_and_empty_group_gets_server():
    rng = np.random.default_rng(2)
    s = _strategy(groups=1)
    s.group_params = [_rand_params(s, rng)]
    ws = _rand_params(s, rng)
    _set_server(s, ws)
    users = {1: _rand_params(s, rng), 2: _rand_params(s, rng), 3: _rand_params(s, rng)}
    s.aggregate_users(users, {1: 0, 2: 0, 3: 0})
    for k in s.keys:
        expect = (ws[k] + users[1][k] + users[2][k] + users[3][k]) / 4
        np.testing.assert_allclose(_server_now(s)[k], expect, rtol=1e-12)
        np.testing.assert_allclose(s.group_params[0][k], expect, rtol=1e-12)
    # S = 3, nobody from group 2 this round: w_avg,2 = w_s and it counts in the mean
    s = _strategy(groups=3)
    s.group_params = [_rand_params(s, rng) for _ in range(3)]
    ws = _rand_params(s, rng)
    _set_server(s, ws)
    users = {1: _rand_params(s, rng), 2: _rand_params(s, rng)}
    s.aggregate_users(users, {1: 0, 2: 1})
    for k in s.keys:
        g = [(ws[k] + users[1][k]) / 2, (ws[k] + users[2][k]) / 2, ws[k]]
        np.testing.assert_allclose(s.group_params[2][k], ws[k], rtol=1e-12)
        np.testing.assert_allclose(_server_now(s)[k], sum(g) / 3, rtol=1e-12)


def test_weight_diversity_on_hand_made_updates():
    s = _strategy(groups=2)
    zero = {k: np.zeros(tuple(v.shape)) for k, v in s.model.named_parameters()}
    s.group_params = [dict(zero), {k: v + 1.0 for k, v in zero.items()}]
    _set_server(s, zero)

    def user(base, w, b, noise=0.0):
        p = {k: v.copy() for k, v in base.items()}
        p["0.weight"] = base["0.weight"] + np.asarray(w, dtype=float)
        p["0.bias"] = base["0.bias"] + np.asarray(b, dtype=float)
        p["1.weight"] = base["1.weight"] + noise  # not the classifier: ignored by Eq. 7 here
        return p

    # orthogonal updates of equal norm relative to what each user received -> ratio 1, K x ratio = K
    u1 = user(s.group_params[0], [[1, 0, 0], [0, 0, 0]], [0, 0], noise=5.0)
    u2 = user(s.group_params[1], [[0, 1, 0], [0, 0, 0]], [0, 0], noise=-3.0)
    m = s.aggregate_users({1: u1, 2: u2}, {1: 0, 2: 1})
    assert m["weight-diversity"] == pytest.approx(1.0) and m["weight-diversity-k"] == pytest.approx(2.0)
    # identical updates of 3 users -> 1/K ; hand-made general case
    s.group_params = [dict(zero), dict(zero)]
    same = [user(zero, [[1, 2, 0], [0, 0, 1]], [1, 0]) for _ in range(3)]
    m = s.aggregate_users(dict(enumerate(same)), {0: 0, 1: 0, 2: 1})
    assert m["weight-diversity"] == pytest.approx(1 / 3) and m["weight-diversity-k"] == pytest.approx(1.0)
    s.group_params = [dict(zero), dict(zero)]
    a, b = user(zero, [[1, 0, 0], [0, 0, 0]], [2, 0]), user(zero, [[1, 0, 0], [0, 0, 0]], [-1, 1])
    m = s.aggregate_users({1: a, 2: b}, {1: 0, 2: 1})
    num = (1 + 4) + (1 + 1 + 1)
    den = 2 ** 2 + 1 ** 2 + 1 ** 2
    assert m["weight-diversity"] == pytest.approx(num / den)


def test_groups_are_contiguous_in_partition_id():
    s = SSFLStrategy(TaskConfig(server_labels=100), SSFLConfig(groups=2), "ssfl")
    for p in range(10):
        s.note_partition(100 + p, p, 10)
    assert [s.group_of(100 + p) for p in range(10)] == [0] * 5 + [1] * 5
    s = SSFLStrategy(TaskConfig(server_labels=100), SSFLConfig(groups=3), "ssfl")
    for p in range(7):
        s.note_partition(p, p, 7)
    assert [s.group_of(p) for p in range(7)] == [0, 0, 0, 1, 1, 2, 2]


# --------------------------------------------------------------------------- schedule (Appendix A.3)
def test_cosine_schedule_runs_over_global_iterations():
    cfg = SSFLConfig(lr_c=2.3, lr_horizon=3.4, lr_warmup=0.1)
    period, rounds, lr = 8, 10, 0.146
    seen = []
    for r in range(1, rounds + 1):
        sched = schedule_config(cfg, r, period, rounds)
        assert sched["global-step"] == (r - 1) * period and sched["local-steps"] == period
        fn = lr_function(cfg, lr, sched)
        seen += [fn(i) for i in range(period)]
    total, warm = 3.4 * rounds * period, 0.1 * rounds * period
    assert seen == [cosine_lr(t, total, lr, warmup_steps=warm, floor=1e-4, c=2.3) for t in range(rounds * period)]
    assert seen[0] == 0.0 and max(seen) <= lr
    const = lr_function(SSFLConfig(lr_schedule="constant"), lr, schedule_config(cfg, 3, period, rounds))
    assert const(0) == const(7) == lr


# --------------------------------------------------------------------------- config
def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="server-labels"):
        SSFLStrategy(TaskConfig(server_labels=0), SSFLConfig(), "ssfl")
    with pytest.raises(ConfigError, match="ssfl.user-loss='mixmatch' is not one of: crl, self-training"):
        parse_run_config({"algo": "ssfl", "ssfl.user-loss": "mixmatch"})
    with pytest.raises(ConfigError, match="ssfl.groups=0 is out of range"):
        parse_run_config({"algo": "ssfl", "ssfl.groups": 0})
    with pytest.raises(ConfigError, match="ssfl.lr-warmup"):
        parse_run_config({"algo": "ssfl", "ssfl.lr-warmup": 0.5, "ssfl.lr-horizon": 0.4})
    parsed = parse_run_config({"algo": "ssfl-selftrain", "ssfl.tau": 0.9})
    assert parsed.algo.user_loss == "self-training" and parsed.algo.tau == 0.9


def test_user_period_reports_the_class_histogram_of_its_confident_pseudo_labels():
    """``pseudo-hist`` counts the kept (confident) pseudo-labels per class, from the model's own
    predictions (no true label): a one-class collapse shows as one non-zero bin."""
    from strategies.ssfl.ssfl import train_unlabeled
    from tasks.data import ArrayDataset

    class Ident:
        def weak(self, x):
            return x.float() / 255

        strong = weak

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.tensor([0.0, 9.0, 0.0]))  # every sample confidently class 1
    data = ArrayDataset(np.random.default_rng(0).integers(0, 256, (10, 1, 2, 2), dtype=np.uint8),
                        np.zeros(10, dtype=np.int64))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = train_unlabeled(model, data, aug=Ident(), steps=3, batch_size=4, optimizer=opt,
                        device=torch.device("cpu"), seed=0, tau=0.95)
    assert m["pseudo-kept"] == m["num-examples"] == sum(m["pseudo-hist"]) > 0
    assert m["pseudo-hist"] == [0.0, m["pseudo-kept"]]
    assert m["pseudo-correct"] == 0  # the (hidden) labels are all 0: diagnostics only


def test_a_period_without_a_confident_pseudo_label_reports_no_train_loss():
    """Every pseudo-label masked: the users' loss measured nothing, so it is not reported
    (a 0.0 would look like a perfect fit); mask-rate 0 says why."""
    from tests.test_conformance import build, run
    s, grid = build("ssfl", **{"ssfl.tau": 1.0})
    res, rows = run(s, grid, rounds=1)
    (m,) = rows
    assert m["mask-rate"] == 0.0 and "train-loss" not in m and m["participants"] > 0


def test_warm_start_trains_the_server_before_round_one_and_users_start_from_it(monkeypatch):
    """``ssfl.warm-start-steps=W``: W labeled steps of the server before round 1 (constant lr),
    evaluated (``warm-accuracy``), and round 1's users receive that warm model; 0 = cold."""
    import strategies.ssfl.ssfl as ss
    from tests.test_conformance import build, run

    calls = []
    real = ss.train_supervised

    def spy(model, data, **kw):
        calls.append((kw["steps"], kw["lr_fn"](0)))
        return real(model, data, **kw)

    monkeypatch.setattr(ss, "train_supervised", spy)
    s, grid = build("ssfl", **{"ssfl.warm-start-steps": 7, "lr": 0.03})
    s.setup(grid)
    sent = []
    handler = grid.handler
    grid.handler = lambda m, c: sent.append(m.content.array_records["arrays"]) or handler(m, c)
    before = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
    res, rows = run(s, grid, rounds=2)
    assert calls[0] == (7, 0.03)                       # the warm start, then the server's periods
    assert [c[0] for c in calls[1:]] == [s.period, s.period]
    assert "warm-accuracy" in rows[0] and 0.0 <= rows[0]["warm-accuracy"] <= 1.0 and "warm-accuracy" not in rows[1]
    w = next(iter(sent[0].keys()))
    assert not np.array_equal(sent[0][w].numpy(), before[w].numpy())  # users got the warm model
    s2, grid2 = build("ssfl")
    calls.clear()
    run(s2, grid2, rounds=1)
    assert [c[0] for c in calls] == [s2.period]        # cold: no extra server steps


def test_round_reports_the_per_class_histogram_of_confident_pseudo_labels(monkeypatch):
    """The round's ``pseudo-hist`` sums the consenting users' histograms over all classes (a class's
    onset is its first round with a count > 0) and ``pseudo-classes`` counts the non-empty ones."""
    from tests.test_conformance import build, run

    monkeypatch.setenv("FLOWER_SSL_SHARE_LABEL_METRICS", "1")
    s, grid = build("ssfl", **{"ssfl.tau": 0.0})        # every pseudo-label confident
    res, rows = run(s, grid, rounds=1)
    (m,) = rows
    assert len(m["pseudo-hist"]) == s.env.num_classes
    assert sum(m["pseudo-hist"]) == pytest.approx(m["mask-rate"] * s.period * s.task.batch_size * m["participants"])
    assert m["pseudo-classes"] == sum(v > 0 for v in m["pseudo-hist"])
    assert m["pseudo-main-class"] == int(np.argmax(m["pseudo-hist"]))


@pytest.mark.parametrize("groups", [1, 2])
def test_users_folded_in_any_arrival_order_equal_the_stacked_rules(groups):
    """The round folds each user as its reply arrives: in any order, the server and
    group models and the diversity equal Eq. 5 / Eq. 6 and Eq. 7 on the stacked users."""
    from strategies.ssfl.ssfl import UsersFold
    from tasks.aggregate import grouped_average, mean_including_server, state_delta, weight_diversity

    rng = np.random.default_rng(5)
    users = {n: _rand_params(_strategy(groups), rng) for n in (3, 1, 4, 2, 5)}
    sent = {n: (n % groups) for n in users}
    got = []
    for order in (sorted(users), [5, 3, 1, 4, 2]):
        s = _strategy(groups)
        s.group_params = [_rand_params(s, np.random.default_rng(9 + g)) for g in range(groups)]
        base = [dict(g) for g in s.group_params]
        ws = _rand_params(s, np.random.default_rng(7))
        _set_server(s, ws)
        fold = UsersFold(s, sent)
        for n in order:
            fold.add(n, users[n])
        got.append((fold.finish(), _server_now(s), s.group_params))
    nodes = sorted(users)
    if groups == 1:
        ref_avg = mean_including_server(ws, [users[n] for n in nodes], keys=s.keys)
        ref_groups = [ref_avg]
    else:
        ref_avg, ref_groups = grouped_average(ws, users, [[n for n in nodes if sent[n] == g] for g in range(groups)],
                                              keys=s.keys)
    ref_div = weight_diversity([state_delta(users[n], base[sent[n]], keys=s.classifier_keys) for n in nodes])
    for mets, server, group_params in got:
        assert mets["weight-diversity"] == pytest.approx(ref_div, rel=1e-12)
        for k in s.keys:
            np.testing.assert_allclose(server[k], ref_avg[k], rtol=1e-12)
            for g in range(groups):
                np.testing.assert_allclose(group_params[g][k], ref_groups[g][k], rtol=1e-12)
