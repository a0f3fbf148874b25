"""The ServerApp's end of the split stream: a gRPC server with one bidirectional-stream method.

Security (threat model and tests in ``docs/bad-input.md``): a server interceptor
checks each call's node and token (:mod:`split_layer.stream_security`) before any handler
runs or any frame is read: an unauthenticated call is refused at once (``UNAUTHENTICATED``,
reason logged), so it never holds a worker thread or waits on the network, and no
concurrency limit that a genuine node could run into exists for it to fill
(``maximum_concurrent_rpcs`` is not used). Each node has one stream per session (a second
one is refused); the server accepts only its sessions' nodes and tokens. Every message is
bounded by the largest frame the round can legitimately carry (``max_frame``), so gRPC
rejects an oversized message before buffering it; the first frame has a deadline (60 s after
the call starts, plus the time to send the largest frame at 1 Mbit/s, at most the timeout);
idle connections are closed (handshake timeout, idle timeout, keepalive pings both ways).
The connection budget and the refusal accounting are :mod:`split_layer.stream_guard`'s.
"""
from __future__ import annotations

import hmac
import queue
import secrets
import threading
import time
from concurrent import futures
from logging import WARNING
from typing import Any, Iterator

import grpc
from flwr.common import log

from .stream_frames import (
    _KEEPALIVE_SERVER,
    DEFAULT_MAX_FRAME,
    METHOD,
    StreamConfigError,
    StreamError,
    _grpc_options,
    decode,
)
from .stream_guard import (FD_RESERVE, FD_SHARE, MIN_CAP, UNAUTH_TOTAL, ConnectionGuard, FloodBans, RefusalLog,
                           descriptor_room)
from .stream_options import StreamOptions
from .stream_security import NODE_HEADER, TOKEN_HEADER, ephemeral_certificate

__all__: list[str] = []   # the server is the stream transport's own (split_layer.stream_transport)

FIRST_FRAME_S = 60.0              # the first frame's deadline after the call starts (at most the timeout),
FIRST_FRAME_RATE = 128 * 1024     # ... plus the time to send the largest frame at 1 Mbit/s
MAX_STREAMS_PER_CONNECTION = 4    # a genuine client uses one stream per connection
TARPIT_S = 1.0                    # a banned address's refused call is held at most this long
TARPIT_CALLS = 16                 # ... and at most this many at once
BIND_RETRY_S = 5.0                # a fixed port still held is retried this long
STOP_WAIT_S = 10.0                # a stopping server is waited for this long (its port is then free)


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
    legitimately last (the certificate's validity, plus an hour); ``bans``: the run's
    :class:`split_layer.stream_guard.FloodBans` (a new one when not given).
    """

    def __init__(self, opts: StreamOptions, nodes: list[int], max_frame: int = DEFAULT_MAX_FRAME,
                 lifetime: float = 86_400.0, expected: int = 0, bans: FloodBans | None = None) -> None:
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
        # checked against the process's limit: at most FD_SHARE of those left, at least
        # FD_RESERVE kept for the ServerApp's own files.
        expected = max(int(expected), len(nodes), 1)
        self.session_room = expected + max(expected, 8)
        want = max(self.session_room + UNAUTH_TOTAL, MIN_CAP)
        room = descriptor_room(want + 16) - 16   # (16: gRPC's own listener and pollers)
        if room < expected + 8:
            raise StreamConfigError(
                f"split stream: this process may give only {max(room, 0)} more files to connections (ulimit -n, "
                f"keeping {1 - FD_SHARE:.0%} of those left, at least {FD_RESERVE}, for the run's own files), too few "
                f"for one connection per node ({expected} expected) plus a margin; raise the ServerApp's descriptor "
                f"limit (`ulimit -n {2 * self.session_room + UNAUTH_TOTAL + 256}` before starting it) or sample "
                f"fewer nodes")
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
        self.guard = ConnectionGuard(port, self.refusals, bans=bans)
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
            # a banned address's refused call is held until the guard cuts its connection (within
            # FAST_SWEEP_S; at most TARPIT_S), so that it cannot make the next one at once: every
            # call then costs the flooder a new connection and a wait. At most TARPIT_CALLS are
            # held at once, so the workers genuine sessions need stay free.
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
