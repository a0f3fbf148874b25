"""A hostile peer of the split stream port, run as its own process (loopback only, bounded).

    python tests/stream_attacker.py HOST PORT --hold N --callers M --every S --seconds T
    python tests/stream_attacker.py HOST PORT --flood --callers M --sources K --seconds T

``--hold N``: keeps N connections open to HOST:PORT (from ``--source``, another loopback
address, as another host would; each sends HTTP/2's client preface, so gRPC's handshake
limit does not close it, and then nothing), re-opening each one the server closes
``--every`` seconds later (one that could not connect, e.g. while the port is closed
between rounds, at once);
``--callers M``: M gRPC channels, each on a connection of its own, that make one call
without a token every ``--every`` seconds (the call is refused; the channel reconnects
if the server closed its connection). ``--flood``: token-less calls as fast as ``--callers``
threads (at least one) can make them, each call on a new connection, from ``--sources``
source addresses in turn (``--source`` and the addresses after it: 127.0.0.1 and 64
sources are 127.0.0.1-127.0.0.64), written as raw HTTP/2 (client preface, SETTINGS, one
HEADERS and one DATA frame) so that each connection can be bound to its source address,
which gRPC's own channels cannot; a call ends when the server answers it (``answered``),
resets it (``reset``), or closes the connection first (``cut``). Stops after ``--seconds``
or when its standard input closes, and prints one JSON line: the most connections it held
at once, calls made, status codes seen.

Only loopback addresses are accepted: this is a test tool for a server on this machine.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import selectors
import socket
import struct
import sys
import threading
import time
from collections import Counter

import grpc

METHOD = "/flowerssl.SplitStream/Exchange"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """One HPACK header field, a literal without indexing and without Huffman coding (RFC 7541 6.2.2)."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def raw_call_bytes(host: str, port: int) -> bytes:
    """A whole token-less gRPC call on a new HTTP/2 connection: preface, SETTINGS, HEADERS, DATA."""
    headers = b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", METHOD),
                                                    (":authority", f"{host}:{port}"),
                                                    ("content-type", "application/grpc"), ("te", "trailers")))
    return (PREFACE + _frame(1, 0x4, 1, headers)                       # HEADERS, END_HEADERS
            + _frame(0, 0x1, 1, b"\x00" + struct.pack(">I", 1) + b"x"))  # DATA, END_STREAM: one message


def raw_call(host: str, port: int, source: str, request: bytes) -> str:
    """One token-less call on a new connection from ``source``: ``answered`` (the server
    ended the stream: its trailers or a reset), ``cut`` (the connection closed first) or
    ``refused-connect`` (no connection)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.bind((source, 0))
        s.connect((host, port))
    except OSError:
        s.close()
        return "refused-connect"
    buf = b""
    try:
        s.sendall(request)
        while True:
            while len(buf) >= 9:
                length = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + length:
                    break
                kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                buf = buf[9 + length:]
                if kind == 4 and not flags & 0x1:
                    s.sendall(_frame(4, 0x1, 0))          # acknowledge the server's SETTINGS
                elif stream == 1 and (kind == 3 or (kind == 1 and flags & 0x1)):
                    return "answered"                      # RST_STREAM, or trailers (END_STREAM)
                elif kind == 7:
                    return "cut"                           # GOAWAY
            got = s.recv(65536)
            if not got:
                return "cut"
            buf += got
    except OSError:
        return "cut"
    finally:
        s.close()


def sources_from(first: str, n: int) -> list[str]:
    base = ipaddress.ip_address(first)
    return [str(base + i) for i in range(max(n, 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--hold", type=int, default=0)
    ap.add_argument("--source", default="127.0.0.1")
    ap.add_argument("--callers", type=int, default=0)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--flood", action="store_true")
    ap.add_argument("--sources", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    a = ap.parse_args()
    if not (ipaddress.ip_address(a.host).is_loopback and ipaddress.ip_address(a.source).is_loopback):
        raise SystemExit(f"{a.host} is not a loopback address; this tool attacks loopback only")
    stop = threading.Event()
    t_start = time.monotonic()
    end = t_start + min(a.seconds, 600.0)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    codes: Counter = Counter()
    calls = 0
    most = 0
    reconnects = 0
    socks: list[socket.socket | None] = [None] * a.hold
    retry = [0.0] * a.hold     # when a closed slot is re-opened
    state = [""] * a.hold      # "", "connecting", "open"
    sel = selectors.DefaultSelector()
    chans = [grpc.insecure_channel(f"{a.host}:{a.port}", options=[("grpc.use_local_subchannel_pool", 1),
                                                                  ("grpc.initial_reconnect_backoff_ms", 100),
                                                                  ("grpc.max_reconnect_backoff_ms", 500)])
             for _ in range(a.callers)] if not a.flood else []
    lock = threading.Lock()
    sources = sources_from(a.source, a.sources)
    if not all(ipaddress.ip_address(x).is_loopback for x in sources):
        raise SystemExit(f"--sources {a.sources} from {a.source} leaves the loopback range")
    request = raw_call_bytes(a.host, a.port)

    def flood(first: int) -> None:
        nonlocal calls
        i = first
        while not stop.is_set() and time.monotonic() < end:
            code = raw_call(a.host, a.port, sources[i % len(sources)], request)
            i += 1
            with lock:
                codes[code] += 1
                calls += 1
            if code == "refused-connect":
                time.sleep(0.01)

    flooders = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(max(a.callers, 1))] \
        if a.flood else []
    for t in flooders:
        t.start()
    pending: list = []
    next_call = time.monotonic()
    print(json.dumps({"ready": True}), flush=True)
    try:
        while not stop.is_set() and time.monotonic() < end:
            # raw connections (non-blocking): re-open the closed ones, each ``every`` s after it closed
            now = time.monotonic()
            for key, mask in sel.select(timeout=0):
                i = key.data
                s = socks[i]
                pause = a.every
                if state[i] == "connecting":
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        state[i] = "open"
                        reconnects += 1
                        try:   # an HTTP/2 client preface and an empty SETTINGS frame: a finished handshake
                            s.send(PREFACE)
                        except OSError:
                            pass
                        sel.modify(s, selectors.EVENT_READ, i)
                        continue
                    pause = 0.05   # the port is closed (between rounds): try again soon
                else:
                    try:
                        if s.recv(4096) != b"":
                            continue
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                sel.unregister(s)
                s.close()
                socks[i], state[i], retry[i] = None, "", now + pause
            for i in range(a.hold):
                if socks[i] is None and now >= retry[i]:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.bind((a.source, 0))
                    s.setblocking(False)
                    s.connect_ex((a.host, a.port))
                    socks[i], state[i] = s, "connecting"
                    sel.register(s, selectors.EVENT_WRITE, i)
            most = max(most, sum(st == "open" for st in state))
            # refused calls
            now = time.monotonic()
            if a.callers and not a.flood and now >= next_call:
                next_call = now + a.every
                for ch in chans:
                    pending.append(ch.unary_unary(METHOD).future(b"x", timeout=5))
                    calls += 1
            for f in [f for f in pending if f.done()]:
                pending.remove(f)
                try:
                    f.result()
                    codes["OK"] += 1
                except grpc.RpcError as e:
                    codes[e.code().name] += 1
            time.sleep(0.02)
    finally:
        stop.set()
        for t in flooders:
            t.join(5)
        for s in socks:
            if s is not None:
                s.close()
        for ch in chans:
            ch.close()
    took = time.monotonic() - t_start
    print(json.dumps({"most_held": most, "reconnects": reconnects, "calls": calls, "codes": dict(codes),
                      "seconds": round(took, 2)}), flush=True)


if __name__ == "__main__":
    main()
