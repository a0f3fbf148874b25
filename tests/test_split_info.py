"""A split node's one-time ``split-info`` query (split_layer/split_info.py) on a simulated system:
the query's bills go to the node's own draws, keyed by the partition id its reply states."""
from __future__ import annotations

import pytest


def test_a_node_first_asked_within_a_round_is_billed_under_its_partition_id(monkeypatch):
    """Three nodes on the ``scala`` system; the third fails its ``split-info`` at the run's start,
    so round 1 asks it again, inside the round. Every bill of the round names a partition id (the
    key of the system's draws, ``NodeDirectory.key_of``), the third node's among them; none names
    a node id, which is the key of no node's draws."""
    from strategies.core.records import action_of
    from tasks.system import RoundClock
    from tests.test_conformance import build

    s, grid = build("scala", nodes=3, system="scala")
    ids = sorted(grid.contexts)
    handler, failed = grid.handler, []

    def flaky(m, c):   # the third node's first split-info fails
        if c.node_id == ids[2] and action_of(m) == "split-info" and not failed:
            failed.append(m)
            raise RuntimeError("not ready yet")
        return handler(m, c)

    grid.handler = flaky
    s.setup(grid)
    assert failed and ids[2] not in s.directory

    keys: list[tuple[int, str]] = []
    inner = RoundClock.add_bytes

    def spy(self, key, direction, nbytes):
        keys.append((int(key), direction))
        return inner(self, key, direction, nbytes)

    monkeypatch.setattr(RoundClock, "add_bytes", spy)
    asked: list[int] = []
    fetch = type(s.info_query).fetch

    def spy_fetch(self, transport, server_round, nodes):
        asked.extend(n for n in nodes if not self.strategy.directory.has_stats(n))
        return fetch(self, transport, server_round, nodes)

    monkeypatch.setattr(type(s.info_query), "fetch", spy_fetch)
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert asked == [ids[2]]                                   # split-info, asked within round 1
    assert s.directory.key_of(ids[2]) == 2
    billed = {k for k, _ in keys}
    assert billed == {0, 1, 2}, billed                         # partition ids only, the late node's too
    assert not billed & set(ids)
    assert rows[0]["sim-seconds"] > 0 and rows[0].get("skipped", 0) == 0


def test_bills_of_the_query_are_held_then_charged_in_order():
    from split_layer.split_info import _HeldBills

    calls = []

    class Clock:
        active = True

        def add_bytes(self, *a):
            calls.append(("bytes", a))

        def add_work(self, *a):
            calls.append(("work", a))

        def missing(self, *a):
            calls.append(("missing", a))

    held = _HeldBills(Clock())
    held.add_bytes(7, "down", 0)
    held.add_work("reply")
    held.missing(8)
    assert calls == [] and held.active is True            # held; the rest is the clock's
    held.charge()
    assert calls == [("bytes", (7, "down", 0)), ("work", ("reply",)), ("missing", (8,))]
    held.charge()
    assert len(calls) == 3                                 # charged once


if __name__ == "__main__":
    pytest.main([__file__])
