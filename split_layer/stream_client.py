"""The ClientApp's end of the split stream: :class:`StreamClient`.

The node authenticates with the call metadata (:mod:`split_layer.stream_security`), trusts
exactly the certificate of the start message, and bounds each wait for a frame by twice
``split-stream-timeout`` (the server's own wait for the slowest node, then its answer);
keepalive pings detect a half-open connection.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import grpc
import numpy as np

from .stream_frames import _KEEPALIVE_CLIENT, METHOD, StreamError, _grpc_options, decode, encode
from .stream_security import NODE_HEADER, TLS_NAME, TOKEN_HEADER

__all__ = ["StreamClient"]


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
