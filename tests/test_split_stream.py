"""The gRPC stream transport (split_layer/stream.py): frames, authentication, faults, config.

Equivalence with the message transport (same weights to the last bit, same byte counts)
is in tests/test_split_equivalence.py; the simulation and deployment runs are e2e tests
there and in tests/test_deploy.py.
"""
from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from strategies.core.round_policy import RoundPolicy
from split_layer.stream import (
    STREAM_KEYS,
    StreamClient,
    StreamConfigError,
    StreamError,
    StreamOptions,
    StreamTransport,
    decode,
    encode,
    simulation_concurrency,
)
from split_layer.transport import Envelope, LocalGrid
from tests.faulty_grid import FaultyGrid, RecordingGrid
from tasks.config import ConfigError

K = 3


# --------------------------------------------------------------------------- frames
def test_frame_round_trip_keeps_names_dtypes_shapes_values():
    t = {"act": np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32),
         "labels": np.array([1, 2, 3, 9], np.int64), "scalar": np.float64(2.5) * np.ones(()),
         "empty": np.zeros((0, 5), np.float16), "mask": np.array([True, False])}
    h, back = decode(encode({"step": 3, "final": False, "note": "x"}, t))
    assert h == {"step": 3, "final": False, "note": "x"}
    assert list(back) == list(t)
    for k in t:
        assert back[k].dtype == t[k].dtype and back[k].shape == t[k].shape
        np.testing.assert_array_equal(back[k], t[k])


def test_frame_of_non_contiguous_array_is_the_array():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    _, back = decode(encode({}, {"x": x}))
    np.testing.assert_array_equal(back["x"], x)


def _frame(meta: dict, body: bytes = b"") -> bytes:
    head = json.dumps(meta).encode()
    return b"FSS1" + struct.pack("<I", len(head)) + head + body


@pytest.mark.parametrize("buf, why", [
    (b"", "bad magic"),
    (b"XXXX\x00\x00\x00\x00", "bad magic"),
    (b"FSS1" + struct.pack("<I", 999) + b"{}", "runs past the frame"),
    (_frame({"h": {}, "t": [["x", "object", [1], 8]]}, b"\0" * 8), "not allowed"),
    (_frame({"h": {}, "t": [["x", "float32", [3], 8]]}, b"\0" * 8), "do not match"),
    (_frame({"h": {}, "t": [["x", "float32", [4], 16]]}, b"\0" * 8), "runs past the end"),
    (_frame({"h": {}, "t": [["x", "float32", [2], 8]]}, b"\0" * 12), "trailing bytes"),
    (_frame({"h": [], "t": []}), "frame header"),
    (b"FSS1" + struct.pack("<I", 3) + b"{{{", "malformed"),
])
def test_malformed_frames_raise_a_clear_error(buf, why):
    with pytest.raises(StreamError, match=why):
        decode(buf)


def test_encode_refuses_object_arrays():
    with pytest.raises(StreamError, match="dtype"):
        encode({}, {"x": np.array([object()])})


# --------------------------------------------------------------------------- a bare transport
class Owner:
    """The strategy methods the transport uses, recording drops."""

    def __init__(self, actors: int = 0, threads: int = 0) -> None:
        self.directory = {n: {"sim-actors": actors, "sim-threads": threads} for n in range(1001, 1001 + K)}
        self.dropped: list[tuple[int, str]] = []

    def base_content(self, server_round, action="train", **config):
        from flwr.app import ConfigRecord, RecordDict
        return RecordDict({"config": ConfigRecord(config)})

    def drop(self, node, why):
        self.dropped.append((node, why))


def echo_handler(behaviour: dict[int, str] | None = None, iters: int = 3):
    """A ClientApp that echoes ``g`` back as ``act``; per-node misbehaviour for the fault tests."""
    behaviour = behaviour or {}

    def handler(msg, context):
        from split_layer.transport import reply
        cfg = dict(msg.content.config_records["config"])
        node = int(cfg[STREAM_KEYS["node"]])
        how = behaviour.get(node, "")
        if how == "raise-before-connect":
            raise RuntimeError("boom before connecting")
        token = "not-the-token" if how == "bad-token" else cfg[STREAM_KEYS["token"]]
        c = StreamClient(cfg[STREAM_KEYS["address"]], token, node, cfg[STREAM_KEYS["cert"]], 10.0)
        try:
            c.send({"step": 1}, {"act": np.zeros((2, 3), np.float32)})
            for step in range(2, iters + 2):
                h, t = c.recv()
                if how == "break" and step == 3:
                    raise RuntimeError("client crashed mid-round")
                if how == "garbage" and step == 3:
                    c._out.put(b"garbage")  # not a frame
                    c.recv()
                if step <= iters:
                    c.send({"step": step}, {"act": t["g"] + 1})
        finally:
            c.close()
        return reply(msg, Envelope(arrays={"bottom": {"w": np.full(2, node, np.float32)}}))

    return handler


def run_round(handler, owner=None, iters=3, timeout=10.0, opts=None, fail_nodes=()):
    owner = owner or Owner()
    grid = FaultyGrid(K, handler, threaded=True, fail_nodes=fail_nodes)
    tr = StreamTransport(owner, grid, opts or StreamOptions(timeout=timeout, session="round"))
    nodes = grid.get_node_ids()
    seen = []
    try:
        got = tr.exchange(1, "split", {n: Envelope(config={"split-step": 1, "split-iters": iters}) for n in nodes})
        seen.append(got)
        for step in range(2, iters + 2):
            got = tr.exchange(1, "split", {n: Envelope(tensors={"g": np.full((2, 3), step, np.float32)},
                                                       config={"split-step": step, "split-iters": iters})
                                           for n in got})
            seen.append(got)
    finally:
        tr.close()
        grid.join(15)
    return owner, seen


def test_a_round_streams_every_step_and_ends_with_the_flower_reply():
    owner, seen = run_round(echo_handler())
    assert owner.dropped == []
    assert [sorted(s) for s in seen] == [[1001, 1002, 1003]] * 4
    np.testing.assert_array_equal(seen[0][1001].tensors["act"], np.zeros((2, 3)))
    np.testing.assert_array_equal(seen[1][1002].tensors["act"], np.full((2, 3), 3.0))   # g of step 2, + 1
    np.testing.assert_array_equal(seen[2][1003].tensors["act"], np.full((2, 3), 4.0))
    for n in (1001, 1002, 1003):  # the final bottoms came back in the Flower replies
        np.testing.assert_array_equal(seen[3][n].arrays["bottom"]["w"], np.full(2, n))


def test_tls_round_works_and_a_client_without_the_certificate_cannot_connect():
    owner, seen = run_round(echo_handler(), opts=StreamOptions(timeout=10.0, tls="on", session="round"))
    assert owner.dropped == [] and len(seen[-1]) == K

    from split_layer.stream_server import _Server
    srv = _Server(StreamOptions(tls="on"), [1])
    try:
        with pytest.raises(StreamError, match="cannot connect"):
            StreamClient(srv.address, srv.sessions[1].token, 1, cert="", timeout=2.0)  # plaintext to TLS
    finally:
        srv.stop()


@pytest.mark.parametrize("how, reason", [
    ("raise-before-connect", "ClientApp error: .*boom before connecting"),
    ("bad-token", "ClientApp error|stream"),
    ("break", "client error: RuntimeError: client crashed mid-round|stream|ClientApp error"),
    ("garbage", "bad magic|not a split-stream frame"),
])
def test_a_failing_node_is_dropped_and_the_others_finish(how, reason):
    owner, seen = run_round(echo_handler({1002: how}), timeout=10.0)
    assert [n for n, _ in owner.dropped] == [1002], owner.dropped
    assert re.search(reason, owner.dropped[0][1], re.S), owner.dropped
    assert sorted(seen[-1]) == [1001, 1003]  # the others ended the round normally
    for n in (1001, 1003):
        np.testing.assert_array_equal(seen[-1][n].arrays["bottom"]["w"], np.full(2, n))


def test_a_silent_node_is_dropped_after_the_timeout():
    owner, seen = run_round(echo_handler(), timeout=1.5, fail_nodes=[1003])
    assert owner.dropped and owner.dropped[0][0] == 1003 and "within 2 s" in owner.dropped[0][1]
    assert sorted(seen[-1]) == [1001, 1002]


def test_wrong_token_is_refused_by_the_server():
    from split_layer.stream_server import _Server
    srv = _Server(StreamOptions(), [7])
    try:
        c = StreamClient(srv.address, "0" * 64, 7, timeout=5.0)
        c.send({"step": 1}, {})
        with pytest.raises(StreamError, match="UNAUTHENTICATED"):
            c.recv()
        c.close()
        c = StreamClient(srv.address, srv.sessions[7].token, 8, timeout=5.0)  # right secret, other node
        c.send({"step": 1}, {})
        with pytest.raises(StreamError, match="UNAUTHENTICATED"):
            c.recv()
        c.close()
    finally:
        srv.stop()
    assert srv.events.empty()  # nothing of a refused client reached the round


def test_too_few_concurrent_clientapps_in_simulation_fail_with_the_setting_to_change():
    for actors, threads, want in ((2, 6, "init-args-num-cpus=3 client-resources-num-cpus=1"),
                                  (8, 2, "sample at most 2 nodes per round")):
        grid = RecordingGrid(K, echo_handler(), threaded=True)
        tr = StreamTransport(Owner(actors, threads), grid, StreamOptions(timeout=5.0))
        with pytest.raises(StreamConfigError) as e:
            tr.exchange(1, "split", {n: Envelope(config={"split-step": 1, "split-iters": 2})
                                     for n in grid.get_node_ids()})
        text = str(e.value)
        assert f"at most {min(actors, threads)} ClientApps" in text and want in text, text
        assert "split-transport='message'" in text
        assert grid.pushed == 0  # failed before contacting any node
    # enough of both: no error (the round then runs)
    owner, seen = run_round(echo_handler(), owner=Owner(3, 6))
    assert owner.dropped == [] and len(seen[-1]) == K


def test_simulation_concurrency_is_zero_outside_ray():
    assert simulation_concurrency() == (0, 0)


def test_other_ops_go_through_flower_messages():
    calls = []

    def handler(msg, context):
        from split_layer.transport import reply
        calls.append(msg.metadata.dst_node_id)
        return reply(msg, Envelope(config={"partition-id": 0}))

    grid = LocalGrid(K, handler)
    from strategies.base import BaseStrategy  # FlowerTransport needs strategy.exchange
    from strategies.core.byte_meter import ByteMeter
    from strategies.core.clock import SimClock
    from strategies.core.deadlines import WallClock
    from strategies.core.exchange_window import ExchangeWindow
    from strategies.core.round_guard import RoundGuard

    class S(Owner):
        exchange = BaseStrategy.exchange
        exchange_fold = BaseStrategy.exchange_fold
        record_kind = BaseStrategy.record_kind
        policy = RoundPolicy(round_timeout=5)
        timer = WallClock()

        def __init__(self):
            super().__init__()
            self.dropped = []
            self.warm_nodes = set()
            self.guard = RoundGuard(self)
            self.window = ExchangeWindow(self)
            self.meter = ByteMeter()
            self.clock = SimClock(int)

    tr = StreamTransport(S(), grid, StreamOptions())
    got = tr.exchange(1, "split-info", {n: Envelope() for n in grid.get_node_ids()})
    assert sorted(got) == sorted(calls) == [1001, 1002, 1003] and tr.server is None


# --------------------------------------------------------------------------- config
def _parse(extra: dict):
    return parse_run_config({**fused_run_config(None), **extra})


def test_stream_keys_parse_and_reach_the_strategy_policy():
    p = _parse({"algo": "scala", "split-transport": "stream", "split-stream-tls": "on", "split-stream-port": 0,
                "round-timeout": 42.0})
    o = p.app.stream_options()
    assert (o.tls, o.timeout, o.host, o.use_tls()) == ("on", 42.0, "127.0.0.1", True)
    assert not StreamOptions(tls="auto").use_tls() and StreamOptions(host="10.0.0.5", tls="auto").use_tls()


@pytest.mark.parametrize("extra, match", [
    ({"algo": "scala", "split-transport": "grpc"}, "split-transport.*message, stream"),
    ({"algo": "fedavg", "split-transport": "stream"}, "split algorithms only.*scala"),
    ({"algo": "scala", "split-transport": "stream", "split-stream-host": "0.0.0.0"}, "split-stream-advertise"),
    ({"algo": "scala", "split-stream-tls": "yes"}, "split-stream-tls.*auto, on, off"),
    ({"algo": "scala", "split-stream-port": 70000}, "split-stream-port"),
])
def test_bad_stream_config_names_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        _parse(extra)


def test_strategy_with_stream_policy_uses_the_stream_transport():
    p = _parse({"algo": "scala"})
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(round_timeout=7.0), split_transport="stream")
    s.setup(LocalGrid(K, dispatch))
    tr = s.transports.make(LocalGrid(K, dispatch))
    assert isinstance(tr, StreamTransport) and tr.opts.timeout == 7.0


# --------------------------------------------------------------------------- hardening (docs/bad-input.md)
def test_tls_is_on_unless_both_the_bind_host_and_the_address_clients_dial_are_loopback():
    assert StreamOptions(host="0.0.0.0", advertise="10.0.0.5").use_tls()
    # clients dial loopback, but the listener is on every interface: anyone on the network can reach it
    assert StreamOptions(host="0.0.0.0", advertise="127.0.0.1").use_tls()
    assert StreamOptions(host="10.0.0.5", advertise="127.0.0.1").use_tls()
    assert StreamOptions(host="127.0.0.1", advertise="node.example.org").use_tls()  # a tunnel's far end
    assert not StreamOptions(host="127.0.0.1").use_tls()
    assert not StreamOptions(host="::1", advertise="localhost").use_tls()
    assert not StreamOptions(host="10.0.0.5", advertise="10.0.0.5", tls="off", allow_plaintext=True).use_tls()


def test_a_plaintext_listener_on_every_interface_needs_the_users_explicit_key_and_is_warned_about(caplog):
    """Binding 0.0.0.0 while SuperNodes dial 127.0.0.1 listens on every interface: TLS off
    there is refused without split-stream-allow-plaintext, and warned about every run with it."""
    import dataclasses
    import logging

    from split_layer import stream_transport
    from split_layer.stream_server import _Server
    with pytest.raises(ConfigError, match=r"split-stream-host='0.0.0.0' \(a listener on every interface\).*"
                                          "split-stream-allow-plaintext=true"):
        StreamOptions(host="0.0.0.0", advertise="127.0.0.1", tls="off")
    with pytest.raises(ConfigError, match="split-stream-allow-plaintext"):
        _parse({"algo": "scala", "split-transport": "stream", "split-stream-host": "0.0.0.0",
                "split-stream-advertise": "127.0.0.1", "split-stream-tls": "off"})
    opts = StreamOptions(host="0.0.0.0", advertise="127.0.0.1", tls="off", allow_plaintext=True)
    assert opts.exposed and not opts.use_tls()
    grid = LocalGrid(K, echo_handler())
    tr = StreamTransport(Owner(), grid, opts)
    tr.spans = False

    def local(o, *a, **k):   # the server itself listens on loopback only (a test opens nothing on the network)
        return _Server(dataclasses.replace(o, host="127.0.0.1"), *a, **k)

    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stream_transport, "_Server", local)
            tr._open_server({n: Envelope(config={"split-step": 1, "split-iters": 1}) for n in grid.get_node_ids()}, 1)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
        tr.close()
    said = {r.getMessage() for r in caplog.records if "TLS is off" in r.getMessage()}   # (a record may come twice)
    assert len(said) == 1 and all("a listener on every interface" in m and "in the clear" in m for m in said), said


def test_plaintext_towards_a_remote_address_needs_the_users_explicit_key():
    with pytest.raises(ValueError, match="split-stream-allow-plaintext=true"):
        StreamOptions(host="0.0.0.0", advertise="10.0.0.5", tls="off")
    assert not StreamOptions(host="127.0.0.1", tls="off").use_tls()   # loopback: nothing crosses a network
    with pytest.raises(ConfigError, match="split-stream-allow-plaintext"):
        _parse({"algo": "scala", "split-transport": "stream", "split-stream-host": "0.0.0.0",
                "split-stream-advertise": "10.0.0.5", "split-stream-tls": "off"})
    p = _parse({"algo": "scala", "split-transport": "stream", "split-stream-host": "0.0.0.0",
                "split-stream-advertise": "10.0.0.5", "split-stream-tls": "off",
                "split-stream-allow-plaintext": True})
    assert p.app.stream_options().allow_plaintext


def test_plaintext_towards_a_remote_address_is_warned_about_every_run(caplog):
    import logging
    grid = LocalGrid(K, echo_handler())
    # bound on loopback (nothing listens elsewhere); only the advertised name is remote
    opts = StreamOptions(host="127.0.0.1", advertise="node.example.org", tls="off", allow_plaintext=True)
    tr = StreamTransport(Owner(), grid, opts)
    tr.spans = False
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        tr._open_server({n: Envelope(config={"split-step": 1, "split-iters": 1}) for n in grid.get_node_ids()}, 1)
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
        tr.close()
    assert any("TLS is off" in r.getMessage() and "in the clear" in r.getMessage() for r in caplog.records)


def test_every_round_has_its_own_certificate_valid_for_the_round():
    from cryptography import x509

    from split_layer.stream_server import _Server
    certs = []
    for _ in range(2):
        srv = _Server(StreamOptions(tls="on", timeout=100.0), [1], lifetime=100.0 * 12)
        try:
            certs.append(x509.load_pem_x509_certificate(srv.cert.encode()))
        finally:
            srv.stop()
    assert certs[0].serial_number != certs[1].serial_number and certs[0].public_key() != certs[1].public_key()
    life = (certs[0].not_valid_after_utc - certs[0].not_valid_before_utc).total_seconds()
    assert abs(life - (1200 + 3600 + 300)) < 5   # the round's longest legitimate duration + 1 h (+5 min skew)


def test_the_frame_bound_comes_from_the_stream_specs():
    from split_layer.stream import DEFAULT_MAX_FRAME, FRAME_MARGIN, max_frame_bytes
    from split_layer.validation import TensorSpec
    specs = {"act": TensorSpec((64, 32, 8, 8), "float32"), "labels": TensorSpec((64,), "int64")}
    assert max_frame_bytes(specs) == 64 * 32 * 8 * 8 * 4 + 64 * 8 + FRAME_MARGIN + 2 * 128
    assert max_frame_bytes(None) == DEFAULT_MAX_FRAME
    # a real frame of exactly those streams fits, with its header
    t = {"act": np.zeros((64, 32, 8, 8), np.float32), "labels": np.zeros(64, np.int64)}
    assert len(encode({"step": 10 ** 6, "final": False, "node": 2 ** 62}, t)) < max_frame_bytes(specs)


def test_an_authenticated_call_without_a_first_frame_is_cut_at_the_deadline():
    from split_layer.stream_server import _Server
    srv = _Server(StreamOptions(timeout=1.0), [5])   # first-frame deadline = min(timeout, 60 s)
    try:
        c = StreamClient(srv.address, srv.sessions[5].token, 5, timeout=5.0)
        c._first = False   # the call (and its metadata) started with the connection; wait without a frame
        with pytest.raises(StreamError, match="CANCELLED"):
            c.recv()
        c.close()
        node, kind, why = srv.events.get(timeout=2)
        assert (node, kind) == (5, "closed") and "no first frame within 1 s" in why
    finally:
        srv.stop()


def test_the_client_waits_at_most_its_timeout_for_each_frame():
    from split_layer.stream_server import _Server
    srv = _Server(StreamOptions(timeout=30.0), [5])   # authenticates, then never answers
    try:
        c = StreamClient(srv.address, srv.sessions[5].token, 5, timeout=1.0)
        c.send({"step": 1}, {})
        t0 = __import__("time").monotonic()
        # twice the timeout: the server itself waits up to the timeout for the slowest node, then answers
        with pytest.raises(StreamError, match="no frame from the server within 2 s"):
            c.recv()
        assert 1.9 < __import__("time").monotonic() - t0 < 6
        c.close()
    finally:
        srv.stop()


def test_session_frames_decode_only_what_they_claim():
    """A session's weights and config travel in frame headers: what a hostile node can put
    there is refused with a StreamError (the node is dropped), never half-applied."""
    from split_layer.stream import (
        config_from_json,
        config_to_json,
        metrics_from_json,
        pack_arrays,
        unpack_arrays,
    )

    arrays = {"bottom": {"a.weight": np.ones((2, 2), np.float32), "n/b": np.array(3)}, "teacher": {}}
    table, tensors = pack_arrays(arrays)
    h, t = decode(encode({"arrays": table}, tensors))
    back = unpack_arrays(h["arrays"], t)
    assert set(back["bottom"]) == {"a.weight", "n/b"} and back["bottom"]["n/b"].shape == ()
    cfg = {"x": 1, "s": "y", "b": b"\x00\xff", "l": [1.5, 2.0], "t": True}
    assert config_from_json(json.loads(json.dumps(config_to_json(cfg)))) == cfg
    for bad_table in ([["bottom"]], [["bottom", "k"], ["bottom", "j"]], {"bottom": "k"}, [[1, 2]]):
        with pytest.raises(StreamError):
            unpack_arrays(bad_table, {"0": np.zeros(1, np.float32)})
    for bad in ({"x": {"eval": "1"}}, {"x": None}, [1]):
        with pytest.raises(StreamError):
            config_from_json(bad)
    for bad in ({"loss": "nan"}, {"m": [1, "x"]}, {"ok": True}, "metrics"):
        with pytest.raises(StreamError):
            metrics_from_json(bad)
    assert metrics_from_json({"n": 3, "v": [1.0, 2]}) == {"n": 3, "v": [1.0, 2]}
