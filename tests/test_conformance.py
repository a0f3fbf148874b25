"""The conformance matrix: every registered algorithm under every condition a user meets.

Each test runs one algorithm (every name in the registry, so a new algorithm is covered
the day it is registered) for one or two tiny rounds through the in-process grid
(:class:`split_layer.transport.LocalGrid`, the real ClientApp dispatch, one persistent
``Context`` per node) under one condition:

* ``all-nodes`` -- every node sampled; the returned ``Result`` holds the final model(s) and
  the per-round server metrics;
* ``partial`` -- ``fraction-train=0.5``;
* ``bn-batch-plus-one`` -- BatchNorm model, every labeled/unlabeled set (clients and server)
  of size B+1, so that a naive batcher makes a last batch of 1;
* ``initial-arrays`` -- ``start(initial_arrays=...)``: the model sent to the clients, the
  round-0 evaluation and ``evaluate_fn(0, ...)`` start from them;
* ``flower-params`` -- ``train_config``/``evaluate_config`` reach the clients' messages,
  ``evaluate_fn`` is called for rounds 0..N and its metrics land in the ``Result``;
* ``node-fails`` -- one node raises in round 1: it is dropped, the round completes, the
  warning names the real exception;
* ``resume`` -- round 1, checkpoint (``state_dict``), a new strategy and restarted nodes
  (fresh contexts, same ``state-dir``), round 2: the same final weights as the uninterrupted run;
* ``accelerator`` -- the server and the nodes believe they run on an accelerator
  (``tests/accel_emulation.py``): any CPU tensor fed to a device tensor raises, as on CUDA;
* ``system-clock`` -- ``system='scala'``: every round has a simulated duration from the counted
  work and bytes, and the trained weights equal those of the run without a clock.
"""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from strategies.core.records import numpy_to_record
from strategies.core.round_policy import RoundPolicy
from strategies.registry import algorithm_names
from tasks import env as task_env
from tasks.training import evaluate, load_numpy_state
from tests.faulty_grid import RecordingGrid, inject_failures

ALGOS = algorithm_names()
NODES = 4
B = 8

TINY = {"model": "mlp", "local-steps": 2, "batch-size": B, "server-labels": 40, "device": "cpu",
        "dropout": 0.2, "partition-labeled-per-client": 20,
        "semisfl.k-s": 2, "semisfl.k-u": 2, "semisfl.labeled-batch-size": B, "semisfl.queue-labeled": 64,
        "semisfl.queue-unlabeled": 64,
        "scala.local-iterations": 2, "scala.total-batch": 4 * B,
        "fedshvr.unlabeled-batch-size": B,
        "semifl.tau": 0.0,   # (SemiFL's clients skip a round without a confident pseudo-label: make them train)
        "umpfssl.warmup-epochs": 1, "umpfssl.mc-samples": 2, "umpfssl.helpers": 2, "umpfssl.replace": 1}

INFO_ACTIONS = {"node-info", "split-info"}
# what the servers make of label-derived reply metrics (tests/test_label_consent.py)
LABEL_DERIVED_SERVER_SIDE = {"impurity", "pseudo-label-accuracy", "pl-acc", "pl-acc-unseen", "pseudo-main-class",
                             "pseudo-main-share"}


def config(algo: str, **over) -> dict:
    return {**fused_run_config(None), **TINY, "algo": algo, **over}


def build(algo: str, *, fraction: float = 1.0, nodes: int = NODES, grid_kw=None, system: str = "none", **over):
    cfg = config(algo, **over)
    p = parse_run_config(cfg)
    grid = RecordingGrid(nodes, dispatch, run_config=cfg, **(grid_kw or {}))
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name,
                            RoundPolicy(fraction_train=fraction, min_nodes=2, round_timeout=60, system=system))
    return s, grid


def run(s, grid, rounds: int = 2, **kw):
    rows: list[dict] = []
    res = s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)), **kw)
    return res, rows


def op_of(msg) -> str:
    from strategies.core.records import action_of
    return action_of(msg)


def state_of(res_arrays) -> dict[str, np.ndarray]:
    return {k: res_arrays[k].numpy() for k in res_arrays.keys()}


def personalized(s) -> bool:
    return bool(getattr(s, "personalized", False))


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    task_env.plan_cached.cache_clear()
    yield
    task_env.plan_cached.cache_clear()


# ----------------------------------------------------------------------------------- conditions
@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_all_nodes_result(algo, monkeypatch):
    from strategies.core.records import LABEL_CONSENT_ENV
    from strategies.registry import get_algorithm

    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    s, grid = build(algo)
    replies = []
    grid.handler = lambda msg, ctx: replies.append(dispatch(msg, ctx)) or replies[-1]
    res, rows = run(s, grid)
    # no consent (the default): no reply carries a metric any algorithm computes from labels,
    # and the server reports none of them (not reported, never 0)
    label_derived = {k for a in ALGOS for k in get_algorithm(a).label_metrics}
    sent = {k for r in replies if not r.has_error() for rec in r.content.metric_records.values() for k in rec.keys()}
    assert not sent & label_derived, sent & label_derived
    assert not {k for r in rows for k in r} & LABEL_DERIVED_SERVER_SIDE
    assert all(r.get("label-metrics-nodes", 0) == 0 for r in rows)
    assert [r.get("skipped", 0) for r in rows] == [0, 0]
    assert all(r["dropped"] == [] for r in rows), rows
    assert sorted(res.evaluate_metrics_serverapp) == [0, 1, 2]
    assert sorted(res.train_metrics_clientapp) == [1, 2]
    assert "accuracy" in res.evaluate_metrics_serverapp[2]
    if not getattr(s, "returns_model", True):  # local-only: every model stays on its node
        assert len(res.arrays) == 0
    elif personalized(s):  # one model per client, keys '<partition>/<name>'
        parts = {k.split("/", 1)[0] for k in res.arrays.keys()}
        assert len(parts) == NODES
    elif s.with_client_test:  # evaluated on the clients' own test splits: the global model(s)
        assert set(res.arrays.keys()) == set(state_of(s.global_arrays()))
    else:  # the returned model is the evaluated one: same accuracy
        model = s.eval_model()
        final = copy.deepcopy(model)
        load_numpy_state(final, state_of(res.arrays))
        got = evaluate(final, s.env.test, aug=s.env.augmenter, device=s.env.device,
                              num_classes=s.env.num_classes)
        assert got["accuracy"] == pytest.approx(res.evaluate_metrics_serverapp[2]["accuracy"])


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_partial_participation(algo):
    s, grid = build(algo, fraction=0.5)
    res, rows = run(s, grid)
    assert [r.get("skipped", 0) for r in rows] == [0, 0]
    assert all(r["dropped"] == [] for r in rows), rows
    if s.uses_clients:
        assert all(r["participants"] == NODES // 2 for r in rows), [r["participants"] for r in rows]


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_batchnorm_sets_of_batch_plus_one(algo):
    """Every data set of size B+1: no BatchNorm batch of 1, no node dropped."""
    s, grid = build(algo, norm="bn", seed=11)
    s.setup(grid)
    plan = s.env.plan  # the cached plan the nodes share in-process: trim every set to B+1
    for c in plan.clients:
        for name in ("labeled", "unlabeled"):
            idx = getattr(c, name)
            if idx is not None and len(idx) > B + 1:
                setattr(c, name, idx[:B + 1])
    if len(plan.server_labeled) > B + 1:
        plan.server_labeled = plan.server_labeled[:B + 1]
    res, rows = run(s, grid, rounds=1)
    assert rows[0].get("skipped", 0) == 0 and rows[0]["dropped"] == [], rows[0]


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_initial_arrays(algo):
    s, grid = build(algo)
    s.setup(grid)
    torch.manual_seed(123)
    init = copy.deepcopy(s.model)
    with torch.no_grad():
        for p in init.parameters():
            p.add_(0.05 * torch.randn_like(p))
    init_state = {k: v.detach().cpu().numpy().copy() for k, v in init.state_dict().items()}
    seen = {}

    def evaluate_fn(rnd, arrays):
        seen[rnd] = state_of(arrays)
        return None

    res, rows = run(s, grid, rounds=1, initial_arrays=numpy_to_record(init_state),
                    evaluate_fn=evaluate_fn)
    assert set(seen) == {0, 1}
    if not s.with_client_test:
        assert set(seen[0]) == set(init_state)
        for k in init_state:
            np.testing.assert_array_equal(seen[0][k], init_state[k], err_msg=k)
        want = evaluate(init, s.env.test, aug=s.env.augmenter, device=s.env.device,
                               num_classes=s.env.num_classes)
        assert res.evaluate_metrics_serverapp[0]["accuracy"] == pytest.approx(want["accuracy"])
    # the first weights each node receives are (part of) the initial arrays; an algorithm whose
    # server first trains on its labels (Semi-SFL's K_s steps: ``server_trains_first``) sends
    # what that made of them, so its seen[0] check above is the one that counts
    if s.uses_clients and not s.server_trains_first:
        first: dict[int, dict[str, np.ndarray]] = {}
        for m in grid.sent:
            recs = {k: v for k, v in m.content.array_records.items() if k in ("arrays", "split-arrays.bottom")}
            if recs and m.metadata.dst_node_id not in first:
                first[m.metadata.dst_node_id] = {k: r[k].numpy() for r in recs.values() for k in r.keys()}
        assert first, "no model weights were sent to any node"
        for node, st in first.items():
            for k, v in st.items():
                assert k in init_state, k
                np.testing.assert_array_equal(v.reshape(init_state[k].shape), init_state[k], err_msg=k)


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_flower_parameters(algo):
    s, grid = build(algo)
    calls = []
    from flwr.app import ConfigRecord, MetricRecord

    def evaluate_fn(rnd, arrays):
        calls.append(rnd)
        return MetricRecord({"user-metric": float(rnd) + 0.5})

    res, rows = run(s, grid, rounds=2, train_config=ConfigRecord({"user-train-key": 7}),
                    evaluate_config=ConfigRecord({"user-eval-key": 3}), evaluate_fn=evaluate_fn)
    assert calls == [0, 1, 2]
    for rnd in (0, 1, 2):
        assert res.evaluate_metrics_serverapp[rnd]["user-metric"] == rnd + 0.5
    train_msgs = [m for m in grid.sent if op_of(m) not in INFO_ACTIONS and op_of(m) != "evaluate"]
    if s.uses_clients:
        assert train_msgs
    for m in train_msgs:
        assert m.content.config_records["config"]["user-train-key"] == 7, op_of(m)
    for m in grid.sent:
        if op_of(m) == "evaluate":
            assert m.content.config_records["config"]["user-eval-key"] == 3


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_node_fails_mid_round(algo, caplog):
    s, grid = build(algo)
    victim = sorted(grid.contexts)[1]

    def fail_if(msg, ctx):
        if ctx.node_id != victim or op_of(msg) in INFO_ACTIONS:
            return False
        cfg = msg.content.config_records.get("config", {})
        return int(cfg.get("server-round", 0)) == 1 and int(cfg.get("split-step", 2)) >= 2

    inject_failures(grid, fail_if)   # errors worded as in Flower's simulation engine
    with caplog.at_level(logging.WARNING):
        res, rows = run(s, grid)
    assert [r.get("skipped", 0) for r in rows] == [0, 0], rows
    if not s.uses_clients:   # a server-only baseline asks no node to train: the failing node is never reached
        assert all(op_of(m) in INFO_ACTIONS for m in grid.sent), sorted({op_of(m) for m in grid.sent})
        assert all(r.get("dropped", []) == [] for r in rows) and "injected failure" not in caplog.text, rows
        assert np.isfinite(rows[1]["accuracy"]) and res.arrays is not None and len(res.arrays.keys()) > 0
        return
    assert victim in rows[0]["dropped"], rows[0]
    assert rows[1]["dropped"] == [], rows[1]
    assert "injected failure" in caplog.text and "RuntimeError" in caplog.text


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_resume_equals_uninterrupted(algo, tmp_path):
    """Round 1, checkpoint, a new strategy and restarted nodes (fresh contexts, the same
    state-dir), round 2: the same final model as two uninterrupted rounds."""
    s, grid = build(algo, grid_kw={"node_config": {"state-dir": str(tmp_path / "a")}})
    full, _ = run(s, grid, rounds=2)

    s1, g1 = build(algo, grid_kw={"node_config": {"state-dir": str(tmp_path / "b")}})
    ck = {}

    class Crash(Exception):
        pass

    def checkpoint_then_crash(rnd, metrics):  # the ServerApp's checkpoint, then the server dies
        ck["state"] = copy.deepcopy(s1.state_dict())
        raise Crash

    with pytest.raises(Crash):
        s1.start(g1, num_rounds=2, on_round_end=checkpoint_then_crash)
    s2, g2 = build(algo, grid_kw={"node_config": {"state-dir": str(tmp_path / "b")}})
    s2.setup(g2)
    s2.load_state_dict(ck["state"])
    resumed = s2.start(g2, num_rounds=2, start_round=2)
    a, b = state_of(full.arrays), state_of(resumed.arrays)
    assert set(a) == set(b)
    # the evaluated result too (local-only and per-client algorithms: the nodes' own models)
    assert resumed.evaluate_metrics_serverapp[2]["accuracy"] == full.evaluate_metrics_serverapp[2]["accuracy"]
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_accelerator_placement(algo, monkeypatch):
    from tests.accel_emulation import DEVICE, emulated_accelerator

    monkeypatch.setattr(task_env, "resolve_device", lambda name, deterministic=True: DEVICE)
    s, grid = build(algo)
    with emulated_accelerator() as mode:
        res, rows = run(s, grid, rounds=1)
    assert mode.violations == []
    assert rows[0].get("skipped", 0) == 0 and rows[0]["dropped"] == [], rows[0]


@pytest.mark.parametrize("algo", ALGOS)
def test_conformance_system_clock(algo):
    """``system='scala'``: every round has a simulated duration from the work the nodes and the
    server counted and the bytes they moved, and counting changes nothing that is trained."""
    plain, grid = build(algo)
    res_plain, _ = run(plain, grid, rounds=1)
    s, grid = build(algo, system="scala")
    res, rows = run(s, grid, rounds=1)
    row = rows[0]
    assert row.get("skipped", 0) == 0 and row["dropped"] == [], row
    assert row["sim-seconds"] > 0 and row["sim-seconds-total"] == row["sim-seconds"]
    if s.uses_clients:
        assert row["sim-client-flops"] > 0 and row["sim-stages"] >= 1
    else:   # a server-only baseline: its time is its own training
        assert row["sim-server-flops"] > 0 and row["sim-seconds"] == pytest.approx(row["sim-server-seconds"])
    got, want = state_of(res.arrays), state_of(res_plain.arrays)
    assert got.keys() == want.keys()
    for k in want:   # (under the FLOP counter an op without a FLOP formula may run decomposed: the last bit)
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_accelerator_emulation_catches_what_cuda_rejects():
    """The emulation itself: what CUDA refuses raises here, what CUDA accepts passes."""
    from tests.accel_emulation import DEVICE, DeviceMixError, emulated_accelerator

    with emulated_accelerator():
        net = torch.nn.Sequential(torch.nn.Linear(3, 2)).to(DEVICE)
        x_host = torch.from_numpy(np.ones((4, 3), dtype=np.float32))
        with pytest.raises(DeviceMixError):
            net(x_host)                                       # CPU batch into a GPU model
        x = x_host.to(DEVICE)
        out = net(x)                                          # moved: fine
        with pytest.raises(DeviceMixError):
            out * torch.full((4, 1), 0.5)                     # a CPU weight vector
        (out * torch.tensor(0.5)).sum()                       # a 0-d CPU scalar is fine (as on CUDA)
        with pytest.raises(DeviceMixError):
            torch.cat([out, torch.zeros(1, 2)])
        copy.deepcopy(net)(x)                                 # a copy stays on the device
        with pytest.raises(DeviceMixError):
            copy.deepcopy(net)(x_host)
