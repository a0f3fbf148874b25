"""The server side of the split stream transport: :class:`StreamTransport`.

A :class:`split_layer.transport.Transport` (the split runtime and the algorithms do not
change): Flower messages start (and end) the nodes' sessions, and the per-iteration
exchanges travel over the gRPC streams of the round's :class:`split_layer.stream_server._Server`.
The protocol, end to end, is described in :mod:`split_layer.stream`.
"""
from __future__ import annotations

import queue
import time
from logging import INFO, WARNING

from flwr.app import Message
from flwr.common import log

from strategies.core.records import CONFIG_KEY, query
from .simulation import concurrency_error
from .stream_frames import (
    DEFAULT_MAX_FRAME,
    FRAME_MARGIN,
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
from strategies.core.byte_meter import array_bytes
from .stream_options import StreamOptions
from .stream_guard import FloodBans
from .stream_server import _Server
from .transport import Envelope, FlowerTransport, Transport, _fill, envelope_from_message

__all__ = ["StreamTransport", "SESSION_MAX_S"]

# A session (one Flower message) may span many rounds, but not Flower's message TTL (12 h in
# flwr 1.41: a reply after it is discarded): a session older than this is ended at a round
# boundary and the node gets a fresh one.
SESSION_MAX_S = 11 * 3600.0


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
        self.bans = FloodBans()               # outlives each round's server (stream_guard)

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
                        2 * max(array_bytes(e.arrays) for e in out.values()) + FRAME_MARGIN)
            self.server = _Server(self.opts, [], max_frame=bound, lifetime=SESSION_MAX_S,
                                  expected=max(nodes, len(out), len(self.live)), bans=self.bans)
        else:
            self.server = _Server(self.opts, [], max_frame=self.max_frame(list(out)),
                                  lifetime=self.opts.timeout * (iters + 2), expected=len(out), bans=self.bans)
        if not self.server.tls and self.opts.exposed:
            log(WARNING, "split stream: TLS is off (split-stream-tls='off', split-stream-allow-plaintext=true) with "
                "%s: the session tokens and every activation and gradient can cross the network to %s in the clear",
                self.opts.exposure, self.server.address)
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
                for i in (getattr(self.strategy, "directory", {}).get(n, {}) for n in nodes)]
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


