"""The split stream under attack, on 127.0.0.1 only (the rows of docs/bad-input.md).

Every test talks to a real gRPC stream endpoint on loopback, runs bounded loops and stops
by itself (every socket, channel and server it opens is closed in ``finally``):

* an oversized frame (200 MB) from an unauthenticated peer, and from a peer with a valid
  token, against a server in a child process whose resident memory we read from /proc:
  refused within seconds, peak resident memory grows by less than 50 MB;
* many idle unauthenticated connections (raw TCP sockets that never send a byte and gRPC
  calls that never send a frame) while the genuine nodes train: the round completes with
  every genuine node;
* garbage bytes, a truncated frame, a valid frame with a wrong token, another node's token,
  last round's token, a non-ASCII token, an unknown node: each refused with a logged
  reason, and the round completes for the genuine nodes.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest

from split_layer.stream import (METHOD, NODE_HEADER, STREAM_KEYS, TOKEN_HEADER, StreamClient, StreamOptions,
                                StreamTransport, encode)
from split_layer.transport import Envelope, LocalGrid, reply

K = 3
ITERS = 2
NODES = [1001, 1002, 1003]
MB = 2 ** 20


# --------------------------------------------------------------------------- helpers
class Owner:
    """The strategy methods the transport uses; ``stream_specs`` gives the round's frame bound."""

    def __init__(self) -> None:
        self.info = {n: {} for n in NODES}
        self.dropped: list[tuple[int, str]] = []

    def base_content(self, server_round, action="train", **config):
        from flwr.app import ConfigRecord, RecordDict
        return RecordDict({"config": ConfigRecord(config)})

    def stream_specs(self, node):
        from split_layer.validation import TensorSpec
        return {"act": TensorSpec((2, 3), "float32")}

    def drop(self, node, why):
        self.dropped.append((node, why))


def raw_call(address: str, metadata=(), frames=(), hold: threading.Event | None = None,
             max_send: int = -1) -> tuple[grpc.StatusCode | None, str, float]:
    """One gRPC call to the stream method with the given metadata and frames (no
    StreamClient: an attacker sends what it likes). ``hold``: keep the request stream open
    until it is set. Returns (status code, details, seconds until the answer)."""
    ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", max_send),
                                                 ("grpc.use_local_subchannel_pool", 1)])  # a connection of its own
    t0 = time.monotonic()

    def requests():
        yield from frames
        if hold is not None:
            hold.wait(30)

    try:
        call = ch.stream_stream(METHOD)(requests(), metadata=tuple(metadata), timeout=30)
        try:
            for _ in call:
                pass
            return None, "", time.monotonic() - t0
        except grpc.RpcError as e:
            return e.code(), e.details() or "", time.monotonic() - t0
    finally:
        ch.close()


def echo_handler(gate: threading.Event, seen: dict):
    """A genuine ClientApp: records its start config, waits until the attack is in place,
    then streams ITERS steps (echoing ``g`` + 1 as ``act``)."""

    def handler(msg, context):
        cfg = dict(msg.content.config_records["config"])
        node = int(cfg[STREAM_KEYS["node"]])
        seen[node] = cfg
        if not gate.wait(30):
            raise RuntimeError("the attack never got ready")
        c = StreamClient(cfg[STREAM_KEYS["address"]], cfg[STREAM_KEYS["token"]], node, cfg[STREAM_KEYS["cert"]],
                         10.0, max_frame=int(cfg[STREAM_KEYS["max-frame"]]))
        try:
            c.send({"step": 1}, {"act": np.zeros((2, 3), np.float32)})
            for step in range(2, ITERS + 2):
                _, t = c.recv()
                if step <= ITERS:
                    c.send({"step": step}, {"act": t["g"] + 1})
        finally:
            c.close()
        return reply(msg, Envelope(arrays={"bottom": {"w": np.full(2, node, np.float32)}}))

    return handler


def attacked_round(attack, port: int = 0, rnd: int = 1, state: dict | None = None):
    """One stream round of the 3 genuine nodes while ``attack(seen)`` runs (``seen``: node ->
    its start config, i.e. the address and every genuine token). ``attack`` returns a
    cleanup callable or None. Returns (owner, final replies, what attack returned)."""
    owner, gate, seen, result = Owner(), threading.Event(), {}, {}
    grid = LocalGrid(K, echo_handler(gate, seen), threaded=True)
    tr = StreamTransport(owner, grid, StreamOptions(timeout=15.0, port=port, session="round"))

    def attacker():
        try:
            t_end = time.monotonic() + 20
            while len(seen) < K and time.monotonic() < t_end:
                time.sleep(0.01)
            result["out"] = attack(dict(seen))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e
        finally:
            gate.set()

    th = threading.Thread(target=attacker, daemon=True)
    th.start()
    cleanup = None
    try:
        got = tr.exchange(rnd, "split", {n: Envelope(config={"split-step": 1, "split-iters": ITERS}) for n in NODES})
        for step in range(2, ITERS + 2):
            got = tr.exchange(rnd, "split", {n: Envelope(tensors={"g": np.full((2, 3), step, np.float32)},
                                                         config={"split-step": step, "split-iters": ITERS})
                                             for n in got})
    finally:
        th.join(30)
        out = result.get("out")
        cleanup = out[1] if isinstance(out, tuple) and len(out) == 2 and callable(out[1]) else None
        if cleanup:
            cleanup()
        tr.close()
        grid.join(15)
    if "error" in result:
        raise result["error"]
    if state is not None:
        state.update(seen)
    return owner, got, (out[0] if cleanup else result.get("out"))


def assert_genuine_nodes_finished(owner, got):
    assert owner.dropped == [], owner.dropped
    assert sorted(got) == NODES
    for n in NODES:
        np.testing.assert_array_equal(got[n].arrays["bottom"]["w"], np.full(2, n))


def frame(node=1001, token="") -> bytes:
    return encode({"step": 1, "node": node, "token": token}, {"act": np.zeros((2, 3), np.float32)})


# --------------------------------------------------------------------------- refused calls, round goes on
def _addr(seen):
    return seen[NODES[0]][STREAM_KEYS["address"]]


CASES = {
    # name: (metadata of the call, frames it sends, the reason that must be logged)
    "no token, garbage bytes": (lambda s: [], lambda s: [b"\x00garbage" * 100], "no node id or token"),
    "no token, truncated frame": (lambda s: [], lambda s: [frame()[:-5]], "no node id or token"),
    "valid frame, wrong token": (lambda s: [(NODE_HEADER, "1001"), (TOKEN_HEADER, b"0" * 64)],
                                 lambda s: [frame(1001, "0" * 64)], "wrong token for node 1001"),
    "another node's token": (lambda s: [(NODE_HEADER, "1001"),
                                        (TOKEN_HEADER, s[1002][STREAM_KEYS["token"]].encode())],
                             lambda s: [frame()], "wrong token for node 1001"),
    "non-ASCII token": (lambda s: [(NODE_HEADER, "1001"), (TOKEN_HEADER, "tökén-ü€".encode())],
                        lambda s: [frame()], "wrong token for node 1001"),
    "token in the frame only": (lambda s: [],
                                lambda s: [frame(1001, s[1001][STREAM_KEYS["token"]])], "no node id or token"),
    "unknown node": (lambda s: [(NODE_HEADER, "77"), (TOKEN_HEADER, s[1001][STREAM_KEYS["token"]].encode())],
                     lambda s: [frame(77)], "node '77' is not in this round"),
    "node id not a number": (lambda s: [(NODE_HEADER, "1001; drop"), (TOKEN_HEADER, b"x")],
                             lambda s: [frame()], "is not in this round"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_call_is_logged_and_the_round_completes(case, refusals):
    meta, frames, reason = CASES[case]

    def attack(seen):
        return raw_call(_addr(seen), meta(seen), frames(seen))

    owner, got, (code, details, secs) = attacked_round(attack)
    assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
    assert reason in details and secs < 5, (details, secs)
    assert any("refused" in m and reason in m for m in refusals), refusals
    assert_genuine_nodes_finished(owner, got)


def test_last_rounds_token_is_refused_on_the_same_port(refusals):
    with socket.socket() as s:  # a fixed port, as in a deployment (split-stream-port)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first: dict = {}
    owner, got, _ = attacked_round(lambda seen: None, port=port, state=first)
    assert_genuine_nodes_finished(owner, got)
    old = first[1001][STREAM_KEYS["token"]]

    def attack(seen):
        assert _addr(seen).endswith(f":{port}") and seen[1001][STREAM_KEYS["token"]] != old
        return raw_call(_addr(seen), [(NODE_HEADER, "1001"), (TOKEN_HEADER, old.encode())], [frame(1001, old)])

    owner, got, (code, details, secs) = attacked_round(attack, port=port, rnd=2)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong token for node 1001" in details and secs < 5
    assert any("wrong token for node 1001" in m for m in refusals)
    assert_genuine_nodes_finished(owner, got)


def test_a_second_stream_for_a_connected_node_is_refused(refusals):
    """A stolen (current) token cannot open a second stream while the node streams."""
    def attack(seen):
        tok = seen[1002][STREAM_KEYS["token"]]
        hold = threading.Event()
        first = {}
        t = threading.Thread(target=lambda: first.update(r=raw_call(
            _addr(seen), [(NODE_HEADER, "1002"), (TOKEN_HEADER, tok.encode())], [], hold=hold)), daemon=True)
        t.start()   # the "thief" holds node 1002's stream (never sends a frame) ...
        time.sleep(0.5)
        second = raw_call(_addr(seen), [(NODE_HEADER, "1002"), (TOKEN_HEADER, tok.encode())], [frame(1002)])
        hold.set()
        t.join(10)
        return second

    owner, got, (code, details, _) = attacked_round(attack)
    assert code == grpc.StatusCode.ALREADY_EXISTS and "already connected" in details
    # the thief's silent stream ended (client closed) and node 1002 could not connect: it alone is dropped
    assert [n for n, _ in owner.dropped] == [1002] and sorted(got) == [1001, 1003]


def test_many_idle_unauthenticated_connections_do_not_lock_genuine_nodes_out(refusals):
    """40 raw TCP connections that never send a byte and 30 gRPC calls (each on its own
    connection) that send no token and no frame are open while the genuine nodes connect."""
    socks: list[socket.socket] = []
    hold = threading.Event()
    threads: list[threading.Thread] = []
    codes: list = []

    def attack(seen):
        host, port = _addr(seen).rsplit(":", 1)
        for _ in range(40):
            s = socket.create_connection((host, int(port)), timeout=5)
            socks.append(s)
        for _ in range(30):
            t = threading.Thread(target=lambda: codes.append(raw_call(_addr(seen), [], [], hold=hold)), daemon=True)
            t.start()
            threads.append(t)
        time.sleep(1.0)  # all in place before the genuine nodes connect

        def cleanup():
            hold.set()
            for t in threads:
                t.join(10)
            for s in socks:
                s.close()
        return "idle", cleanup

    t0 = time.monotonic()
    owner, got, _ = attacked_round(attack)
    assert_genuine_nodes_finished(owner, got)
    assert time.monotonic() - t0 < 20
    assert len(codes) == 30 and all(c == grpc.StatusCode.UNAUTHENTICATED for c, _, _ in codes), codes[:3]
    assert all(secs < 5 for _, _, secs in codes)  # refused at once, not when they gave up
    assert any("no node id or token" in m for m in refusals)


def test_garbage_on_the_raw_socket_is_dropped_by_the_server_and_the_round_completes():
    """Bytes that are not HTTP/2 at all: gRPC's transport closes the connection (its own
    parser; nothing reaches our code, so nothing of ours is logged), the round goes on."""
    closed = {}

    def attack(seen):
        host, port = _addr(seen).rsplit(":", 1)
        for name, payload in (("garbage", os.urandom(4096)), ("truncated preface", b"PRI * HTTP/2.0\r\n")):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(payload)
                if name == "garbage":
                    s.settimeout(5)
                    try:
                        closed[name] = s.recv(65536) is not None
                        while s.recv(65536):
                            pass
                    except (ConnectionResetError, socket.timeout):
                        pass
                    closed[name] = True
        return closed

    owner, got, out = attacked_round(attack)
    assert out["garbage"] is True
    assert_genuine_nodes_finished(owner, got)


# --------------------------------------------------------------------------- memory: oversized frames
SERVER = textwrap.dedent("""
    import json, sys
    from split_layer.stream import StreamOptions, max_frame_bytes
    from split_layer.stream_server import _Server
    from split_layer.validation import TensorSpec
    specs = {"act": TensorSpec((64, 32, 8, 8), "float32")}   # 0.5 MB of activations per frame
    srv = _Server(StreamOptions(timeout=30.0), [1], max_frame=max_frame_bytes(specs))
    def rss():
        got = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                got[k] = int(v.split()[0]) * 1024
        return got
    print(json.dumps({"address": srv.address, "token": srv.sessions[1].token, "max_frame": srv.max_frame,
                      **rss()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "rss":
            print(json.dumps(rss()), flush=True)
        else:
            break
    srv.stop()
""")


@pytest.fixture
def server_process():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        yield p, json.loads(p.stdout.readline())
    finally:
        try:
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait(10)
        except Exception:  # noqa: BLE001
            pass
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _rss(p) -> dict:
    p.stdin.write("rss\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


@pytest.mark.parametrize("who", ["unauthenticated", "authenticated"])
def test_an_oversized_frame_is_refused_quickly_without_growing_the_server(who, server_process):
    p, info = server_process
    assert info["max_frame"] < 1 * MB   # the round's bound: 0.5 MB of activations + a margin
    big = b"FSS1" + bytes(200 * MB)
    before = _rss(p)
    meta = [(NODE_HEADER, "1"), (TOKEN_HEADER, (info["token"] if who == "authenticated" else "f" * 64).encode())]
    code, details, secs = raw_call(info["address"], meta, [big])
    del big
    after = _rss(p)
    grew_peak = (after["VmHWM"] - before["VmRSS"]) / MB
    grew = (after["VmRSS"] - before["VmRSS"]) / MB
    print(f"\n{who} 200 MB frame: {code.name} in {secs:.2f} s; server RSS {before['VmRSS'] / MB:.0f} MB -> "
          f"{after['VmRSS'] / MB:.0f} MB (peak {after['VmHWM'] / MB:.0f} MB): +{grew:.1f} MB, peak +{grew_peak:.1f} MB")
    want = grpc.StatusCode.UNAUTHENTICATED if who == "unauthenticated" else grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code == want, (code, details)
    assert secs < 5
    assert grew_peak < 50 and grew < 50
