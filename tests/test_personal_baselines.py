"""UM-pFSSL's Table 1 baseline rows (strategies/umpfssl/fedbn.py, lgfedavg.py, pfedme.py,
supervised_refs.py; the modes' client in strategies/umpfssl/fixmatch_baselines.py): each defining rule
against a hand computation or an independent numpy formula. The conformance matrix runs every
name under every condition (tests/test_conformance.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from split_layer.transport import LocalGrid
from tasks.config import ConfigError
from tasks.umpfssl.pfedme_update import moreau_inner_steps, moreau_outer_step


def _round(algo: str, rounds: int = 1, **over):
    """``rounds`` rounds of ``algo`` on the conformance matrix's tiny setup (4 nodes, all
    sampled, BatchNorm MLP), with every reply recorded."""
    from flower_apps.client_app import dispatch
    from tests.test_conformance import build

    s, grid = build(algo, **over)
    replies = []
    grid.handler = lambda msg, ctx: replies.append((ctx, dispatch(msg, ctx))) or replies[-1][1]
    s.setup(grid)
    init = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
    s.start(grid, num_rounds=rounds)
    return s, grid, init, [(c, r) for c, r in replies if r.metadata.message_type == "train"]


def _np(rec) -> dict[str, np.ndarray]:
    return {k: rec[k].numpy() for k in rec.keys()}


# ----------------------------------------------------------------------------------- FedBN
def test_fedbn_keeps_every_batchnorm_entry_on_its_node_and_averages_the_rest_uniformly():
    from strategies.umpfssl.fixmatch_baselines import STATE_BN, batchnorm_keys

    s, grid, init, replies = _round("fixbn")
    bn = set(batchnorm_keys(s.model))
    assert bn and any(k.endswith("running_mean") for k in bn) and any(k.endswith("num_batches_tracked") for k in bn)
    ups = [_np(r.content.array_records["arrays"]) for _, r in replies]
    n_k = [float(r.content.metric_records["metrics"]["num-examples"]) for _, r in replies]
    assert len(ups) == 4
    for up in ups:                                       # no BN entry leaves a node
        assert set(up) == set(s.model.state_dict()) - bn
    # every down message: no BN entry either
    assert all(not (set(m.content.array_records["arrays"].keys()) & bn) for m in grid.sent
               if "arrays" in m.content.array_records)
    got = {k: v.cpu().numpy() for k, v in s.model.state_dict().items()}
    for k in ups[0]:
        uniform = sum(u[k].astype(np.float64) for u in ups) / len(ups)
        weighted = sum(w * u[k].astype(np.float64) for w, u in zip(n_k, ups)) / sum(n_k)
        np.testing.assert_allclose(got[k], uniform, rtol=1e-5, atol=1e-6, err_msg=k)
        if not np.allclose(uniform, weighted, atol=1e-7):
            assert not np.allclose(got[k], weighted, atol=1e-7)
    for k in bn:                                          # the server's BN: still the initial one
        torch.testing.assert_close(s.model.state_dict()[k], init[k])
    # each node holds its own BN: trained (moved off the initial values), different per node
    mine = [_np(ctx.state.array_records[STATE_BN]) for ctx, _ in replies]
    assert all(set(m) == bn for m in mine)
    rm = next(k for k in bn if k.endswith("running_mean"))
    assert all(not np.allclose(m[rm], init[rm].numpy()) for m in mine)
    assert not np.allclose(mine[0][rm], mine[1][rm])


@pytest.mark.parametrize("algo, uniform", [("fixbn", True), ("lg-fedavg-fix", True), ("fixavg", False),
                                           ("fedavg-sl", False)])
def test_fedbn_and_lg_average_uniformly_fedavg_by_nk(algo, uniform):
    """Two uploads with n_k = 1 and 3: FedBN and LG-FedAvg take (a + b) / 2 (their code),
    FedAvg (a + 3 b) / 4."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from strategies.core.records import numpy_to_record
    from strategies.registry import get_algorithm

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    cls = get_algorithm(algo).strategy_cls
    s = cls(model=net, test_data=(np.zeros((4, 1, 2, 2), np.uint8), np.arange(4) % 2), algo=algo, min_nodes=2)
    keys = list(s.global_arrays().keys())
    a = {k: np.full(net.state_dict()[k].shape, 1.0, np.float32) for k in keys}
    b = {k: np.full(net.state_dict()[k].shape, 5.0, np.float32) for k in keys}
    replies = [Message(RecordDict({"arrays": numpy_to_record(st), "config": ConfigRecord({}),
                                   "metrics": MetricRecord({"num-examples": n, "train-loss": 0.0, "mask-rate": 0.0})}),
                       dst_node_id=1, message_type="train") for st, n in ((a, 1.0), (b, 3.0))]
    arrays, _ = s.aggregate_train(1, replies)
    want = 3.0 if uniform else 4.0
    for k in keys:
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_allclose(arrays[k].numpy(), want, err_msg=k)


def test_fedbn_round_two_starts_from_the_nodes_own_bn():
    """Round 2's training starts from the shared entries the server sent plus the node's own
    BN of round 1 (load_personal), not the server's."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from strategies.core.records import model_to_record
    from strategies.umpfssl.fixmatch_baselines import STATE_BN, batchnorm_keys, load_personal

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    bn = batchnorm_keys(model)
    assert bn == ["1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    other = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        other[1].running_mean.fill_(7.0)
        other[1].weight.fill_(3.0)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    ctx.state[STATE_BN] = model_to_record(other, bn)                  # the node's own BN
    shared = [k for k in model.state_dict() if k not in bn]
    msg = Message(RecordDict({"arrays": model_to_record(model, shared), "config": ConfigRecord({})}),
                  dst_node_id=1, message_type="train")
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    load_personal(fresh, msg, ctx, STATE_BN)
    for k in shared:
        torch.testing.assert_close(fresh.state_dict()[k], model.state_dict()[k])
    assert torch.all(fresh[1].running_mean == 7.0) and torch.all(fresh[1].weight == 3.0)


def test_fedbn_refuses_a_model_without_batchnorm():
    from strategies.umpfssl.fedbn import FixBNStrategy

    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    x = np.zeros((6, 1, 4, 4), np.uint8)
    with pytest.raises(ConfigError, match="BatchNorm"):
        FixBNStrategy(model=net, test_data=(x, np.arange(6) % 3))


# ----------------------------------------------------------------------------------- LG-FedAvg
def test_lg_fedavg_uploads_only_the_head_and_keeps_the_body():
    from strategies.umpfssl.fixmatch_baselines import STATE_BODY
    from strategies.umpfssl.fixmatch_baselines import head_keys

    s, grid, init, replies = _round("lg-fedavg-fix")
    head = set(head_keys(s.model))
    body = set(s.model.state_dict()) - head
    assert head == {"stages.head.0.weight", "stages.head.0.bias"}
    ups = [_np(r.content.array_records["arrays"]) for _, r in replies]
    assert len(ups) == 4 and all(set(u) == head for u in ups)       # only the head travels up
    got = s.model.state_dict()
    for k in head:                                                   # uniform mean of the heads
        np.testing.assert_allclose(got[k].numpy(), sum(u[k] for u in ups) / 4, rtol=1e-5, atol=1e-6)
    for k in body:                                                   # the server's body: the initial one
        torch.testing.assert_close(got[k], init[k])
    bodies = [_np(ctx.state.array_records[STATE_BODY]) for ctx, _ in replies]
    w = "stages.fc1.1.weight"
    assert all(set(b) == body for b in bodies)
    assert all(not np.allclose(b[w], init[w].numpy()) for b in bodies)   # the whole model trained
    assert not np.allclose(bodies[0][w], bodies[1][w])


@pytest.mark.parametrize("name", ["cnn", "resnet9"])
def test_lg_fedavg_global_layers_head_or_the_codes_convolutions_on_the_rows_models(name):
    """``lgfedavg.global-layers``: ``head`` (the paper's text) makes only the final linear
    layer global; ``convolutions`` (the code's CIFAR-10 choice, Nets.py's reversed weight_keys
    with num_layers_keep 2) makes every layer before the first nn.Linear global (convolutions and
    their BatchNorm) and every fully-connected layer local; on the rows' models (cnn, resnet9)."""
    from strategies.umpfssl.lgfedavg import LGFedAvgConfig, LGFedAvgTrainer
    from tasks.models import build_model

    model = build_model(name, in_channels=1, num_classes=10, image_size=28, norm="bn", dropout=0.5)
    keys = list(model.state_dict())
    linear = {f"{n}.{e}" for n, m in model.named_modules() if isinstance(m, nn.Linear) for e in m.state_dict()}
    last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    t = LGFedAvgTrainer()
    local_head = t.local_keys(model, LGFedAvgConfig(global_layers="head"))
    assert set(keys) - set(local_head) == {f"{last}.weight", f"{last}.bias"}
    assert t.local_keys(model, None) == local_head                    # the default: the paper's text
    local_conv = t.local_keys(model, LGFedAvgConfig(global_layers="convolutions"))
    glob = set(keys) - set(local_conv)
    assert set(local_conv) == linear                                   # every fully-connected layer local
    conv_bn = {f"{n}.{e}" for n, m in model.named_modules()
               if isinstance(m, (nn.Conv2d, nn.BatchNorm2d)) for e in m.state_dict()}
    assert glob == conv_bn and any(k.endswith("running_mean") for k in glob)
    if name == "cnn":
        assert len(linear) == 4 and all(k.startswith(("stages.fc1.", "stages.head.")) for k in linear)


def test_lg_fedavg_convolutions_refused_on_a_model_without_convolutions():
    from strategies.umpfssl.lgfedavg import LGFedAvgConfig, LGFedAvgTrainer

    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(ConfigError, match="lgfedavg.global-layers='convolutions'.*has none"):
        LGFedAvgTrainer().local_keys(net, LGFedAvgConfig(global_layers="convolutions"))
    from flower_apps.config import parse_run_config
    from tests.test_config import pyproject_config

    with pytest.raises(ConfigError, match="lgfedavg.global-layers='fc' is not one of: head, convolutions"):
        parse_run_config({**pyproject_config(), "algo": "lg-fedavg-fix", "lgfedavg.global-layers": "fc"})


def test_lg_fedavg_convolutions_round_averages_the_convolutions_and_keeps_the_fc_layers():
    """One round with ``lgfedavg.global-layers=convolutions`` on the cnn: only the convolutional
    entries travel, down and up; the server's are their uniform mean, its fully-connected layers
    stay the initial ones; each node keeps its own trained fully-connected layers."""
    from strategies.umpfssl.fixmatch_baselines import STATE_BODY

    s, grid, init, replies = _round("lg-fedavg-fix", **{"model": "cnn", "lgfedavg.global-layers": "convolutions"})
    conv = {k for k in s.model.state_dict() if k.startswith(("stages.conv1.", "stages.conv2."))}
    fc = set(s.model.state_dict()) - conv
    assert fc == {"stages.fc1.1.weight", "stages.fc1.1.bias", "stages.head.0.weight", "stages.head.0.bias"}
    ups = [_np(r.content.array_records["arrays"]) for _, r in replies]
    assert len(ups) == 4 and all(set(u) == conv for u in ups)        # only the convolutions travel up
    assert all(set(m.content.array_records["arrays"].keys()) <= conv for m in grid.sent
               if "arrays" in m.content.array_records and m.metadata.message_type == "train")
    got = s.model.state_dict()
    for k in conv:
        if not k.endswith("num_batches_tracked"):
            np.testing.assert_allclose(got[k].numpy(), sum(u[k] for u in ups) / 4, rtol=1e-5, atol=1e-6, err_msg=k)
    for k in fc:                                                     # the server's fc layers: the initial ones
        torch.testing.assert_close(got[k], init[k])
    bodies = [_np(ctx.state.array_records[STATE_BODY]) for ctx, _ in replies]
    assert all(set(b) == fc for b in bodies)
    w = "stages.fc1.1.weight"
    assert all(not np.allclose(b[w], init[w].numpy()) for b in bodies)
    assert not np.allclose(bodies[0][w], bodies[1][w])


# ----------------------------------------------------------------------------------- pFedMe
def test_pfedme_inner_and_outer_steps_match_a_hand_computation():
    """f(theta) = 1/2 (theta . x - y)^2 on a 2-weight linear model; K = 2 inner steps of
    theta <- theta - plr (grad f + lambda (theta - w) + wd theta), then w <- w - eta lambda (w - theta)."""
    theta = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        theta.weight.copy_(torch.tensor([[0.5, -1.0]]))
    w = torch.tensor([[0.2, 0.3]])
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0]])
    lam, plr, eta, wd = 15.0, 0.01, 0.05, 0.1

    def loss_fn():
        return 0.5 * ((theta(x) - y) ** 2).sum()

    one = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        one.weight.copy_(theta.weight)
    moreau_inner_steps(one, [w], lambda: 0.5 * ((one(x) - y) ** 2).sum(), lam=lam, steps=1, lr=plr, weight_decay=wd)
    # by hand: theta.x - y = -2.5, grad f = (-2.5, -5), lambda (theta - w) = (4.5, -19.5),
    # wd theta = (0.05, -0.1): theta_1 = (0.5, -1) - 0.01 (2.05, -24.6) = (0.4795, -0.754)
    np.testing.assert_allclose(one.weight.detach().cpu().numpy()[0], [0.4795, -0.754], rtol=1e-6)
    moreau_inner_steps(theta, [w], loss_fn, lam=lam, steps=2, lr=plr, weight_decay=wd)
    th, wv, xv = np.array([0.5, -1.0]), np.array([0.2, 0.3]), np.array([1.0, 2.0])
    for _ in range(2):
        grad = (th @ xv - 1.0) * xv
        th = th - plr * (grad + lam * (th - wv) + wd * th)
    np.testing.assert_allclose(theta.weight.detach().cpu().numpy()[0], th, rtol=1e-6)
    np.testing.assert_allclose(w.numpy()[0], wv)                     # the anchor does not move in the inner steps
    moreau_outer_step([w], theta, lam=lam, eta=eta)
    np.testing.assert_allclose(w.numpy()[0], wv - eta * lam * (wv - th), rtol=1e-6)


def test_pfedme_with_lambda_large_theta_stays_at_w_and_server_beta_mixes():
    """The proximal pull: a huge lambda (with plr lambda < 1) keeps theta near w; the server's
    beta: w <- (1 - beta) w + beta * mean, checked on a user's model."""
    from strategies.umpfssl.pfedme import PFedMeStrategy

    theta = nn.Linear(2, 1, bias=False)
    w = theta.weight.detach().clone()
    x, y = torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0]])
    moreau_inner_steps(theta, [w], lambda: 0.5 * ((theta(x) - y) ** 2).sum(), lam=1e4, steps=5, lr=5e-5)
    assert float((theta.weight.detach() - w).abs().max()) < 2e-3

    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    xs = np.zeros((6, 1, 2, 2), np.uint8)
    s = PFedMeStrategy(model=net, test_data=(xs, np.arange(6) % 3), beta=0.5)
    cur = {k: v.detach().cpu().numpy().copy() for k, v in s.model.state_dict().items()}
    mean = {k: np.ones_like(v) for k, v in cur.items()}
    s.load_aggregate(mean)
    for k, v in s.model.state_dict().items():
        np.testing.assert_allclose(v.cpu().numpy(), 0.5 * cur[k] + 0.5, rtol=1e-6)


def test_pfedme_round_runs_and_the_server_is_the_nk_weighted_mean():
    s, grid, init, replies = _round("pfedme-fix")
    ups = [_np(r.content.array_records["arrays"]) for _, r in replies]
    n_k = [float(r.content.metric_records["metrics"]["num-examples"]) for _, r in replies]
    got = {k: v.cpu().numpy() for k, v in s.model.state_dict().items()}
    k = "stages.head.0.weight"
    np.testing.assert_allclose(got[k], sum(w * u[k] for w, u in zip(n_k, ups)) / sum(n_k), rtol=1e-5, atol=1e-7)
    assert not np.allclose(got[k], init[k].numpy())


def _pfedme_run(monkeypatch, eval_model: str, rounds: int = 1):
    """pfedme-fix on a user's linear model over 2 nodes (both sampled, ``rounds`` rounds):
    6 labeled 4x4 images per node in one batch (batch 8), 2 local steps, lambda_u = 0 (f_k is
    the labeled CE; 4x4 images get no translation, no flip: the weak view is the
    normalisation). Returns the strategy's result, each evaluated model's state by partition,
    the uploads, the nodes' data and the initial weights."""
    import strategies.umpfssl.pfedme as pm

    evaluated: dict[int, dict[str, torch.Tensor]] = {}
    real = pm.evaluate_on_own_test

    def spy(msg, env, model):
        evaluated[env.partition_id] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return real(msg, env, model)

    monkeypatch.setattr(pm, "evaluate_on_own_test", spy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    data = {p: {"labeled": _sets(p, 6), "unlabeled": _sets(30 + p, 4)[0], "test": _sets(40 + p, 9)} for p in (0, 1)}
    uploads: dict[int, dict[str, np.ndarray]] = {}

    client = pm.PFedMeClient(net, lambda ctx: data[int(ctx.node_config["partition-id"])])

    def handle(msg, ctx):
        out = client.handle(msg, ctx)
        if msg.metadata.message_type == "train":
            uploads[int(ctx.node_config["partition-id"])] = _np(out.content.array_records["arrays"])
        return out

    s = pm.PFedMeStrategy(model=net, test_data=_sets(9, 6), local_steps=2, batch_size=8, lr=0.05,
                          weight_decay=0.01, min_nodes=2, lambda_u=0.0, lamda=3.0, inner_steps=2,
                          personal_lr=0.1, eval_model=eval_model)
    res = s.start(LocalGrid(2, handle), num_rounds=rounds)
    return res, evaluated, uploads, data, init


def _norm(x: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(x).float() / 255.0 - 0.5) / 0.5      # the augmenter's weak = test view here


def _theta_steps(theta: list[torch.Tensor], w: list[torch.Tensor], x, y, *, lam, plr, wd, k) -> list[torch.Tensor]:
    """K plain steps theta <- theta - plr (grad CE + lam (theta - w) + wd theta), by hand."""
    for _ in range(k):
        th = [t.clone().requires_grad_(True) for t in theta]
        loss = torch.nn.functional.cross_entropy(_norm(x).flatten(1) @ th[0].T + th[1], torch.from_numpy(y))
        g = torch.autograd.grad(loss, th)
        theta = [t - plr * (gi + lam * (t - wi) + wd * t) for t, gi, wi in zip(theta, g, w)]
    return [t.detach() for t in theta]


def _acc(params: list[torch.Tensor], test) -> float:
    x, y = test
    return float(((_norm(x).flatten(1) @ params[0].T + params[1]).argmax(1).numpy() == y).mean())


def test_pfedme_evaluates_wk_after_the_local_rounds_as_the_code(monkeypatch):
    """Default ``pfedme.eval-model=local`` (the code: userpFedMe.py binds the "personalised"
    list to the model's parameters and overwrites it with w_k): each node's evaluated model is
    w_k after its local rounds from the round's w, by hand (2 local steps of K = 2 inner steps,
    then w_k <- w_k - eta lambda (w_k - theta)), bit for bit the w_k it uploaded, and the
    reported accuracies are w_k's on each node's own test split. Not the aggregated w, not theta."""
    res, evaluated, uploads, data, init = _pfedme_run(monkeypatch, "local")
    keys = ["1.weight", "1.bias"]
    w0 = [init[k] for k in keys]
    accs = []
    for p in (0, 1):
        (x, y), wk, theta = data[p]["labeled"], [t.clone() for t in w0], [t.clone() for t in w0]
        for _ in range(2):                                            # R = 2 local steps
            theta = _theta_steps(theta, wk, x, y, lam=3.0, plr=0.1, wd=0.01, k=2)
            wk = [w - 0.05 * 3.0 * (w - t) for w, t in zip(wk, theta)]
        for k, want in zip(keys, wk):
            np.testing.assert_allclose(evaluated[p][k].numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(evaluated[p][k].numpy(), uploads[p][k])   # the w_k it uploaded
            assert not np.allclose(evaluated[p][k].numpy(), theta[keys.index(k)].numpy(), atol=1e-4)
            assert not np.allclose(evaluated[p][k].numpy(), res.arrays[k].numpy(), atol=1e-4)   # not the new w
        accs.append(_acc(wk, data[p]["test"]))
    got = res.evaluate_metrics_clientapp[1]
    assert list(got["client-accuracies"]) == pytest.approx(accs)
    assert got["accuracy"] == pytest.approx(np.mean(accs))


def test_pfedme_eval_model_theta_evaluates_theta_fitted_from_the_current_w(monkeypatch):
    """``pfedme.eval-model=theta``: theta_k fitted from the current (aggregated) w by K = 2
    inner steps at ``pfedme.personal-lr`` on one batch of the node's data, by hand; not w_k."""
    res, evaluated, uploads, data, init = _pfedme_run(monkeypatch, "theta")
    keys = ["1.weight", "1.bias"]
    w = [torch.from_numpy(res.arrays[k].numpy().copy()) for k in keys]
    n = {p: 10.0 for p in (0, 1)}                                      # |D^s| + |D^u| = 6 + 4 each
    want_w = [sum(n[p] * uploads[p][k] for p in (0, 1)) / sum(n.values()) for k in keys]
    for got, want in zip(w, want_w):                                   # the current w: the aggregate
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    accs = []
    for p in (0, 1):
        x, y = data[p]["labeled"]
        theta = _theta_steps([t.clone() for t in w], w, x, y, lam=3.0, plr=0.1, wd=0.01, k=2)
        for k, want in zip(keys, theta):
            np.testing.assert_allclose(evaluated[p][k].numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
            assert not np.allclose(evaluated[p][k].numpy(), uploads[p][k], atol=1e-4)
        accs.append(_acc(theta, data[p]["test"]))
    assert list(res.evaluate_metrics_clientapp[1]["client-accuracies"]) == pytest.approx(accs)


def test_pfedme_eval_model_is_checked():
    from tasks.config import ConfigError as CE
    from flower_apps.config import parse_run_config
    from tests.test_config import pyproject_config

    with pytest.raises(CE, match="pfedme.eval-model='w' is not one of: local, theta"):
        parse_run_config({**pyproject_config(), "algo": "pfedme-fix", "pfedme.eval-model": "w"})


# ----------------------------------------------------------------------------------- *-SL
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU())
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def _sets(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, n)


def _sl_run(data_of, algo="fedavg-sl"):
    from strategies.umpfssl.supervised_refs import FedAvgSLClient, FedAvgSLStrategy, FedProxSLStrategy

    cls = {"fedavg-sl": FedAvgSLStrategy, "fedprox-sl": FedProxSLStrategy}[algo]
    torch.manual_seed(0)
    net = _Tiny()
    client = FedAvgSLClient(net, lambda ctx: data_of(int(ctx.node_config["partition-id"])))
    s = cls(model=net, test_data=_sets(9, 12), local_steps=3, batch_size=4, lr=0.1, min_nodes=2)
    res = s.start(LocalGrid(2, client.handle), num_rounds=1)
    return _np(res.arrays)


@pytest.mark.parametrize("algo", ["fedavg-sl", "fedprox-sl"])
def test_sl_trains_on_the_unlabeled_splits_true_labels(algo):
    """A node with labeled L and unlabeled U (labels y_U) trains exactly as a node whose labeled
    set is L + U: the union with U's true labels; other labels for U give other weights."""
    lab = {p: _sets(p, 5) for p in (0, 1)}
    unl = {p: _sets(10 + p, 7) for p in (0, 1)}
    test = _sets(20, 6)
    split = _sl_run(lambda p: {"labeled": lab[p], "unlabeled": unl[p], "test": test}, algo)
    union = _sl_run(lambda p: {"labeled": (np.concatenate([lab[p][0], unl[p][0]]),
                                           np.concatenate([lab[p][1], unl[p][1]])), "test": test}, algo)
    flipped = _sl_run(lambda p: {"labeled": lab[p], "unlabeled": (unl[p][0], (unl[p][1] + 1) % 3),
                                 "test": test}, algo)
    for k in split:
        np.testing.assert_array_equal(split[k], union[k], err_msg=k)
    assert any(not np.allclose(split[k], flipped[k]) for k in split)


def test_sl_refuses_unlabeled_images_without_labels():
    from strategies.umpfssl.fixmatch_baselines import fully_labeled
    from tasks.env import Env, NodeData
    from tasks.config import TaskConfig

    env = Env(task=TaskConfig(), device=torch.device("cpu"), augmenter=None, num_classes=3, model_fn=_Tiny,
              data=NodeData.of(labeled=_sets(0, 4), unlabeled=_sets(1, 4)[0]))
    with pytest.raises(ConfigError, match="unknown labels"):
        fully_labeled(env)


def test_sl_on_the_librarys_data_uses_the_plans_hidden_labels(monkeypatch):
    """fedbn-sl through the library's app: the data each node trains on is its labeled split
    plus its unlabeled split with the plan's true labels, n_k = both."""
    import strategies.umpfssl.fixmatch_baselines as fb

    seen = []
    real = fb.train_supervised

    def spy(model, data, **kw):
        seen.append(data)
        return real(model, data, **kw)

    monkeypatch.setattr(fb, "train_supervised", spy)
    s, grid, init, replies = _round("fedbn-sl")
    from tasks.env import library_env

    by_pid = {int(r.content.metric_records["metrics"]["partition-id"]): r for _, r in replies}
    assert len(seen) == 4 == len(by_pid)
    for pid in by_pid:
        env = library_env(s.task, 4, "dir2", True, pid)
        lab, unl = env.labeled(), env.unlabeled()
        assert len(unl) > 0 and unl.labels_known
        want_y = np.concatenate([lab.y, unl.y])
        assert any(len(d) == len(want_y) and np.array_equal(d.y, want_y) for d in seen)
        assert float(by_pid[pid].content.metric_records["metrics"]["num-examples"]) == len(lab) + len(unl)
