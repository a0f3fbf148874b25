"""Windowed, fold-as-you-go rounds: at most ``max-in-flight`` instructions out at once,
each reply folded into running sums as it arrives; the same weights as stacking every reply."""
from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies.core.records import ARRAYS_KEY, METRICS_KEY, numpy_to_record
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.registry import algorithm_names, get_algorithm
from tasks.aggregate import RunningFedNova, RunningWeightedMean, fednova_aggregate, weighted_mean
from tests.faulty_grid import inject_failures
from tests.test_conformance import _fresh_plan_cache  # noqa: F401 (autouse: each test plans afresh)
from tests.test_conformance import INFO_ACTIONS, NODES, config, op_of

FULL_MODEL = [a for a in algorithm_names() if not get_algorithm(a).strategy_cls.staged]


def _states(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32),
             "n": np.array(rng.integers(0, 100), dtype=np.int64)} for _ in range(n)]


def test_running_mean_is_weighted_mean_and_the_stacked_average():
    states, a = _states(7), [3.0, 0.0, 1.5, 10.0, 2.0, 7.0, 1.0]
    acc = RunningWeightedMean()
    for st, w in zip(states, a):
        acc.add(st, w)
    got = acc.result()
    ref = weighted_mean(states, a)
    for k in ref:   # the one arithmetic: bit for bit
        assert got[k].dtype == states[0][k].dtype and np.array_equal(got[k], ref[k]), k
    for k in ("w", "b"):   # today's stacking, to float tolerance
        stacked = np.average(np.stack([s[k].astype(np.float64) for s in states]), axis=0, weights=a)
        np.testing.assert_allclose(got[k], stacked, rtol=1e-6, atol=1e-7)
    assert got["n"] == np.rint(np.average([s["n"] for s in states], weights=a))
    with pytest.raises(ValueError, match="not all be zero"):
        z = RunningWeightedMean()
        z.add(states[0], 0.0)
        z.result()
    with pytest.raises(ValueError, match=">= 0"):
        RunningWeightedMean().add(states[0], -1.0)
    bad = RunningWeightedMean()
    bad.add(states[0])
    with pytest.raises(ValueError, match="shape mismatch"):
        bad.add({**states[1], "w": np.zeros((2, 2), np.float32)})


def test_running_fednova_is_the_normalised_rule():
    prev = _states(1, 5)[0]
    ups, taus, om = _states(4, 6), [3.0, 7.0, 5.0, 11.0], [2.0, 1.0, 4.0, 3.0]
    acc = RunningFedNova(prev, keys=["w", "b"], mean_keys=["n"])
    for st, t, o in zip(ups, taus, om):
        acc.add(st, t, o)
    got, tau = acc.result()
    w = np.asarray(om) / np.sum(om)
    assert tau == pytest.approx(float(np.sum(w * np.asarray(taus))), rel=1e-12)
    for k in ("w", "b"):  # theta^{t-1} - tau sum_k w_k (theta^{t-1} - theta_k) / tau_k (Fed-SHVR's FedNova step)
        p = prev[k].astype(np.float64)
        ref = p - tau * sum(wk * (p - u[k]) / tk for wk, u, tk in zip(w, ups, taus))
        np.testing.assert_allclose(got[k], ref, rtol=1e-6, atol=1e-7)
    same = fednova_aggregate(prev, ups, taus, om, keys=["w", "b"], mean_keys=["n"])
    assert all(np.array_equal(same[k], got[k]) for k in got)


def _build(algo: str, window: int, **over):
    cfg = config(algo, **over)
    p = parse_run_config(cfg)
    grid = LocalGrid(NODES, dispatch, run_config=cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name,
                            RoundPolicy(min_nodes=2, round_timeout=60, max_in_flight=window))
    return s, grid


def _final(s):
    return {k: v.detach().cpu().numpy().copy() for k, v in s.model.state_dict().items()}


@pytest.mark.parametrize("algo", FULL_MODEL)
def test_one_in_flight_gives_the_weights_of_all_at_once_also_when_a_node_fails(algo):
    """Every full-model algorithm: a window of one instruction (each reply folded before the
    next instruction leaves) ends with the same weights and metrics as every node at once, with
    a node failing in round 1 in both runs."""
    finals, rows_of = [], []
    for window in (1, 64):
        s, grid = _build(algo, window)
        victim = sorted(grid.contexts)[1]
        inject_failures(grid, lambda m, c: c.node_id == victim and op_of(m) not in INFO_ACTIONS
                        and int(m.content.config_records.get("config", {}).get("server-round", 0)) == 1)
        rows: list[dict] = []
        s.start(grid, num_rounds=2, on_round_end=lambda r, m: rows.append(dict(m)))
        finals.append(_final(s))
        rows_of.append(rows)
        if s.uses_clients:
            assert victim in rows[0]["dropped"] and rows[1]["dropped"] == [], rows
    a, b = finals
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    for ra, rb in zip(*rows_of):
        assert ra.get("participants") == rb.get("participants")
        assert ra.get("accuracy") == rb.get("accuracy")


class _Counting(LocalGrid):
    """A LocalGrid that counts the instructions out (pushed, reply not yet pulled)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.out, self.most = set(), 0

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.out.update(ids)
        self.most = max(self.most, len(self.out))
        return ids

    def pull_messages(self, message_ids):
        got = super().pull_messages(message_ids)
        self.out.difference_update(r.metadata.reply_to_message_id for r in got)
        return got


@pytest.mark.parametrize("window", [1, 3])
def test_at_most_max_in_flight_instructions_are_out(window):
    cfg = config("fedavg", **{"max-in-flight": window})
    p = parse_run_config(cfg)
    assert p.app.policy().max_in_flight == window
    grid = _Counting(8, dispatch, run_config=cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, p.app.policy())
    rows: list[dict] = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert grid.most == window and rows[0]["participants"] == 8 and rows[0]["dropped"] == []


def test_auto_window_in_a_simulation_and_in_a_deployment(monkeypatch):
    s, _ = _build("fedavg", 0)
    monkeypatch.setattr("os.cpu_count", lambda: 3)

    from flwr.superlink.grid.inmemory_grid import InMemoryGrid as FlowerInMemoryGrid

    class InMemoryGrid(FlowerInMemoryGrid):   # (Flower's simulation engine's grid)
        def __init__(self):
            pass

    class GrpcGrid:
        pass

    class LookAlike:   # a grid named as the engine's is not one (no detection by class name)
        pass
    LookAlike.__name__ = "InMemoryGrid"

    assert s.window.in_flight(InMemoryGrid(), 1000) == 6 and s.window.in_flight(LocalGrid(2, dispatch), 1000) == 6
    assert s.window.in_flight(GrpcGrid(), 1000) == 1000 and s.window.in_flight(LookAlike(), 1000) == 1000
    # fast ClientApps: the replies of a quarter second at the rate seen so far (the engine's 0.1 s
    # intake, plus its scan)
    assert s.window.in_flight(InMemoryGrid(), 1000, replies_per_second=100.0) == 25
    assert s.window.in_flight(InMemoryGrid(), 1000, replies_per_second=2.0) == 6
    # min-nodes does not widen it: every instruction out at once slows Flower's engine's scans
    s.policy.min_nodes = 1000
    assert s.window.in_flight(InMemoryGrid(), 1000) == 6
    s.policy.max_in_flight = 5
    assert s.window.in_flight(GrpcGrid(), 1000) == 5


def test_folded_replies_are_let_go():
    """A reply folded into the round's sums is not kept: nothing of this library refers to it
    after ``fold`` returned (the server's memory does not grow with the sampled nodes)."""
    s, grid = _build("fedavg", 1)
    s.setup(grid)
    refs = []
    fold = s.train_fold(1)

    def add(r):
        refs.append(weakref.ref(r))
        fold.add(r)

    from flwr.app import ConfigRecord
    msgs = list(s.configure_train(1, s.global_arrays(), ConfigRecord(), grid))
    assert s.exchange_fold(grid, msgs, add) == NODES
    gc.collect()
    assert refs and all(r() is None for r in refs)
    arrays, metrics = fold.finish()
    assert arrays is not None and "train-loss" in metrics


def test_train_fold_equals_stacking_the_replies():
    """The FedAvg fold over fake replies: the ``num-examples``-weighted mean of the states (as
    ``weighted_mean`` stacks them) and of ``train-loss``."""
    s, grid = _build("fedavg", 0)
    s.setup(grid)
    base = _final(s)
    rng = np.random.default_rng(3)
    states = [{k: (v + rng.normal(size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
               for k, v in base.items()} for _ in range(5)]
    ns, losses = [10.0, 40.0, 5.0, 25.0, 20.0], [1.0, 2.0, 0.5, 1.5, 3.0]
    replies = [type("R", (), {"content": RecordDict({ARRAYS_KEY: numpy_to_record(st), METRICS_KEY: MetricRecord(
        {"num-examples": n, "train-loss": lo})})})() for st, n, lo in zip(states, ns, losses)]
    arrays, metrics = s.aggregate_train(1, replies)
    ref = weighted_mean(states, ns)
    got = _final(s)
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k
    assert metrics["train-loss"] == pytest.approx(np.average(losses, weights=ns), rel=1e-12)


class _Watching(LocalGrid):
    """A LocalGrid that holds weak references to the replies it hands out and records, at each
    pull, how many of the earlier ones are still alive (held by the strategy's round)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.refs, self.most_alive = [], 0

    def pull_messages(self, message_ids):
        gc.collect()
        self.most_alive = max(self.most_alive, sum(1 for r in self.refs if r() is not None))
        got = list(super().pull_messages(message_ids))
        self.refs.extend(weakref.ref(r) for r in got if op_of_reply(r) == "train")
        return got


def op_of_reply(r) -> str:
    return r.metadata.message_type


#: the algorithms whose own rounds fold (beside the default round and the FixMatch family)
OWN_ROUNDS_FOLDED = ["ssfl", "ssfl-selftrain", "semifl", "fedswitch", "easgd", "overlapsgd", "datasharing", "fedconcat"]


@pytest.mark.parametrize("algo", OWN_ROUNDS_FOLDED)
def test_own_rounds_let_each_reply_go(algo):
    """With one instruction in flight, a train reply is folded and let go before the next one
    is pulled: never more than one earlier reply alive (a round that stacked its replies would
    hold all of them but the last)."""
    cfg = config(algo)
    p = parse_run_config(cfg)
    grid = _Watching(NODES, dispatch, run_config=cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60, max_in_flight=1))
    rows: list[dict] = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert rows[0]["participants"] == NODES and not rows[0].get("skipped"), rows
    assert len(grid.refs) == NODES and grid.most_alive <= 1, (grid.most_alive, len(grid.refs))


class _Slow(LocalGrid):
    """A LocalGrid whose replies become visible ``delay`` seconds after their push; it records
    when each pull happened."""

    def __init__(self, *a, delay: float, **kw):
        super().__init__(*a, **kw)
        self.delay, self.pushed_at, self.pulls = delay, {}, []

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        now = time.time()
        self.pushed_at.update({i: now for i in ids})
        return ids

    def pull_messages(self, message_ids):
        now = time.time()
        self.pulls.append(now)
        ready = [i for i in message_ids if now - self.pushed_at.get(i, now) >= self.delay]
        return super().pull_messages(ready)


def test_an_exchange_pulls_less_often_the_longer_it_waits():
    """A reply that takes 3 s is pulled about 60 times (every 10 ms for the first
    ``POLL_FAST_SECONDS``, then every ``POLL_MAX_SECONDS``; a fixed 10 ms poll pulls about 300
    times) and noticed at most ``POLL_MAX_SECONDS`` after it came. A reply within
    ``POLL_FAST_SECONDS`` (a split exchange in simulation) is noticed within the 10 ms
    poll, as with a fixed poll (a backoff from the first pull would notice a 0.3 s reply up to
    25%, 75 ms, late)."""
    from flwr.app import Message

    s, _ = _build("fedavg", 0)
    w = s.window
    assert w.POLL_FAST_SECONDS == 0.4 and w.POLL_MAX_SECONDS == 0.1
    assert w.poll_interval(0.39, 0.01) == 0.01 and w.poll_interval(0.5, 0.01) == 0.1
    assert w.poll_interval(30.0, 0.01) == 0.1 and w.poll_interval(0.5, 0.2) == 0.2   # never under `poll`

    def echo(msg, ctx):
        return Message(RecordDict({METRICS_KEY: MetricRecord({"x": 1.0})}), reply_to=msg)

    for delay, most_pulls, late in ((3.0, 90, w.POLL_MAX_SECONDS), (0.2, 30, 0.01), (0.3, 40, 0.01), (0.02, 10, 0.01)):
        grid = _Slow(2, echo, delay=delay)
        got = []
        t0 = time.time()
        s.exchange_fold(grid, [Message(RecordDict(), dst_node_id=grid.get_node_ids()[0], message_type="train")],
                        got.append, timeout=30.0)
        took = time.time() - t0
        assert len(got) == 1 and s.dropped == []
        assert len(grid.pulls) <= most_pulls, (delay, len(grid.pulls))
        # the pull after the reply came is at most `late` after it, plus the slack of a loaded
        # CI machine's scheduler (the policy itself is pinned by the `poll_interval` asserts
        # above)
        first_after = min(t for t in grid.pulls if t - t0 >= delay)
        assert first_after - t0 - delay <= late + 0.05, (delay, first_after - t0 - delay)
        assert delay <= took <= delay + late + 0.15, (delay, took)
