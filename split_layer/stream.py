"""A low-latency channel for split exchanges: one gRPC bidirectional stream per node and round.

Each Flower message waits on the polling of Flower's LinkState and, in a deployment, on a new
ClientApp process (the figures, with their commands: ``docs/benchmarks.md``, "Split-learning
overhead per exchange"). With
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

Security (threat model and tests in ``docs/bad-input.md``): the secret is 256
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
``auto`` (default) encrypts unless both the bound host and the address the clients dial
(``split-stream-advertise``, else the host) are loopback addresses, ``on`` always, ``off`` never. The server makes a
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

Modules (this one re-exports their public names, so ``from split_layer.stream import ...``
keeps working):

* :mod:`split_layer.stream_frames` -- the wire: :func:`encode`/:func:`decode`, frame bounds
  (:func:`max_frame_bytes`), state dicts and configs in frames, the call's method, the start
  message's keys (:data:`STREAM_KEYS`), gRPC channel options; :class:`StreamError`,
  :class:`StreamConfigError`.
* :mod:`split_layer.stream_security` -- the call metadata that authenticates a node, the
  round's self-signed TLS certificate, what counts as a loopback address.
* :mod:`split_layer.stream_options` -- :class:`StreamOptions`, the one statement of the
  ``split-stream-*`` run-config keys (defaults, allowed values, help, cross-key rules).
* :mod:`split_layer.stream_server` -- the gRPC server (sessions, authentication interceptor,
  refusals); :mod:`split_layer.stream_guard` -- its connection budget.
* :mod:`split_layer.stream_transport` -- :class:`StreamTransport`, the server-side transport.
* :mod:`split_layer.stream_client` -- :class:`StreamClient`, the ClientApp's end.
* :mod:`split_layer.simulation` -- :func:`simulation_concurrency`, :func:`concurrency_error`
  (and :func:`split_layer.simulation.in_simulation`).
"""
from __future__ import annotations

from .simulation import concurrency_error, simulation_concurrency
from .stream_client import StreamClient
from .stream_frames import (
    DEFAULT_MAX_FRAME,
    FRAME_MARGIN,
    MAGIC,
    METHOD,
    STREAM_KEYS,
    StreamConfigError,
    StreamError,
    config_from_json,
    config_to_json,
    decode,
    encode,
    max_frame_bytes,
    metrics_from_json,
    pack_arrays,
    unpack_arrays,
)
from .stream_options import SESSION_MODES, TLS_MODES, StreamOptions
from .stream_security import NODE_HEADER, TLS_NAME, TOKEN_HEADER, ephemeral_certificate
from .stream_transport import SESSION_MAX_S, StreamTransport
from .transport import TRANSPORTS

__all__ = ["StreamOptions", "StreamTransport", "StreamClient", "StreamError", "StreamConfigError",
           "encode", "decode", "simulation_concurrency", "concurrency_error", "max_frame_bytes", "pack_arrays",
           "unpack_arrays", "config_to_json", "config_from_json", "metrics_from_json",
           "ephemeral_certificate", "TRANSPORTS", "TLS_MODES", "SESSION_MODES", "STREAM_KEYS", "METHOD", "MAGIC",
           "NODE_HEADER", "TOKEN_HEADER", "TLS_NAME", "FRAME_MARGIN", "DEFAULT_MAX_FRAME", "SESSION_MAX_S"]
