"""The start of a run: the partition count is what the nodes state, not who connected first
(strategies.core.partition_count), and a node's reply is due from when its instruction was sent,
with a start-up allowance for its first one (strategies.core.deadlines). Time is a clock the tests
drive (no real sleeping, no verdict that depends on the machine's speed)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from tasks.config import ConfigError
from tests.test_conformance import _fresh_plan_cache  # noqa: F401 (autouse: each test plans afresh)
from tests.test_conformance import config

N = 5


class FakeClock:
    """A clock that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(float(seconds), 1e-3)


class Arriving(LocalGrid):
    """A simulation whose nodes register one by one: the first ``looks`` calls of
    ``get_node_ids`` see ``first`` nodes, each later call one more."""

    def __init__(self, *a, first: int, looks: int = 3, **kw) -> None:
        super().__init__(*a, **kw)
        self.first, self.looks, self.calls = first, looks, 0

    def get_node_ids(self) -> list[int]:
        self.calls += 1
        ids = super().get_node_ids()
        return ids[:min(len(ids), self.first + max(0, self.calls - self.looks))]


class Cold(LocalGrid):
    """Each node's reply becomes visible ``delay(node, k)`` seconds (on ``clock``) after its
    ``k``-th instruction (k = 0: its first) was pushed."""

    def __init__(self, *a, clock: FakeClock, delay, **kw) -> None:
        super().__init__(*a, **kw)
        self.clock, self.delay, self.ready, self.count = clock, delay, {}, {}

    def push_messages(self, messages):
        messages = list(messages)
        ids = super().push_messages(messages)
        for mid, m in zip(ids, messages):
            node = m.metadata.dst_node_id
            k = self.count.get(node, 0)
            self.count[node] = k + 1
            self.ready[mid] = self.clock.now() + self.delay(node, k)
        return ids

    def pull_messages(self, message_ids):
        now = self.clock.now()
        return super().pull_messages([i for i in message_ids if self.ready.get(i, 0.0) <= now])


def strategy(algo: str, clock: FakeClock, **policy):
    cfg = config(algo)
    p = parse_run_config(cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(**{"min_nodes": 2, "round_timeout": 60,
                                                                       **policy}))
    s.timer = clock
    return s, cfg


def run(s, grid, rounds: int = 1) -> list[dict]:
    rows: list[dict] = []
    s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    return rows


# --------------------------------------------------------------------------- the partition count
@pytest.mark.parametrize("algo", ["fedavg", "scala"])
def test_nodes_that_register_slowly_are_all_partitioned_as_if_all_were_there(algo):
    """2 of 5 simulated nodes are there at the first looks (min-nodes=2), the others register
    later: the server waits for all 5 (their num-partitions), partitions over 5, and the round
    trains every node to the same weights as with all 5 there at once."""
    out = {}
    for name in ("all-there", "slow"):
        clock = FakeClock()
        s, cfg = strategy(algo, clock)
        grid = (LocalGrid(N, dispatch, run_config=cfg) if name == "all-there"
                else Arriving(N, dispatch, run_config=cfg, first=2, looks=3))
        rows = run(s, grid)
        out[name] = (s, grid, rows)
    (a, _, rows_a), (b, grid_b, rows_b) = out["all-there"], out["slow"]
    assert grid_b.calls > 3                                   # some nodes came after the first looks
    assert a.num_partitions == b.num_partitions == N
    assert b.env.plan.report == a.env.plan.report
    assert rows_a[0]["participants"] == rows_b[0]["participants"] == N and rows_b[0]["dropped"] == []
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(np.array_equal(sa[k].numpy(), sb[k].numpy()) for k in sa)


def test_simulated_nodes_that_do_not_come_are_an_error_naming_wait_for_nodes():
    clock = FakeClock()
    s, cfg = strategy("fedavg", clock, wait_for_nodes=30.0)
    grid = Arriving(N, dispatch, run_config=cfg, first=3, looks=10 ** 9)   # 2 of 5 never register
    with pytest.raises(ConfigError, match=r"only 3 of the 5 SuperNode\(s\).*num-partitions=5.*wait-for-nodes=30"):
        s.setup(grid)
    assert 30.0 <= clock.t - 1000.0 < 31.0


def test_nodes_that_state_different_num_partitions_are_refused():
    clock = FakeClock()
    s, cfg = strategy("fedavg", clock)
    grid = LocalGrid(N, dispatch, run_config=cfg)
    grid.contexts[grid.get_node_ids()[0]].node_config["num-partitions"] = N + 1
    with pytest.raises(ConfigError, match=r"different num-partitions.*: 6.*--node-config"):
        s.setup(grid)


class Deployed:
    """A deployment's grid (not a simulation): only ``present`` of ``inner``'s nodes are connected."""

    def __init__(self, inner: LocalGrid, present: int) -> None:
        self.inner, self.present = inner, present

    def get_node_ids(self):
        return self.inner.get_node_ids()[:self.present]

    def push_messages(self, messages):
        return self.inner.push_messages(messages)

    def pull_messages(self, ids):
        return self.inner.pull_messages(ids)


def test_a_deployment_partitions_over_the_stated_count_and_starts_with_min_nodes():
    clock = FakeClock()
    s, cfg = strategy("fedavg", clock)
    grid = Deployed(LocalGrid(N, dispatch, run_config=cfg), present=2)
    s.setup(grid)
    assert s.num_partitions == N and clock.t - 1000.0 < 1.0    # no wait for the 3 not connected yet


# --------------------------------------------------------------------------- timeouts
@pytest.mark.parametrize("algo", ["fedavg", "scala"])
def test_a_node_that_starts_30_s_late_completes_round_1_at_round_timeout_25(algo, caplog):
    """Every ClientApp takes 30 s to start (its first instruction), two instructions are out at
    once (max-in-flight=2): at round-timeout=25 every node still completes round 1 (its first
    instruction has the start-up allowance; the ones waiting for a slot are not late), and the
    allowance used is logged."""
    clock = FakeClock()
    s, cfg = strategy(algo, clock, round_timeout=25.0, max_in_flight=2)
    grid = Cold(4, dispatch, run_config=cfg, clock=clock, delay=lambda node, k: 30.0 if k == 0 else 0.5)
    with caplog.at_level(logging.INFO, logger="flwr"):
        rows = run(s, grid, rounds=2)
    assert [r["dropped"] for r in rows] == [[], []] and not any(r.get("skipped") for r in rows)
    assert rows[0]["participants"] == 4
    # scala's first instruction (split-info) goes out two at a time: two waves of 30 s starts, so
    # the exchange outlasts 25 s; fedavg's node-info goes to every node at once
    assert clock.t - 1000.0 >= (60.0 if algo == "scala" else 30.0)
    assert "answered its first instruction of the run after 30.0 s" in caplog.text
    assert "startup-timeout" in caplog.text


def test_a_warm_node_late_by_30_s_is_dropped_at_round_timeout_25():
    """The allowance is for a node's first instruction only: a node 30 s late in round 2 is
    dropped at 25 s after its instruction was sent, and the round goes on with the others."""
    clock = FakeClock()
    s, cfg = strategy("fedavg", clock, round_timeout=25.0)
    late = LocalGrid(3, dispatch).get_node_ids()[2]
    grid = Cold(3, dispatch, run_config=cfg, clock=clock,
                delay=lambda node, k: 30.0 if (node == late and k == 2) else 0.1)   # (k = 0: node-info)
    rows = run(s, grid, rounds=2)
    assert rows[0]["dropped"] == [] and rows[1]["dropped"] == [late] and rows[1]["participants"] == 2
    assert s.policy.startup_timeout == 120.0


def test_a_first_instruction_past_the_start_up_allowance_is_dropped():
    clock = FakeClock()
    s, cfg = strategy("fedavg", clock, round_timeout=25.0, startup_timeout=10.0)
    first = LocalGrid(3, dispatch).get_node_ids()[0]
    grid = Cold(3, dispatch, run_config=cfg, clock=clock,
                delay=lambda node, k: 40.0 if (node == first and k == 1) else 0.1)
    s.setup(grid)                      # node-info: every node answers (and is warm)
    s.warm_nodes.discard(first)        # (as if its ClientApp were started anew)
    rows = run(s, grid, rounds=1)
    assert rows[0]["dropped"] == [first]
