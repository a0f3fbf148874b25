"""Stream sessions that span rounds: one Flower message per node for a whole run.

All in process on real gRPC endpoints (``LocalGrid(threaded=True)`` runs every ClientApp
message in its own thread, as Flower's runtimes run every SuperNode at once), through the
library's own ClientApp (``flower_apps.client_app.dispatch``) and strategies:

* weights, bytes and exchanges are identical with sessions of one round, sessions that
  span the run, and Flower messages; a run opens one session per node (one ``split``
  Flower message each), and every ClientApp returns when the run ends (``bye``);
* nodes not sampled in a round wait in their session (``fraction-train < 1``);
* a node whose ClientApp crashes in the middle of a round is dropped from that round only
  and gets a new session (a new Flower message) the next round;
* a node that joins after round 1 gets its session at the next round;
* the ServerApp dies in the middle of a round: the sessions end (the ClientApps return
  or fail, none hangs), and the rerun with ``resume=true`` ends with the weights of an
  uninterrupted run; a server that vanishes without ``bye`` fails an idle ClientApp at once.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.flower_harness import max_diff
import torch

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from strategies.core.round_policy import RoundPolicy
from split_layer.stream import (
    STREAM_KEYS,
    StreamClient,
    StreamError,
    StreamOptions,
    encode,
)
from split_layer.stream_server import _Server
from split_layer.transport import LocalGrid
from tests.faulty_grid import RecordingGrid

K = 3
BASE = ("algo='scala' model='cnn' norm='bn' dropout=0.5 partition='quantity' partition-classes-per-client=4 "
        "seed=3 scala.local-iterations=3 scala.total-batch=40 lr=0.05 momentum=0.9 min-nodes=2")


def split_messages(grid: RecordingGrid) -> dict[int, int]:
    """Flower messages of op ``split`` per node (each one starts a session, or a message-path step)."""
    out: dict[int, int] = {}
    for m in grid.sent:
        if m.metadata.message_type == "query.split":
            out[m.metadata.dst_node_id] = out.get(m.metadata.dst_node_id, 0) + 1
    return out


def run(rounds: int = 3, transport: str = "stream", session: str = "run", extra: str = "", nodes: int = K,
        grid: RecordingGrid | None = None, on_round_end=None):
    p = parse_run_config(fused_run_config([f"{BASE} {extra}"]))
    grid = grid or RecordingGrid(nodes, dispatch, threaded=transport == "stream")
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        fraction_train=p.app.fraction_train, min_nodes=2, round_timeout=30), split_transport=transport,
        stream=StreamOptions(session=session, timeout=30))
    rows: list[dict] = []

    def end(r, m):
        rows.append(dict(m))
        if on_round_end is not None:
            on_round_end(r, m, s, grid)

    s.start(grid, num_rounds=rounds, on_round_end=end)
    grid.join(30)
    return s, grid, rows


def state(s) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in s.model.state_dict().items()}




def test_a_run_opens_one_session_per_node_with_the_weights_of_every_other_path():
    runs = {"message": run(transport="message"), "round": run(session="round"), "run": run(session="run")}
    ref = state(runs["message"][0])
    for name, (s, grid, rows) in runs.items():
        assert [r["participants"] for r in rows] == [K] * 3 and all(r["dropped"] == [] for r in rows), name
        assert max_diff(state(s), ref) == 0.0, name
        strip = [{k: v for k, v in r.items() if k.startswith("bytes.") or k in ("split-exchanges", "accuracy")}
                 for r in rows]
        assert strip == [{k: v for k, v in r.items() if k.startswith("bytes.") or k in ("split-exchanges", "accuracy")}
                         for r in runs["message"][2]], name
    assert list(split_messages(runs["run"][1]).values()) == [1] * K        # one session per node, 3 rounds
    assert list(split_messages(runs["round"][1]).values()) == [3] * K      # one per round
    assert list(split_messages(runs["message"][1]).values()) == [3 * 4] * K  # I + 1 per round
    # every ClientApp of the run returned (bye) with a good reply
    grid = runs["run"][1]
    assert all(not t.is_alive() for t in grid._threads)
    assert not grid._replies or all(not r.has_error() for r in grid._replies.values())


def test_nodes_not_sampled_wait_in_their_session():
    kw = dict(rounds=4, extra="fraction-train=0.5", nodes=4)
    a = run(session="round", **kw)
    b = run(session="run", **kw)
    sampled = [r["participants"] for r in b[2]]
    assert sampled == [2] * 4 and [r["participants"] for r in a[2]] == sampled
    assert max_diff(state(a[0]), state(b[0])) == 0.0
    # a node sampled in several rounds got one Flower message for all of them
    per_node = split_messages(b[1])
    assert sum(per_node.values()) == len(per_node) < 8, per_node


def test_a_node_that_crashes_mid_round_is_dropped_once_and_rejoins_with_a_new_session(monkeypatch):
    from split_layer import worker

    real = worker.SplitClientHooks.after_step
    crashed = []

    def crash_once(self, w, step):
        if w.rnd == 2 and w.partition == 1 and step == 2 and not crashed:
            crashed.append(w.env.partition_id)
            raise RuntimeError("the device crashed")
        return real(self, w, step)

    monkeypatch.setattr(worker.SplitClientHooks, "after_step", crash_once)
    s, grid, rows = run(rounds=3)
    assert crashed == [1]
    assert [r["participants"] for r in rows] == [K, K - 1, K]
    (lost,) = rows[1]["dropped"]
    assert rows[0]["dropped"] == [] and rows[2]["dropped"] == [] and not any(r.get("skipped") for r in rows)
    per_node = split_messages(grid)
    assert per_node[lost] == 2 and all(v == 1 for n, v in per_node.items() if n != lost), per_node


class LateGrid(RecordingGrid):
    """A RecordingGrid whose last node connects only after round 1."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.hidden = {max(self.contexts)}

    def get_node_ids(self):
        return sorted(set(self.contexts) - self.hidden)


def test_a_node_joining_late_gets_a_session_at_the_next_round(monkeypatch):
    """A deployment's SuperNode that connects after round 1 (a simulation waits for all its
    nodes before round 1, strategies.core.partition_count, so the grid stands for a deployment here)."""
    from strategies.core import partition_count

    monkeypatch.setattr(partition_count, "simulated", lambda grid: False)
    grid = LateGrid(4, dispatch, threaded=True)
    late = max(grid.contexts)

    def after(r, m, s, g):
        g.hidden.clear()

    s, grid, rows = run(rounds=3, grid=grid, on_round_end=after)
    assert [r["participants"] for r in rows] == [3, 4, 4] and all(r["dropped"] == [] for r in rows)
    per_node = split_messages(grid)
    assert per_node[late] == 1 and all(v == 1 for v in per_node.values()), per_node


def test_the_server_dies_mid_round_every_clientapp_ends_and_resume_matches(tmp_path, monkeypatch):
    from flower_apps import server_app
    from strategies.scala.scala import ScalaStrategy

    cfg = {**fused_run_config([BASE]), "num-rounds": 3, "split-transport": "stream", "split-stream-session": "run",
           "results-dir": str(tmp_path), "round-timeout": 30.0}
    full = server_app.run(LocalGrid(K, dispatch, run_config=cfg, threaded=True), {**cfg, "run-name": "whole"})

    class Died(Exception):
        pass

    real = ScalaStrategy.server_iteration

    def dies(self, step, payloads):
        if self._round == 2 and step == 2:
            raise Died
        return real(self, step, payloads)

    grid = LocalGrid(K, dispatch, run_config=cfg, threaded=True)
    monkeypatch.setattr(ScalaStrategy, "server_iteration", dies)
    t0 = time.monotonic()
    with pytest.raises(Died):
        server_app.run(grid, {**cfg, "run-name": "cut"})
    grid.join(30)
    assert all(not t.is_alive() for t in grid._threads), "a ClientApp still runs after the server died"
    assert time.monotonic() - t0 < 25
    monkeypatch.setattr(ScalaStrategy, "server_iteration", real)
    server_app.run(grid, {**cfg, "run-name": "cut", "resume": True})
    grid.join(30)
    a, b = torch.load(full / "model.pt"), torch.load(tmp_path / "cut" / "model.pt")
    assert max_diff(a, b) == 0.0


def test_an_idle_session_fails_at_once_when_the_server_vanishes():
    """No ``bye``: the server process is gone (its port closes). The ClientApp waiting for its
    next round fails with a stream error at once, not after its idle limit (hours)."""
    srv = _Server(StreamOptions(timeout=30.0), [])
    sess = srv.open(7)
    errs = []

    def client():
        c = StreamClient(srv.address, sess.token, 7, timeout=30.0)
        try:
            c.send({"step": 1}, {"act": np.zeros(2, np.float32)})
            c.recv(wait=3600.0)        # the idle wait of a session between rounds
        except StreamError as e:
            errs.append(str(e))
        finally:
            c.close()

    t = threading.Thread(target=client)
    t.start()
    node, kind, _ = srv.events.get(timeout=10)
    assert (node, kind) == (7, "frame")
    t0 = time.monotonic()
    srv.server.stop(grace=0)           # as a killed ServerApp: no bye
    t.join(20)
    assert not t.is_alive() and errs and time.monotonic() - t0 < 10, errs


def test_a_reopened_session_refuses_the_old_token():
    srv = _Server(StreamOptions(timeout=5.0), [])
    try:
        old = srv.open(3).token
        new = srv.open(3).token
        assert old != new
        c = StreamClient(srv.address, old, 3, timeout=5.0)
        c.send({"step": 1}, {})
        with pytest.raises(StreamError, match="UNAUTHENTICATED"):
            c.recv()
        c.close()
        c = StreamClient(srv.address, new, 3, timeout=5.0)
        c.send({"step": 1}, {})
        node, kind, _ = srv.events.get(timeout=5)
        assert (node, kind) == (3, "frame")
        srv.send(3, encode({"bye": True}))
        assert c.recv()[0] == {"bye": True}
        c.close()
    finally:
        srv.stop()


def test_session_frames_are_bounded_by_the_weights_and_the_largest_batch():
    """A session's server carries the bottom (+ extras) down and back: its message bound covers
    them and the streams at the largest batch a node can be given in any round (SCALA: B), and
    the nodes are told the same bound."""
    from strategies.core.byte_meter import array_bytes
    from split_layer.stream import FRAME_MARGIN, max_frame_bytes

    seen = {}

    def after(r, m, s, grid):
        seen["bound"] = s.transports.current.server.max_frame
        seen["told"] = {int(m.content.config_records["config"][STREAM_KEYS["max-frame"]]) for m in grid.sent
                        if STREAM_KEYS["max-frame"] in m.content.config_records["config"]}

    s, grid, rows = run(rounds=1, on_round_end=after)
    n = grid.get_node_ids()[0]
    largest = s.largest_stream_specs(n)
    assert largest["act"].shape[0] == 40
    weights = array_bytes({"bottom": s.bottom_numpy()})
    assert seen["bound"] == max(max_frame_bytes(largest), 2 * weights + FRAME_MARGIN)
    assert seen["told"] == {seen["bound"]}
    assert seen["bound"] > max(r for r in rows[0]["batch-sizes"]) * int(np.prod(s.act_shape)) * 4


def test_session_length_in_a_simulation_that_cannot_hold_every_node():
    """3 nodes, a simulation that runs 2 ClientApps at once, 2 sampled: 'auto' falls back to
    one-round sessions (an idle session would hold an actor); 'run' is an error naming the
    settings; 'round' never spans; a deployment (no simulation limits) spans."""
    from split_layer.stream import StreamConfigError, StreamTransport

    class Owner:
        def __init__(self, actors):
            self.directory = {n: {"sim-actors": actors, "sim-threads": 6} for n in (1001, 1002, 1003)}

    grid = LocalGrid(3, dispatch)
    nodes = [1001, 1002]
    assert StreamTransport(Owner(2), grid, StreamOptions(session="auto")).decide_spans(nodes) is False
    assert StreamTransport(Owner(3), grid, StreamOptions(session="auto")).decide_spans(nodes) is True
    assert StreamTransport(Owner(0), grid, StreamOptions(session="auto")).decide_spans(nodes) is True
    assert StreamTransport(Owner(8), grid, StreamOptions(session="round")).decide_spans(nodes) is False
    with pytest.raises(StreamConfigError, match="split-stream-session='run'.*3 nodes.*at most 2"):
        StreamTransport(Owner(2), grid, StreamOptions(session="run")).decide_spans(nodes)
