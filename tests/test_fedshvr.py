"""Fed-SHVR (strategies/fedshvr/fedshvr.py): the reconstructed [D] formulas, checked numerically
through the strategy's own rule functions, and its server + client driven in-process by a
fake Grid (no Ray). The closed form itself, FedNova and the correction primitive are
tested in test_losses.py / test_aggregate.py; here they are checked as the strategy uses them.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from strategies.core.records import (
    CONFIG_KEY,
    record_to_numpy,
)
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.fedshvr import fedshvr as fs
from strategies.registry import get_algorithm
from tasks.aggregate import fednova_aggregate, vr_correction_update, weighted_mean
from tasks.config import ConfigError, TaskConfig
from tasks.env import library_env
from tests.faulty_grid import inject_failures
from tests.test_losses import _numerical_soft_label

TASK = TaskConfig(model="mlp", norm="none", lr=0.01, momentum=0.0, local_epochs=1, partition="dirichlet",
                  partition_mismatch_ratio=0.5, partition_labeled_per_client=30, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is shared; tiny MLP steps are faster single-threaded
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- formulas
def test_soft_labels_are_the_simplex_minimiser_with_the_ramped_alpha0():
    cfg = get_algorithm("fedshvr").parse_config({})
    # ramp: e = E t local epochs, full weight after 50 epochs, exp(-5 (1 - e/50)^2) before
    assert fs.alpha0_at(cfg, 25, 2) == pytest.approx(1.0)
    assert fs.alpha0_at(cfg, 40, 2) == pytest.approx(1.0)
    assert fs.alpha0_at(cfg, 5, 2) == pytest.approx(math.exp(-5 * 0.8 ** 2))
    assert fs.alpha0_at(get_algorithm("fedshvr").parse_config({"fedshvr.rampup-epochs": 0.0}), 1, 2) == 1.0
    env = library_env(TASK, 3, "mismatch")
    model = env.build_model()
    data = env.bundle.train.subset(env.plan.clients[0].unlabeled[:4])
    for t in (3, 25):
        a0 = fs.alpha0_at(cfg, t, 2)
        v, p = fs.soft_pseudo_labels(model, data, env.augmenter, a0, cfg.alpha1, env.device)
        for i in range(len(data)):
            v_num = _numerical_soft_label(p[i].double().cpu().numpy(), a0, cfg.alpha1)
            np.testing.assert_allclose(v[i].double().cpu().numpy(), v_num, atol=2e-5)
    # fed-pseudo / no-r1: alpha1 = 0 -> hard one-hot labels
    v0, p0 = fs.soft_pseudo_labels(model, data, env.augmenter, 1.0, 0.0, env.device)
    assert torch.equal(v0.argmax(1), p0.argmax(1)) and torch.all(v0.max(1).values == 1.0)


def test_carry_form_equals_the_reference_correction_update():
    rng = np.random.default_rng(0)
    keys = ("w", "b")
    mk = lambda: {k: rng.normal(size=(3, 2) if k == "w" else 2) for k in keys}  # noqa: E731
    d_prev, prev, fin, new = mk(), mk(), mk(), mk()
    tau_k, tau, lr = 7.0, 11.5, 0.01
    ref = vr_correction_update(d_prev, prev, fin, new, tau_k, tau, lr)
    ours = fs.correction_from_carry(fs.carry_after_round(d_prev, prev, fin, tau_k, lr), prev, new, tau, lr)
    for k in keys:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-12)
    ref0 = vr_correction_update(None, prev, fin, new, tau_k, tau, lr)
    ours0 = fs.correction_from_carry(fs.carry_after_round(None, prev, fin, tau_k, lr), prev, new, tau, lr)
    np.testing.assert_allclose(ours0["w"], ref0["w"], rtol=1e-12)


def test_server_update_rules():
    rng = np.random.default_rng(1)
    prev = {"w": rng.normal(size=(2, 2)), "rm": np.zeros(2)}
    ups = [{k: v + rng.normal(size=v.shape) for k, v in prev.items()} for _ in range(3)]
    taus, om = [3, 9, 5], [1.0, 2.0, 5.0]
    new, tau = fs.server_update(prev, ups, taus, om, normalized=True, param_keys=["w"])
    w = np.array(om) / 8
    assert tau == pytest.approx(float(np.sum(w * taus)))
    np.testing.assert_allclose(new["w"], fednova_aggregate(prev, ups, taus, w, keys=["w"], mean_keys=["rm"])["w"])
    np.testing.assert_allclose(new["rm"], weighted_mean(ups, w)["rm"])  # buffers: plain mean
    plain, _ = fs.server_update(prev, ups, taus, om, normalized=False, param_keys=["w"])
    np.testing.assert_allclose(plain["w"], weighted_mean(ups, w)["w"])
    # equal tau_k: FedNova == omega-weighted FedAvg
    eq, _ = fs.server_update(prev, ups, [4, 4, 4], om, normalized=True, param_keys=["w"])
    np.testing.assert_allclose(eq["w"], plain["w"], rtol=1e-12)


def test_corrected_step_is_theta_minus_eta_g_minus_d():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).double()
    before = {k: v.detach().clone() for k, v in lin.named_parameters()}
    d = {k: torch.randn_like(v) for k, v in before.items()}
    loss = lin(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum()
    loss.backward()
    g = {k: p.grad.detach().clone() for k, p in lin.named_parameters()}
    fs.corrected_step(lin, torch.optim.SGD(lin.parameters(), lr=0.1), d)
    for k, p in lin.named_parameters():
        torch.testing.assert_close(p.detach(), before[k] - 0.1 * (g[k] - d[k]))


def _toy(correction: bool, normalized: bool, rounds: int = 60) -> float:
    """Quadratic toy run through the strategy's own rules: f_k = a_k/2 ||x - b_k||^2,
    heterogeneous tau_k, full-batch gradients, local steps by ``corrected_step`` on torch SGD."""
    rng = np.random.default_rng(0)
    a = np.array([1.0, 2.0, 4.0])
    b = rng.normal(size=(3, 2)) * 3.0
    taus, om, eta = [2, 5, 10], np.array([0.2, 0.3, 0.5]), 0.1
    x_star = (om[:, None] * a[:, None] * b).sum(0) / (om * a).sum()
    glob = {"x": np.zeros(2)}
    ups = [{"x": glob["x"].copy()} for _ in range(3)]  # theta_k^{0,tau_k} = theta^0
    carry = [None] * 3
    for _ in range(rounds):
        new, tau = fs.server_update(glob, ups, taus, om, normalized=normalized)
        for k in range(3):
            d = None
            if correction and carry[k] is not None:
                d = fs.correction_from_carry(carry[k], glob, new, tau, eta)
            model = torch.nn.Module()
            model.x = torch.nn.Parameter(torch.tensor(new["x"], dtype=torch.float64))
            opt = torch.optim.SGD(model.parameters(), lr=eta)
            dt = None if d is None else {"x": torch.tensor(d["x"])}
            for _ in range(taus[k]):
                opt.zero_grad()
                (0.5 * a[k] * ((model.x - torch.tensor(b[k])) ** 2).sum()).backward()
                fs.corrected_step(model, opt, dt)
            ups[k] = {"x": model.x.detach().cpu().numpy().copy()}
            if correction:
                carry[k] = fs.carry_after_round(d, new, ups[k], taus[k], eta)
        glob = new
    return float(np.linalg.norm(glob["x"] - x_star))


def test_quadratic_toy_only_the_full_rule_is_unbiased():
    assert _toy(correction=True, normalized=True) < 1e-8          # Fed-SHVR
    assert _toy(correction=False, normalized=False) > 1e-2        # FedAvg
    assert _toy(correction=False, normalized=True) > 1e-2         # FedNova only
    assert _toy(correction=True, normalized=False) > 1e-2         # VRL-SGD only


def test_tau_k_formula_and_config_errors():
    cfg = get_algorithm("fedshvr").parse_config({})
    task = TaskConfig(local_epochs=2, batch_size=32)
    assert fs.num_steps(task, cfg, 60, 5940) == math.ceil(5940 * 2 / 32) == 372  # paper: ~371 IID
    assert fs.num_steps(task, cfg, 60, 10) == math.ceil(60 * 2 / 32)
    assert fs.num_steps(task, get_algorithm("fed-sl").parse_config({}), 60, 5940) == 4  # labeled only
    # fed-sl at the semi-supervised rows' step count: as many steps, cycling its 60 labels
    assert fs.num_steps(task, get_algorithm("fed-sl").parse_config({"fedshvr.steps": "matched"}), 60, 5940) == 372
    assert fs.num_steps(TaskConfig(local_steps=7), cfg, 60, 5940) == 7
    for bad, needle in [({"fedshvr.unsup-loss": "mixmatch"}, "fedshvr.unsup-loss='mixmatch' is not one of"),
                        ({"fedshvr.alpha1": -0.1}, "fedshvr.alpha1=-0.1 is out of range"),
                        ({"fedshvr.ema-decay": 1.5}, "fedshvr.ema-decay=1.5 is out of range"),
                        ({"fedshvr.alpah2": 0.1}, "unknown run-config key 'fedshvr.alpah2'")]:
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            get_algorithm("fedshvr").parse_config(bad)
    fp = get_algorithm("fed-pseudo").parse_config({})
    assert (fp.alpha1, fp.alpha2, fp.correction, fp.normalized_averaging) == (0.0, 0.0, False, False)
    assert get_algorithm("fedshvr-no-nova").parse_config({}).correction is True


# --------------------------------------------------------------------------- in-process server + clients
def fail_at(fail):
    """``inject_failures``' ``fail_if`` for a set of (round, partition-id): those replies are errors (dropped clients)."""
    fail = set(fail)
    return lambda m, ctx: (int(m.content.config_records[CONFIG_KEY]["server-round"]),
                           int(ctx.node_config["partition-id"])) in fail


@pytest.fixture()
def task_identity():
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    yield


def _run(algo: str, rounds: int, fail=(), fraction: float = 1.0, num_nodes: int = 3, task=TASK):
    spec = get_algorithm(algo)
    strat = spec.strategy_cls(task, spec.parse_config({}), algo,
                              RoundPolicy(fraction_train=fraction, min_nodes=2, round_timeout=5.0))
    grid = inject_failures(LocalGrid(num_nodes, spec.client["train"], first_node_id=1), fail_at(fail))
    rows = []
    strat.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    return strat, grid, rows


def test_invariant_sum_omega_d_is_zero_through_client_and_server(task_identity):
    strat, grid, rows = _run("fedshvr", 3)
    assert [r["vr-applied"] for r in rows] == [0, 3, 3] and all(r["vr-reset"] == 0 for r in rows)
    assert rows[-1]["tau-min"] < rows[-1]["tau-max"]        # heterogeneous tau_k from data sizes
    assert rows[-1]["d-norm"] > 0
    # d_k^{T+1} from every client's stored state and the server's broadcast values
    new = {k: v.detach().cpu().numpy() for k, v in strat.model.state_dict().items()}
    ds, om = [], []
    for ctx in grid.contexts.values():
        st = ctx.state
        ds.append(fs.correction_from_carry(record_to_numpy(st.array_records[fs.STATE_CARRY]),
                                           record_to_numpy(st.array_records[fs.STATE_PREV]), new,
                                           strat.agg_tau, TASK.lr))
        env = library_env(TASK, 3, "mismatch")
        c = env.plan.clients[int(ctx.node_config["partition-id"])]
        om.append(len(c.labeled) + len(c.unlabeled))
    om = np.array(om) / np.sum(om)
    for k in ds[0]:
        total = sum(w * d[k] for w, d in zip(om, ds))
        scale = max(np.abs(d[k]).max() for d in ds)
        assert np.abs(total).max() <= 1e-3 * scale, k     # float32 client state
    assert strat.state_dict()["extra"]["agg_round"] == 3


def test_missed_round_resets_the_stale_correction(task_identity):
    # partition 1 fails in round 2: in round 3 its d_k is stale -> reset; the others apply theirs
    strat, grid, rows = _run("fedshvr", 3, fail={(2, 1)})
    assert rows[1]["participants"] == 2 and len(rows[1]["dropped"]) == 1
    assert rows[2]["vr-reset"] == 1 and rows[2]["vr-applied"] == 2
    assert all(math.isfinite(r["accuracy"]) for r in rows)


@pytest.mark.parametrize("algo", ["fed-pseudo", "fed-mt", "fed-sl", "fedshvr-no-nova"])
def test_baselines_run_and_switch_what_they_should(task_identity, algo):
    strat, grid, rows = _run(algo, 2)
    assert len(rows) == 2 and all(r["participants"] == 3 for r in rows)
    st = grid.contexts[1].state
    assert (fs.STATE_CARRY in st.array_records) == (algo == "fedshvr-no-nova")
    if algo == "fed-sl":
        assert "pl-acc" not in rows[-1] and rows[-1]["tau-max"] == math.ceil(30 / 32)
    else:
        assert 0.0 <= rows[-1]["pl-acc"] <= 1.0 and rows[-1]["unsup-loss"] > 0
    if algo == "fed-pseudo":
        assert rows[-1]["pl-confidence"] == pytest.approx(1.0) and rows[-1]["r2-loss"] == 0.0


def test_fed_mt_uses_the_augment_key_like_every_variant():
    """No augmentation on MNIST (the Fed-SHVR paper states none): Fed-MT follows
    ``fedshvr.augment`` (default 'none') like every variant, rather than forcing the weak view on
    its labeled and unlabeled inputs."""
    flat = {"fedshvr.augment": "none"}
    assert get_algorithm("fed-mt").parse_config(flat).augment == "none"
    assert get_algorithm("fed-mt").parse_config({"fedshvr.augment": "weak"}).augment == "weak"
    assert "augment" not in get_algorithm("fed-mt").overrides
    calls = []

    class Aug:
        def test(self, x):
            calls.append("test")
            return x.float() / 255

        def weak(self, x):
            calls.append("weak")
            return x.float() / 255

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    from tasks.data import ArrayDataset

    rng = np.random.default_rng(0)
    lab = ArrayDataset(rng.integers(0, 256, (4, 1, 2, 2), dtype=np.uint8), np.array([0, 1, 2, 0]))
    unl = ArrayDataset(rng.integers(0, 256, (6, 1, 2, 2), dtype=np.uint8), np.zeros(6, dtype=np.int64))
    cfg = get_algorithm("fed-mt").parse_config({})
    task = TaskConfig(batch_size=2)
    fs.local_train(model, lab, unl, None, cfg=cfg, task=task, aug=Aug(), steps=2, alpha0=1.0, d=None,
                   device=torch.device("cpu"), seed=0)
    assert calls and set(calls) == {"test"}
