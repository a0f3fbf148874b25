"""A low-latency channel for split exchanges: one gRPC bidirectional stream per node and round.

Flower messages cost about 0.1 s per exchange in simulation and several seconds in a
deployment (polling, and a new ClientApp process per message). With
``split-transport='stream'`` Flower carries only what it is good at -- the start of a
client's split round (node sampling, the bottom weights, authentication of the node) and
the round's final bottom weights in the reply -- while the ``I`` per-iteration exchanges
travel over a gRPC stream that the ServerApp hosts for the duration of the round:

1. The ServerApp starts a gRPC server (``split-stream-host``/``-port``; by default an
   ephemeral port on 127.0.0.1) and sends each sampled node the usual step-1 message plus
   the endpoint (``split-stream-address``), a per-node, per-round secret
   (``split-stream-token``), the server's certificate when TLS is on
   (``split-stream-cert``), the wait limit (``split-stream-timeout`` = ``round-timeout``)
   and the round's message bound (``split-stream-max-frame``).
2. The ClientApp handler (:func:`split_layer.worker.make_split_handlers`) connects,
   starts the call with the secret in its metadata and the streams of step 1 as its first
   frame, and runs every local iteration of the round over the stream, keeping its
   bottom model, optimizer and the autograd graph of the last forward pass in memory
   (no recomputation, nothing in ``context.state``).
3. The server sends the gradients of step ``I`` with ``final``; the client applies them and
   returns its final bottom weights as the reply to the Flower message of step 1.

The server side is :class:`StreamTransport` (a :class:`split_layer.transport.Transport`:
the split runtime and the algorithms do not change); the client side is :class:`StreamClient`.

Frames are :func:`encode` d as ``MAGIC | u32 header length | JSON header | raw tensor
bytes`` (dtype whitelist, sizes checked on :func:`decode`); no pickle ever crosses the wire.

Security (issue 14; threat model and tests in ``docs/bad-input.md``): the secret is 256
random bits per node and round. A client presents it in the **call metadata**
(``x-flowerssl-node``, ``x-flowerssl-token-bin``), and a server interceptor checks it -- as
bytes, in constant time, also for unknown nodes -- before any handler runs or any frame is
read: an unauthenticated call is refused at once (``UNAUTHENTICATED``, reason logged), so it
never holds a worker thread or waits on the network, and no concurrency limit that a genuine
node could run into exists for it to fill (``maximum_concurrent_rpcs`` is not used). Each
node has one stream per round (a second one is refused); the round's server accepts only
this round's nodes and tokens. Every message is bounded by the largest frame the round can
legitimately carry (:func:`max_frame_bytes` of the strategy's ``stream_specs``, plus a
margin), so gRPC rejects an oversized message before buffering it; the first frame has a
deadline (60 s after the call starts, plus the time to send the largest frame at 1 Mbit/s,
at most the timeout); idle connections are closed
(handshake timeout, idle timeout, keepalive pings both ways). TLS (``split-stream-tls``):
``auto`` (default) encrypts unless the address the clients dial (``split-stream-advertise``,
else the host) is a loopback address, ``on`` always, ``off`` never. The server makes a
fresh self-signed certificate for every round, valid for that round's longest legitimate
duration plus an hour, and ships it in the Flower start message, which itself travels over
the deployment's authenticated (TLS) channel, so there are no certificate files to manage;
the client trusts exactly that certificate. Each of the client's waits for a frame is
bounded by twice ``split-stream-timeout`` (the server's own wait for the slowest node, then
its answer; one wait per frame, not the round), and keepalive pings detect a half-open
connection.

Faults and waits: a node whose stream breaks, whose frame is malformed, whose Flower reply
is an error or that is silent for ``round-timeout`` seconds is dropped from the rest of the
round (logged, listed in ``dropped``), exactly as with the message transport; every wait on
both sides has that timeout.

Simulation: all sampled clients of a round must run at once (they wait on one another at
every iteration). Each node reports in its one-time ``split-info`` reply how many
ClientApps the simulation runs concurrently (Ray actor pool and Flower's worker threads,
:func:`simulation_concurrency`); if fewer than the sampled nodes, the round fails at once
with :class:`StreamConfigError` saying which federation setting to change
(:func:`concurrency_error`).
"""
from __future__ import annotations

import datetime as _dt
import hmac
import ipaddress
import json
import os
import queue
import secrets
import struct
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Iterator

import grpc
import numpy as np
from flwr.app import Message
from flwr.common import log

from .records import CONFIG_KEY, query
from .stream_guard import FD_RESERVE, MIN_CAP, UNAUTH_TOTAL, ConnectionGuard, RefusalLog, descriptor_room
from .transport import (
    Envelope,
    FlowerTransport,
    Transport,
    _fill,
    envelope_from_message,
)

__all__ = ["StreamOptions", "StreamTransport", "StreamClient", "StreamError", "StreamConfigError",
           "encode", "decode", "simulation_concurrency", "max_frame_bytes", "TRANSPORTS", "STREAM_KEYS"]

TRANSPORTS = ("message", "stream")
TLS_MODES = ("auto", "on", "off")
METHOD = "/flowerssl.SplitStream/Exchange"
TLS_NAME = "flower-ssl-split-stream"   # the certificate's name; the client pins the certificate itself
MAGIC = b"FSS1"
# config keys of the start message (client side)
STREAM_KEYS = {"address": "split-stream-address", "token": "split-stream-token", "node": "split-stream-node",
               "cert": "split-stream-cert", "timeout": "split-stream-timeout",
               "max-frame": "split-stream-max-frame", "session": "split-stream-session",
               "idle": "split-stream-idle"}
SESSION_MODES = ("auto", "run", "round")
# A session (one Flower message) may span many rounds, but not Flower's message TTL (12 h in
# flwr 1.41: a reply after it is discarded): a session older than this is ended at a round
# boundary and the node gets a fresh one.
SESSION_MAX_S = 11 * 3600.0
# call metadata that authenticates a client (checked before any frame is read)
NODE_HEADER = "x-flowerssl-node"
TOKEN_HEADER = "x-flowerssl-token-bin"   # "-bin": raw bytes, so any token value arrives and is compared as bytes
_DTYPES = {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}
FRAME_MARGIN = 64 * 1024          # header, tensor table, error text on top of the tensor bytes
DEFAULT_MAX_FRAME = 64 * 2 ** 20  # a transport whose owner declares no stream specs
FIRST_FRAME_S = 60.0              # the first frame's deadline after the call starts (at most the timeout),
FIRST_FRAME_RATE = 128 * 1024     # ... plus the time to send the largest frame at 1 Mbit/s
MAX_STREAMS_PER_CONNECTION = 4    # a genuine client uses one stream per connection
TARPIT_S = 1.0                    # a banned address's refused call is held at most this long
TARPIT_CALLS = 16                 # ... and at most this many at once
BIND_RETRY_S = 5.0                # a fixed port still held is retried this long
STOP_WAIT_S = 10.0                # a stopping server is waited for this long (its port is then free)
# keepalive: the client pings every 30 s (also while it computes and sends nothing); the server
# accepts pings that often, pings every 60 s itself, and closes a connection whose pings go
# unanswered for 20 s, one that has not finished its handshake in 20 s or that holds no call for 60 s.
# Each client has a connection of its own (no subchannel shared with other clients of the process).
_KEEPALIVE_CLIENT = [("grpc.use_local_subchannel_pool", 1),
                     ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 20_000),
                     ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0)]
_KEEPALIVE_SERVER = [("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                     ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                     ("grpc.http2.max_ping_strikes", 3), ("grpc.server_handshake_timeout_ms", 20_000),
                     ("grpc.max_connection_idle_ms", 60_000)]


def _grpc_options(max_receive: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", int(max_receive)),
            ("grpc.so_reuseport", 0)]


class StreamError(RuntimeError):
    """The split stream broke, timed out, or carried a malformed frame."""


class StreamConfigError(RuntimeError):
    """The stream transport cannot work with this run's settings (message says what to change)."""


# --------------------------------------------------------------------------- frames
def encode(header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """One frame: ``MAGIC | u32 len | JSON header (+ tensor table) | raw tensor bytes``."""
    table, blobs = [], []
    for name, arr in (tensors or {}).items():
        a = np.asarray(arr)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype.name not in _DTYPES:
            raise StreamError(f"tensor '{name}' has dtype {a.dtype.name}; allowed: {sorted(_DTYPES)}")
        table.append([name, a.dtype.name, list(a.shape), int(a.nbytes)])
        blobs.append(a.tobytes() if a.ndim == 0 or a.size == 0 else memoryview(a).cast("B"))
    head = json.dumps({"h": header, "t": table}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *blobs])


def decode(buf: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of :func:`encode`; raises :class:`StreamError` on anything malformed."""
    try:
        if len(buf) < 8 or buf[:4] != MAGIC:
            raise StreamError("not a split-stream frame (bad magic)")
        (n,) = struct.unpack_from("<I", buf, 4)
        if 8 + n > len(buf):
            raise StreamError(f"frame header of {n} bytes runs past the frame ({len(buf)} bytes)")
        meta = json.loads(bytes(buf[8:8 + n]))
        header, table = meta["h"], meta["t"]
        if not isinstance(header, dict) or not isinstance(table, list):
            raise StreamError("frame header is not {'h': {...}, 't': [...]}")
        off, out = 8 + n, {}
        for name, dtype, shape, size in table:
            if dtype not in _DTYPES:
                raise StreamError(f"tensor '{name}': dtype {dtype!r} not allowed; allowed: {sorted(_DTYPES)}")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape) or int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize != size:
                raise StreamError(f"tensor '{name}': shape {shape} and {size} bytes do not match dtype {dtype}")
            if off + size > len(buf):
                raise StreamError(f"tensor '{name}' runs past the end of the frame")
            out[str(name)] = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)),
                                           offset=off).reshape(shape)
            off += size
        if off != len(buf):
            raise StreamError(f"{len(buf) - off} trailing bytes after the last tensor")
        return header, out
    except StreamError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is a malformed frame
        raise StreamError(f"malformed split-stream frame: {type(e).__name__}: {e}") from None


def max_frame_bytes(specs: dict[str, Any] | None) -> int:
    """The largest frame a node may send: the tensor bytes of its ``stream_specs`` plus
    :data:`FRAME_MARGIN`` (JSON header, tensor table, an error text). ``None``: no specs
    known, :data:`DEFAULT_MAX_FRAME`."""
    if specs is None:
        return DEFAULT_MAX_FRAME
    total = 0
    for spec in specs.values():
        total += int(np.prod(tuple(spec.shape), dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    return int(total + FRAME_MARGIN + 128 * len(specs))


def pack_arrays(arrays: dict[str, dict[str, np.ndarray]]) -> tuple[list[list[str]], dict[str, np.ndarray]]:
    """Named state dicts as one frame's tensors: ``(table, tensors)`` where ``table[i] =
    [name, key]`` names tensor ``str(i)`` (state-dict keys may hold any character)."""
    table, tensors = [], {}
    for name, sd in arrays.items():
        for key, v in sd.items():
            tensors[str(len(table))] = v
            table.append([str(name), str(key)])
    return table, tensors


def unpack_arrays(table: Any, tensors: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of :func:`pack_arrays`; a table that does not name exactly the frame's tensors
    raises :class:`StreamError`."""
    if not isinstance(table, list) or len(table) != len(tensors):
        raise StreamError(f"arrays table does not match the frame's {len(tensors)} tensor(s)")
    out: dict[str, dict[str, np.ndarray]] = {}
    for i, entry in enumerate(table):
        if (not isinstance(entry, list) or len(entry) != 2 or not all(isinstance(x, str) for x in entry)
                or str(i) not in tensors):
            raise StreamError(f"arrays table entry {i} is not [name, key] of a tensor in the frame")
        out.setdefault(entry[0], {})[entry[1]] = tensors[str(i)]
    return out


def config_to_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Flower ConfigRecord's values (numbers, strings, bools, bytes, lists of them) as JSON:
    bytes become ``{"b64": ...}``."""
    import base64

    def enc(v):
        if isinstance(v, (bytes, bytearray)):
            return {"b64": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v
    return {str(k): enc(v) for k, v in cfg.items()}


def config_from_json(obj: Any) -> dict[str, Any]:
    """Inverse of :func:`config_to_json`; anything but such a dict raises :class:`StreamError`."""
    import base64

    def dec(v):
        if isinstance(v, dict):
            if set(v) != {"b64"} or not isinstance(v["b64"], str):
                raise StreamError("a config value is an object other than {'b64': ...}")
            return base64.b64decode(v["b64"])
        if isinstance(v, list):
            return [dec(x) for x in v]
        if v is None:
            raise StreamError("a config value is null")
        return v
    if not isinstance(obj, dict):
        raise StreamError("config is not an object")
    return {str(k): dec(v) for k, v in obj.items()}


def metrics_from_json(obj: Any) -> dict[str, Any]:
    """Reply metrics from a frame header: numbers or lists of numbers only."""
    def num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if not isinstance(obj, dict) or not all(num(v) or (isinstance(v, list) and all(num(x) for x in v))
                                            for v in obj.values()):
        raise StreamError("metrics are not an object of numbers")
    return {str(k): v for k, v in obj.items()}


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class StreamOptions:
    """Where and how the ServerApp hosts the stream (run-config keys ``split-stream-*``)."""

    host: str = "127.0.0.1"       # bind address ("0.0.0.0" to accept remote SuperNodes)
    advertise: str = ""           # address sent to clients ("" = host; needed when host is 0.0.0.0)
    port: int = 0                 # 0 = an ephemeral port per round
    tls: str = "auto"             # auto | on | off
    timeout: float = 600.0        # every wait, both sides (the run's round-timeout)
    session: str = "auto"         # auto | run | round: how long one node's stream session lasts
    allow_plaintext: bool = False  # tls='off' towards a non-loopback address: the user's explicit consent

    def __post_init__(self) -> None:
        if self.tls not in TLS_MODES:
            raise ValueError(f"split-stream-tls={self.tls!r} is not one of: {', '.join(TLS_MODES)}")
        if self.session not in SESSION_MODES:
            raise ValueError(f"split-stream-session={self.session!r} is not one of: {', '.join(SESSION_MODES)}")
        if self.host in ("0.0.0.0", "::", "") and not self.advertise:
            raise ValueError(f"split-stream-host={self.host!r} binds every interface; set split-stream-advertise "
                             f"to the address SuperNodes reach the ServerApp at")
        if self.tls == "off" and not _is_loopback(self.address_host) and not self.allow_plaintext:
            raise ValueError(
                f"split-stream-tls='off' with SuperNodes dialling {self.address_host!r}, which is not a loopback "
                f"address: each node's session token and every activation and gradient would cross the network "
                f"in the clear. Use split-stream-tls='auto' or 'on', or set split-stream-allow-plaintext=true "
                f"to accept that (e.g. on a network you trust; a warning is logged every run)")

    @property
    def address_host(self) -> str:
        return self.advertise or self.host

    def use_tls(self) -> bool:
        """``auto``: TLS unless the address the clients dial (advertise, else host) is loopback."""
        if self.tls != "auto":
            return self.tls == "on"
        return not _is_loopback(self.address_host)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ephemeral_certificate(valid_for: float = 86_400.0) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM): a fresh self-signed P-256 certificate (one per round),
    valid from 5 minutes ago for ``valid_for`` seconds."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(seconds=float(valid_for)))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))


# --------------------------------------------------------------------------- simulation check
def simulation_concurrency() -> tuple[int, int]:
    """``(actors, threads)`` of Flower's simulation, seen from inside a ClientApp; ``(0, 0)`` if not simulated.

    Flower's Ray backend builds ``sum over Ray nodes of int(node CPUs / client num_cpus)``
    actors (GPUs likewise) and feeds them from ``ThreadPoolExecutor()`` workers, at most
    ``min(32, os.cpu_count() + 4)`` of them: at most ``min(actors, threads)`` ClientApps run
    at once.
    """
    ray = sys.modules.get("ray")  # imported only inside a Ray worker; never import it here
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return 0, 0
    try:
        res = ray.get_runtime_context().get_assigned_resources()
        cpu, gpu = float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))
        actors = 0
        for node in ray.nodes():
            have = node.get("Resources") or {}
            if not have or cpu <= 0:
                continue
            n = int(have.get("CPU", 0) / cpu)
            if gpu > 0:
                n = min(n, int(have.get("GPU", 0) / gpu))
            actors += n
        if actors <= 0:
            return 0, 0
        return actors, min(32, (os.cpu_count() or 1) + 4)
    except Exception:  # noqa: BLE001 - an unknown runtime imposes no check
        return 0, 0


def concurrency_error(sampled: int, actors: int, threads: int) -> str:
    """What to change when a simulation runs fewer ClientApps at once than a round samples."""
    most = min(actors, threads)
    msg = (f"split-transport='stream' needs all {sampled} sampled clients of a round running at once, but this "
           f"simulation runs at most {most} ClientApps concurrently ({actors} Ray actors, {threads} Flower worker "
           f"threads). ")
    if sampled <= threads:
        msg += (f"Give Ray more logical CPUs per real core, e.g. `flwr run . --federation-config \"num-supernodes=... "
                f"init-args-num-cpus={sampled} client-resources-num-cpus=1\"` (the clients then share the real "
                f"cores; `flwr run` takes whole CPUs only; `run_simulation` also takes fractions such as "
                f"client_resources={{'num_cpus': {max(0.01, (os.cpu_count() or 1) / sampled):.2g}}}), ")
    else:
        msg += (f"Flower's simulation runs at most {threads} ClientApps at once on this machine "
                f"(min(32, CPUs + 4)), so sample at most {threads} nodes per round (fraction-train), ")
    return msg + "or use split-transport='message'."


# --------------------------------------------------------------------------- server
class _Session:
    def __init__(self, token: str) -> None:
        self.token = token
        self.key = token.encode()        # compared as bytes
        self.outbox: queue.Queue = queue.Queue()
        self.connected = False
        self.closed = False
        self.context = None              # the live call's context (to cancel it)


def _metadata_value(metadata, key: str):
    for k, v in metadata or ():
        if k == key:
            return v
    return None


class _Server:
    """A gRPC server with one bidirectional-stream method; events go to one queue.

    ``max_frame``: the largest message accepted (bytes); ``lifetime``: seconds the round may
    legitimately last (the certificate's validity, plus an hour).
    """

    def __init__(self, opts: StreamOptions, nodes: list[int], max_frame: int = DEFAULT_MAX_FRAME,
                 lifetime: float = 86_400.0, expected: int = 0) -> None:
        self.events: queue.Queue = queue.Queue()   # (node, kind, payload) of the nodes' current sessions
        self._lock = threading.Lock()
        self.sessions: dict[int, _Session] = {}
        for n in nodes:
            self.open(n)
        self.max_frame = int(max_frame)
        self.first_frame_s = min(float(opts.timeout), FIRST_FRAME_S + self.max_frame / FIRST_FRAME_RATE)
        self.refusals = RefusalLog()
        self._tarpit = threading.BoundedSemaphore(TARPIT_CALLS)
        self._dummy = secrets.token_hex(32).encode()  # compared against for unknown nodes (same timing)
        # The connection budget (split_layer.stream_guard): room for the expected sessions, twice
        # over (nodes that join later), and for UNAUTH_TOTAL connections not yet authenticated;
        # gRPC closes any connection over the cap at accept, and the descriptors it may take are
        # checked against the process's limit, keeping FD_RESERVE for the ServerApp's own files.
        expected = max(int(expected), len(nodes), 1)
        self.session_room = expected + max(expected, 8)
        want = max(self.session_room + UNAUTH_TOTAL, MIN_CAP)
        room = descriptor_room(want + 16) - 16   # (16: gRPC's own listener and pollers)
        if room < expected + 8:
            raise StreamConfigError(
                f"split stream: this process may open only {max(room, 0)} more files (ulimit -n, keeping "
                f"{FD_RESERVE} for the run's own files), too few for one connection per node ({expected} expected) "
                f"plus a margin; raise the ServerApp's descriptor limit (`ulimit -n "
                f"{2 * self.session_room + UNAUTH_TOTAL + 256}` before starting it) or sample fewer nodes")
        self.capacity = min(want, room)
        self.session_room = min(self.session_room, self.capacity - 8)
        handler = grpc.method_handlers_generic_handler("flowerssl.SplitStream", {
            "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange)})
        # Genuine streams hold one worker each (one per node); refusals take one briefly and
        # never read the network (a banned address's are held briefly, at most TARPIT_CALLS), so a
        # few spare workers serve them all. Threads are made as needed.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.session_room + TARPIT_CALLS + 32,
                                                             thread_name_prefix="split-stream"),
                                  handlers=[handler], interceptors=[_AuthInterceptor(self)],
                                  options=_grpc_options(self.max_frame) + _KEEPALIVE_SERVER
                                  + [("grpc.max_allowed_incoming_connections", int(self.capacity)),
                                     ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION)])
        self.tls = opts.use_tls()
        bind = f"[{opts.host}]:{opts.port}" if ":" in opts.host else f"{opts.host}:{opts.port}"
        if self.tls:
            key, cert = ephemeral_certificate(lifetime + 3600.0)
            creds = grpc.ssl_server_credentials([(key, cert)])
            self.cert = cert.decode()
        else:
            creds = None
            self.cert = ""
        port = self._bind(bind, creds, opts)
        h = opts.address_host
        self.port = port
        self.address = f"[{h}]:{port}" if ":" in h else f"{h}:{port}"
        self.server.start()
        self.guard = ConnectionGuard(port, self.refusals)
        self.guard.start()

    def _bind(self, bind: str, creds, opts: StreamOptions) -> int:
        """Listen on ``bind``; a fixed port still held (by a server of this process that is
        stopping, or by another program) is retried for :data:`BIND_RETRY_S`, then a
        :class:`StreamConfigError` names ``split-stream-port``."""
        deadline = time.monotonic() + (BIND_RETRY_S if opts.port else 0.0)
        while True:
            try:
                port = (self.server.add_secure_port(bind, creds) if creds is not None
                        else self.server.add_insecure_port(bind))
            except RuntimeError:
                port = 0
            if port:
                return port
            if time.monotonic() >= deadline:
                raise StreamConfigError(
                    f"split stream: cannot listen on split-stream-host={opts.host!r} split-stream-port={opts.port}"
                    + (" (the port is in use: choose another split-stream-port, or 0 for an ephemeral one)"
                       if opts.port else ""))
            time.sleep(0.1)

    def open(self, node: int) -> "_Session":
        """A new session for ``node`` with a fresh token; a previous session of the node is
        closed (its call cancelled, its token no longer accepted, its events ignored)."""
        with self._lock:
            old = self.sessions.get(node)
            sess = self.sessions[node] = _Session(secrets.token_hex(32))
        if old is not None and not old.closed:
            old.closed = True
            old.outbox.put(None)
            if old.context is not None:
                old.context.cancel()
        return sess

    def _emit(self, sess: "_Session", node: int, kind: str, payload: Any) -> None:
        """An event of ``sess``, unless the node has a newer session by now."""
        if self.sessions.get(node) is sess:
            self.events.put((node, kind, payload))

    # ------------------------------------------------------------------ authentication
    def authenticate(self, metadata) -> tuple[int | None, str, str]:
        """``(node, "", "")`` for a call that carries a node of this session and its token, else
        ``(None, reason, why)`` (``reason``: one of ``stream_guard.REASONS``). The token is
        compared as bytes in constant time (also for an unknown node, against a dummy)."""
        raw_node, token = _metadata_value(metadata, NODE_HEADER), _metadata_value(metadata, TOKEN_HEADER)
        if raw_node is None or token is None:
            return None, "no-credentials", "no node id or token in the call metadata"
        if isinstance(token, str):
            token = token.encode("utf-8", "surrogateescape")
        try:
            node = int(raw_node)
        except (TypeError, ValueError):
            node = None
        sess = self.sessions.get(node) if node is not None else None
        ok = hmac.compare_digest(bytes(token), sess.key if sess is not None else self._dummy)
        if sess is None:
            return None, "unknown-node", f"node {str(raw_node)[:40]!r} is not in this round"
        if not ok:
            return None, "wrong-token", f"wrong token for node {node}"
        return node, "", ""

    def refuse(self, reason: str, why: str, peer: str = "") -> None:
        """Count a refused call (bounded: ``stream_guard.RefusalLog``) and have its connection closed."""
        self.refusals.add(reason, why, peer)
        if peer:
            self.guard.refused(peer)

    def _refusal(self, reason: str, why: str):
        def refuse(request_iterator, context):  # never reads a frame
            peer = context.peer()
            self.refuse(reason, why, peer)
            # a flooder's call is held until the guard cuts its connection (within FAST_SWEEP_S; at
            # most TARPIT_S), so that it cannot make the next one at once: its calls then cost this
            # process a connection each instead of gRPC's ~0.2 ms of a core per call. At most
            # TARPIT_CALLS are held at once, so the workers genuine sessions need stay free.
            if self.guard.is_banned(peer) and self._tarpit.acquire(blocking=False):
                try:
                    deadline = time.monotonic() + TARPIT_S
                    while context.is_active() and time.monotonic() < deadline:
                        time.sleep(0.005)
                finally:
                    self._tarpit.release()
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"split stream: {why}")
        return grpc.stream_stream_rpc_method_handler(refuse)

    # ------------------------------------------------------------------ the call
    def _exchange(self, request_iterator: Iterator[bytes], context) -> Iterator[bytes]:
        peer = context.peer()
        node, reason, why = self.authenticate(context.invocation_metadata())  # again, in case of another door in
        if node is None:
            self.refuse(reason, why, peer)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"split stream: {why}")
            return
        sess = self.sessions[node]
        with self._lock:
            reason, why = (("already-connected", f"node {node} is already connected in this session") if sess.connected
                           else ("already-dropped", f"node {node} was already dropped from this session")
                           if sess.closed else ("", ""))
            if not why:
                sess.connected = True
                sess.context = context
        if why:
            self.refuse(reason, why, peer)
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"split stream: {why}")
            return
        self.guard.authenticated(peer)   # a genuine session's connection: outside the budget
        try:
            yield from self._session(sess, node, request_iterator, context)
        finally:
            self.guard.released(peer)

    def _session(self, sess: "_Session", node: int, request_iterator: Iterator[bytes], context) -> Iterator[bytes]:
        timer = threading.Timer(self.first_frame_s, self._first_frame_late, args=(sess, node, context))
        timer.daemon = True
        timer.start()
        try:
            first = next(request_iterator)
        except StopIteration:
            self._emit(sess, node, "closed", "the client closed its stream before its first frame")
            return
        except Exception as e:  # noqa: BLE001 - cancelled (deadline) or broken
            self._emit(sess, node, "closed", f"no first frame: {type(e).__name__}: {e}")
            return
        finally:
            timer.cancel()
        try:
            header, tensors = decode(first)
        except StreamError as e:
            self._emit(sess, node, "closed", f"bad first frame: {e}")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad first frame: {e}")
            return
        self._emit(sess, node, "frame", (header, tensors))
        # lock-step in this one thread: a response out, then the client's next frame in
        while context.is_active():
            try:
                item = sess.outbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item
            try:
                req = next(request_iterator)
            except StopIteration:
                self._emit(sess, node, "closed", "the client closed its stream")
                return
            except Exception as e:  # noqa: BLE001 - a broken stream
                self._emit(sess, node, "closed", f"stream broke: {type(e).__name__}: {e}")
                return
            self._emit(sess, node, "frame", req)
        self._emit(sess, node, "closed", "the stream was cancelled")

    def _first_frame_late(self, sess: "_Session", node: int, context) -> None:
        self._emit(sess, node, "closed", f"no first frame within {self.first_frame_s:.0f} s of the call")
        context.cancel()

    def send(self, node: int, frame: bytes) -> None:
        self.sessions[node].outbox.put(frame)

    def end(self, node: int, cancel: bool = False) -> None:
        """No more frames for ``node``; ``cancel``: also cut its call now (a dropped node)."""
        sess = self.sessions.get(node)
        if sess is not None and not sess.closed:
            sess.closed = True
            sess.outbox.put(None)
            if cancel and sess.context is not None:
                sess.context.cancel()

    def stop(self) -> None:
        """End every session and stop; returns once the port is free again (a fixed
        ``split-stream-port`` can be bound by the next server at once)."""
        for n in list(self.sessions):
            self.end(n)
        self.guard.stop()
        if not self.server.stop(grace=1.0).wait(STOP_WAIT_S):
            log(WARNING, "split stream: the server on port %s did not stop within %.0f s", self.port, STOP_WAIT_S)
        self.refusals.final()


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses a call whose metadata does not authenticate a node of this round, before any
    handler runs or any frame is read."""

    def __init__(self, server: _Server) -> None:
        self.srv = server

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method != METHOD:
            return self.srv._refusal("unknown-method", f"unknown method {str(handler_call_details.method)[:80]!r}")
        node, reason, why = self.srv.authenticate(handler_call_details.invocation_metadata)
        if node is None:
            return self.srv._refusal(reason, why)
        return continuation(handler_call_details)


class StreamTransport(Transport):
    """Split exchanges over gRPC streams; Flower messages start (and end) the nodes' sessions.

    Only the ``split`` op streams; every other op (e.g. ``split-info``) goes through
    Flower messages (:class:`FlowerTransport`). The step of an exchange is read from the
    envelopes' ``split-step``/``split-iters`` (the runtime's protocol, see
    :mod:`split_layer.runtime`).

    **Sessions** (``StreamOptions.session``). A node's session starts with one Flower
    message (the step-1 message of a round, with the endpoint and a fresh token) and holds
    one gRPC stream. With ``round`` it ends with that round: the final bottom is the Flower
    reply. With ``run`` it spans rounds: the final bottom comes back over the stream, the
    node then waits on the stream, and a later round starts with a ``round`` frame carrying
    the round's config and the bottom (+ extras) instead of a Flower message; the session
    ends with ``bye`` when the run ends (:meth:`close`), and the ClientApp then returns its
    Flower reply. A node that is dropped (broken stream, error, timeout, bad payload) loses
    its session and gets a new one, by a Flower message, the next round it is sampled; so
    does a node joining late. ``auto``: ``run`` unless a simulation cannot run every node's
    ClientApp at once (idle sessions hold a Ray actor each), then ``round``.
    """

    def __init__(self, strategy, grid, opts: StreamOptions) -> None:
        self.strategy, self.grid, self.opts = strategy, grid, opts
        self.flower = FlowerTransport(strategy, grid)
        self.server: _Server | None = None
        self.spans: bool | None = None       # sessions span rounds (decided at the first round)
        self.msg_of: dict[int, str] = {}     # node -> id of the Flower message that started its session
        self.born: dict[int, float] = {}     # node -> when its session started (monotonic)
        self.alive: set[int] = set()         # nodes of the exchange under way
        self.live: set[int] = set()          # nodes with an open session, idle between visits
        self.broken: dict[int, str] = {}     # node -> why its stream ended
        self.replied: set[int] = set()       # nodes whose Flower reply was pulled (pull once only)
        self._early: dict[int, Message] = {}  # good replies pulled before the round's end

    # ------------------------------------------------------------------ helpers
    def _drop(self, node: int, why: str) -> None:
        if node in self.alive:
            self.alive.discard(node)
            self.live.discard(node)
            self.strategy.drop(node, why)
            if self.server is not None:
                self.server.end(node, cancel=True)

    def _pull_replies(self) -> None:
        """Pull the replies to the session messages of the nodes under way: an error means the
        ClientApp died (drop the node now); a good one is the node's final reply (a session
        of one round) or, for a session that spans rounds, its unexpected end."""
        ids = {self.msg_of[n]: n for n in self.alive if n not in self.replied and n in self.msg_of}
        if not ids:
            return
        for r in self.grid.pull_messages(list(ids)):
            node = ids.get(r.metadata.reply_to_message_id)
            if node is None:
                continue
            self.replied.add(node)  # a reply is pulled once; asking again is an error in Flower
            if r.has_error():
                self._drop(node, f"ClientApp error: {(r.error.reason or '')[:500]}")
            elif self.spans:
                self._drop(node, "its ClientApp ended the session in the middle of a round")
            else:
                self._early[node] = r

    def _collect(self, nodes: set[int], what: str) -> dict[int, tuple[dict, dict]]:
        """Wait for one frame from each node (timeout ``round-timeout``)."""
        got: dict[int, tuple[dict, dict]] = {}
        deadline = time.monotonic() + self.opts.timeout
        while True:
            waiting = (nodes & self.alive) - set(got)
            for n in sorted(waiting & set(self.broken)):
                self._pull_replies()  # prefer the ClientApp's own error text
                self._drop(n, f"{self.broken[n]} before sending its {what}")
            waiting -= set(self.broken)
            if not waiting:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                for n in sorted(waiting):
                    self._drop(n, f"no {what} on the split stream within {self.opts.timeout:.0f} s")
                return got
            try:
                node, kind, payload = self.server.events.get(timeout=min(left, 0.25))
            except queue.Empty:
                self._pull_replies()
                continue
            if kind == "closed":
                self.broken.setdefault(node, str(payload))
                self.live.discard(node)
                continue
            if node not in waiting:
                continue
            try:
                header, tensors = payload if isinstance(payload, tuple) else decode(payload)
                if "error" in header:
                    raise StreamError(f"client error: {header['error']}")
            except StreamError as e:
                self._drop(node, str(e))
                continue
            got[node] = (header, tensors)

    def _reap(self) -> None:
        """Take in what happened to idle sessions since the last exchange (a stream that broke
        between rounds): such a node gets a new session when it is next sampled."""
        while True:
            try:
                node, kind, payload = self.server.events.get_nowait()
            except queue.Empty:
                return
            if kind == "closed":
                self.live.discard(node)
                if node not in self.alive:
                    log(INFO, "split stream: node %s's idle session ended (%s); it gets a new one when sampled",
                        node, payload)

    # ------------------------------------------------------------------ the protocol
    def exchange(self, server_round: int, op: str, out: dict[int, Envelope]) -> dict[int, Envelope]:
        if op != "split":
            return self.flower.exchange(server_round, op, out)
        if not out:
            return {}
        cfg = next(iter(out.values())).config
        step, iters = int(cfg["split-step"]), int(cfg["split-iters"])
        if step == 1:
            return self._start(server_round, out)
        # nodes the runtime stopped addressing (dropped by validation) leave the stream
        for n in sorted(self.alive - set(out)):
            self.alive.discard(n)
            self.server.end(n, cancel=True)
        for n, env in out.items():
            if n in self.alive:
                self.server.send(n, encode({"step": step, "final": step > iters}, env.tensors))
        if step <= iters:
            return {n: Envelope(tensors=t) for n, (h, t) in self._collect(set(out), f"streams of step {step}").items()}
        return self._finish(set(out))

    def decide_spans(self, nodes: list[int]) -> bool:
        """Whether sessions span rounds (``StreamOptions.session``; see the class docstring)."""
        if self.opts.session == "round":
            return False
        limits = self.sim_limits(nodes)
        if limits is None:
            return True  # a deployment: every SuperNode runs its own ClientApp
        actors, threads = limits
        total = len(self.grid.get_node_ids())
        if total <= min(actors, threads):
            return True
        if self.opts.session == "run":
            raise StreamConfigError(
                f"split-stream-session='run' keeps a ClientApp running on each of the {total} nodes, but this "
                f"simulation runs at most {min(actors, threads)} at once ({actors} Ray actors, {threads} Flower "
                f"worker threads): use split-stream-session='auto' or 'round', or give Ray more logical CPUs "
                f"(init-args-num-cpus) per ClientApp")
        log(INFO, "split stream: one session per round (this simulation runs at most %d ClientApps at once, "
            "fewer than its %d nodes)", min(actors, threads), total)
        return False

    def _open_server(self, out: dict[int, Envelope], iters: int) -> None:
        # sized from the nodes: a session per node that can have one at once (every node of the
        # federation when sessions span rounds, the sampled ones otherwise), in both modes
        nodes = len(self.grid.get_node_ids())
        if self.spans:  # one server for the run: bound by the largest frame any round can carry
            bound = max(self.max_frame(list(out), largest=True),
                        2 * max(nbytes_arrays(e.arrays) for e in out.values()) + FRAME_MARGIN)
            self.server = _Server(self.opts, [], max_frame=bound, lifetime=SESSION_MAX_S,
                                  expected=max(nodes, len(out), len(self.live)))
        else:
            self.server = _Server(self.opts, [], max_frame=self.max_frame(list(out)),
                                  lifetime=self.opts.timeout * (iters + 2), expected=len(out))
        if not self.server.tls and not _is_loopback(self.opts.address_host):
            log(WARNING, "split stream: TLS is off (split-stream-tls='off', split-stream-allow-plaintext=true): "
                "the session tokens and every activation and gradient cross the network to %s in the clear",
                self.server.address)
        log(INFO, "split stream on %s (%s), sessions %s, up to %d connections", self.server.address,
            "TLS" if self.server.tls else "plaintext", "span rounds" if self.spans else "of one round",
            self.server.capacity)

    def _start(self, server_round: int, out: dict[int, Envelope]) -> dict[int, Envelope]:
        self.check_concurrency(list(out))
        iters = int(next(iter(out.values())).config.get("split-iters", 1))
        if self.spans is None:
            self.spans = self.decide_spans(list(out))
        if not self.spans:
            self.close()
        elif self.server is not None and len(self.live | set(out)) > self.server.session_room:
            log(INFO, "split stream: %d sessions exceed the server's room for %d; every node gets a new session",
                len(self.live | set(out)), self.server.session_room)
            self.close()
        if self.server is None:
            self._open_server(out, iters)
        self._reap()
        self._early = {}
        now = time.monotonic()
        msgs, resumed = [], 0
        for n, env in out.items():
            self.broken.pop(n, None)
            if n in self.live and now - self.born.get(n, now) < SESSION_MAX_S:
                content = self.strategy.base_content(server_round, action="split", **env.config)
                table, tensors = pack_arrays(env.arrays)
                head = {"round": int(server_round), "arrays": table,
                        "config": config_to_json(dict(content.config_records[CONFIG_KEY]))}
                self.server.send(n, encode(head, tensors))
                resumed += 1
                continue
            if n in self.live:  # too old for Flower's message TTL: end it, start a new one
                self.server.send(n, encode({"bye": True}))
                self.server.end(n)
            sess = self.server.open(n)
            extra = {STREAM_KEYS["address"]: self.server.address, STREAM_KEYS["token"]: sess.token,
                     STREAM_KEYS["node"]: int(n),
                     STREAM_KEYS["cert"]: self.server.cert, STREAM_KEYS["timeout"]: float(self.opts.timeout),
                     STREAM_KEYS["max-frame"]: int(self.server.max_frame),
                     STREAM_KEYS["session"]: int(bool(self.spans)), STREAM_KEYS["idle"]: float(SESSION_MAX_S)}
            content = _fill(self.strategy.base_content(server_round, action="split", **env.config, **extra), env)
            msgs.append(query(content, n, "split", str(server_round)))
        self.live -= set(out)
        if msgs:
            for m, mid in zip(msgs, self.grid.push_messages(msgs)):
                n = m.metadata.dst_node_id
                self.msg_of[n], self.born[n] = mid, now
                self.replied.discard(n)
        self.alive = set(out)
        log(INFO, "round %s: split stream, %d node(s): %d new session(s) by Flower message, %d over the stream",
            server_round, len(out), len(msgs), resumed)
        got = self._collect(set(out), "streams of step 1")
        return {n: Envelope(tensors=t) for n, (h, t) in got.items()}

    def _finish(self, nodes: set[int]) -> dict[int, Envelope]:
        """After the final gradients: the final bottoms come back, as Flower replies (sessions
        of one round) or as a ``final`` frame on the stream (sessions that span rounds)."""
        if self.spans:
            out: dict[int, Envelope] = {}
            for n, (h, t) in self._collect(nodes, "final weights").items():
                try:
                    if not h.get("final"):
                        raise StreamError(f"expected the final weights, got a frame with header {sorted(h)}")
                    out[n] = Envelope(arrays=unpack_arrays(h.get("arrays"), t),
                                      metrics=metrics_from_json(h.get("metrics", {})),
                                      config=config_from_json(h.get("config", {})))
                except StreamError as e:
                    self._drop(n, f"bad final frame: {e}")
            self.alive -= set(out)
            self.live |= set(out)
            return out
        out = {}
        deadline = time.monotonic() + self.opts.timeout
        while True:
            for n, r in list(self._early.items()):
                if n in self.alive and n in nodes:
                    out[n] = envelope_from_message(r)
                self._early.pop(n)
            waiting = (nodes & self.alive) - set(out)
            if not waiting or time.monotonic() > deadline:
                break
            self._pull_replies()
            if not self._early:
                time.sleep(0.01)
        for n in sorted((nodes & self.alive) - set(out)):
            self._drop(n, f"no final reply within {self.opts.timeout:.0f} s")
        self.close()
        return out

    def max_frame(self, nodes: list[int], largest: bool = False) -> int:
        """The message bound: the largest frame any of ``nodes`` may send, from the strategy's
        ``stream_specs`` (gradients down are never larger than the streams up); ``largest``:
        at the largest batch a node can be given in any round (``largest_stream_specs``)."""
        specs = getattr(self.strategy, "largest_stream_specs" if largest else "stream_specs", None)
        if specs is None:
            return DEFAULT_MAX_FRAME
        return max(max_frame_bytes(specs(n)) for n in nodes)

    def sim_limits(self, nodes: list[int]) -> tuple[int, int] | None:
        """``(Ray actors, Flower worker threads)`` of a simulation, as ``nodes`` reported them in
        ``split-info``; ``None`` outside a simulation (a deployment, LocalGrid)."""
        seen = [(int(i.get("sim-actors", 0)), int(i.get("sim-threads", 0)))
                for i in (getattr(self.strategy, "info", {}).get(n, {}) for n in nodes)]
        seen = [(a, t) for a, t in seen if a > 0 and t > 0]
        if not seen:
            return None
        return min(a for a, _ in seen), min(t for _, t in seen)

    def check_concurrency(self, nodes: list[int]) -> None:
        limits = self.sim_limits(nodes)
        if limits is None:
            return
        actors, threads = limits
        if len(nodes) > min(actors, threads):
            raise StreamConfigError(concurrency_error(len(nodes), actors, threads))

    def end_round(self) -> None:
        """After a round: sessions of one round end here; sessions that span rounds stay open,
        except those cut short in the middle of the round (a skipped round), which are cancelled."""
        if not self.spans:
            self.close()
            return
        if self.server is not None:
            for n in sorted(self.alive):
                self.server.end(n, cancel=True)
        self.alive = set()

    def close(self, wait: float = 30.0) -> None:
        """End every session (``bye`` to the idle ones, whose ClientApps then return their
        Flower replies; waited for up to ``wait`` s) and stop the server."""
        if self.server is None:
            return
        bye = sorted(self.live)
        for n in bye:
            self.server.send(n, encode({"bye": True}))
            self.server.end(n)
        for n in sorted(self.alive):
            self.server.end(n, cancel=True)
        ids = {self.msg_of[n]: n for n in bye if n in self.msg_of and n not in self.replied}
        deadline = time.monotonic() + min(wait, self.opts.timeout)
        while ids and time.monotonic() < deadline:
            for r in self.grid.pull_messages(list(ids)):
                n = ids.pop(r.metadata.reply_to_message_id, None)
                self.replied.add(n)
                if r.has_error():
                    log(WARNING, "split stream: node %s's session ended with an error: %s", n,
                        (r.error.reason or "")[:300])
            if ids:
                time.sleep(0.01)
        self.live, self.alive = set(), set()
        self.server.stop()
        self.server = None


def nbytes_arrays(arrays: dict[str, dict[str, np.ndarray]]) -> int:
    return int(sum(np.asarray(v).nbytes for sd in arrays.values() for v in sd.values()))


# --------------------------------------------------------------------------- client
class StreamClient:
    """The ClientApp end of one round's stream (lock-step: send a frame, receive a frame).

    The call starts as soon as the connection is up (its metadata authenticates the node);
    the first frame follows with the first :meth:`send`; each :meth:`recv` waits at most ``2 x timeout`` seconds (the
    server waits ``timeout`` for the slowest node, then answers), and keepalive pings detect
    a dead server sooner. ``max_frame``: the largest message
    accepted from the server (the round's bound, from the start message; 0 = unbounded).
    """

    def __init__(self, address: str, token: str | bytes, node: int, cert: str = "", timeout: float = 600.0,
                 max_frame: int = 0) -> None:
        self.node, self.timeout = node, float(timeout)
        # the server waits up to ``timeout`` for the slowest node of a step before it computes and
        # answers, so one wait here is bounded by twice that (not by timeout x iterations)
        self.recv_wait = 2.0 * self.timeout
        self.token = token if isinstance(token, bytes) else str(token).encode("utf-8", "surrogateescape")
        opts = _grpc_options(int(max_frame) if max_frame and max_frame > 0 else -1) + _KEEPALIVE_CLIENT
        if cert:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.encode())
            self.channel = grpc.secure_channel(address, creds,
                                               options=opts + [("grpc.ssl_target_name_override", TLS_NAME)])
        else:
            self.channel = grpc.insecure_channel(address, options=opts)
        self.address = address
        self._out: queue.Queue = queue.Queue()
        self.call = None
        self._first = True
        wait = min(self.timeout, 120.0)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=wait)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise StreamError(f"cannot connect to the split stream at {address} within {wait:.0f} s (is "
                              f"split-stream-advertise reachable from this SuperNode?)") from None
        # the call (whose metadata authenticates the node) starts with the connection: the server
        # closes a connection that has not authenticated within seconds (split_layer.stream_guard);
        # its first frame follows when the node has computed it
        self._start_call()

    def _requests(self) -> Iterator[bytes]:
        while True:
            item = self._out.get()
            if item is None:
                return
            yield item

    def _start_call(self) -> None:
        metadata = ((NODE_HEADER, str(int(self.node))), (TOKEN_HEADER, self.token))
        self.call = self.channel.stream_stream(METHOD)(self._requests(), metadata=metadata, wait_for_ready=True)

    def send(self, header: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
        self._out.put(encode({**header, "node": self.node} if self._first else header, tensors))
        self._first = False

    def recv(self, wait: float | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The server's next frame, waiting at most ``wait`` seconds (default ``2 x timeout``;
        a session waiting for its next round passes the session's idle limit)."""
        if self._first:
            raise StreamError("split stream: recv before the first send")
        late = threading.Event()
        limit = self.recv_wait if wait is None else float(wait)

        def too_late() -> None:
            late.set()
            self.call.cancel()

        timer = threading.Timer(limit, too_late)
        timer.daemon = True
        timer.start()
        try:
            frame = next(self.call)
        except StopIteration:
            raise StreamError(f"split stream {self.address}: the server ended the stream") from None
        except grpc.RpcError as e:
            if late.is_set():
                raise StreamError(f"split stream {self.address}: no frame from the server within "
                                  f"{limit:.0f} s") from None
            raise StreamError(f"split stream {self.address}: {e.code().name}: {e.details()}") from None
        finally:
            timer.cancel()
        return decode(frame)

    def close(self) -> None:
        self._out.put(None)
        try:
            if self.call is not None:
                self.call.cancel()
        finally:
            self.channel.close()
