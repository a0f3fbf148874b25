"""The transport between the split runtime and the nodes.

Algorithms and the runtime speak :class:`Envelope` s (named tensors, named state dicts,
a small config, reply metrics) through a :class:`Transport`: one call = one exchange
(one message to each addressed node, one reply back, failures dropped). A faster channel
(a gRPC stream, :mod:`split_layer.stream`) replaces :class:`FlowerTransport` without touching algorithms.

* :class:`FlowerTransport` -- Flower messages (``query.<action>`` messages),
  pushed and polled by :meth:`strategies.base.BaseStrategy.exchange` (fault handling:
  error replies and timeouts drop the node and land in the round's ``dropped``).
* :func:`envelope_from_message` / :func:`reply` -- the same encoding on the ClientApp side.
* :class:`LocalGrid` -- a Flower ``Grid`` look-alike that runs the ClientApp handler in
  this process (no Ray, no SuperLink): in-process runs (``flower_apps.papers``), the unit
  tests and ``bench/split_overhead.py`` (the same rounds without Flower's runtime).

Record layout of a split message (all optional):
``split-tensors`` (ArrayRecord: the streams), ``split-arrays.<name>`` (ArrayRecord: a named
state dict, e.g. ``bottom``), ``config`` (ConfigRecord, with ``server-round`` from the
base strategy plus the envelope's config), ``metrics`` (MetricRecord, replies).
"""
from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from .records import CONFIG_KEY, METRICS_KEY, numpy_to_record, query, record_to_numpy

__all__ = ["Envelope", "Transport", "FlowerTransport", "LocalGrid", "envelope_from_message", "reply",
           "TENSORS_KEY", "ARRAYS_PREFIX", "SPLITCONFIG_KEY", "TRANSPORTS",
           "TRANSPORT_CHOICES"]

# the transports a split algorithm's exchanges can take (run-config key ``split-transport``):
# Flower messages (FlowerTransport) or the gRPC stream (split_layer.stream.StreamTransport)
TRANSPORTS = ("message", "stream")
# what the key accepts: a transport, or "auto" (SplitRuntime.chosen_transport picks one per run)
TRANSPORT_CHOICES = (*TRANSPORTS, "auto")

TENSORS_KEY = "split-tensors"
ARRAYS_PREFIX = "split-arrays."
SPLITCONFIG_KEY = "split-config"   # reply-side config (strings etc.)


@dataclass
class Envelope:
    """One message's split payload, transport-independent."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """One call of :meth:`exchange` is one round trip to each addressed node."""

    @abstractmethod
    def exchange(self, server_round: int, op: str, out: dict[int, Envelope]) -> dict[int, Envelope]:
        """Deliver ``out[node]`` to each node (handler ``op``); return the replies that arrived.

        Nodes that fail (error reply, timeout) are absent from the result; the transport
        records them as dropped and logs why.
        """

    def end_round(self) -> None:
        """End of a round (also of a skipped one). Default: :meth:`close`; a transport whose
        sessions span rounds keeps them open until :meth:`close`."""
        self.close()

    def close(self) -> None:
        """End of the run, or of a failed round: release what the transport holds."""


def _fill(content: RecordDict, env: Envelope) -> RecordDict:
    if env.tensors:
        content[TENSORS_KEY] = numpy_to_record(env.tensors)
    for name, sd in env.arrays.items():
        content[ARRAYS_PREFIX + name] = numpy_to_record(sd)
    return content


def envelope_from_message(msg: Message) -> Envelope:
    """Decode a split message (either direction) into an :class:`Envelope`."""
    c = msg.content
    env = Envelope()
    if TENSORS_KEY in c.array_records:
        env.tensors = record_to_numpy(c.array_records[TENSORS_KEY])
    for k in c.array_records.keys():
        if k.startswith(ARRAYS_PREFIX):
            env.arrays[k[len(ARRAYS_PREFIX):]] = record_to_numpy(c.array_records[k])
    for key in (CONFIG_KEY, SPLITCONFIG_KEY):
        if key in c.config_records:
            env.config.update(dict(c.config_records[key]))
    if METRICS_KEY in c.metric_records:
        env.metrics = dict(c.metric_records[METRICS_KEY])
    return env


def reply(msg: Message, env: Envelope) -> Message:
    """The ClientApp's reply to ``msg`` carrying ``env``."""
    content = _fill(RecordDict(), env)
    if env.config:
        content[SPLITCONFIG_KEY] = ConfigRecord(env.config)
    if env.metrics:
        content[METRICS_KEY] = MetricRecord(env.metrics)
    return Message(content, reply_to=msg)


class FlowerTransport(Transport):
    """Flower messages through ``strategy.exchange`` (seeded, fault-tolerant push/poll)."""

    def __init__(self, strategy, grid) -> None:  # strategy: a split_layer.rounds.RoundHost
        self.strategy, self.grid = strategy, grid

    def exchange(self, server_round: int, op: str, out: dict[int, Envelope]) -> dict[int, Envelope]:
        msgs = []
        for node, env in out.items():
            content = _fill(self.strategy.base_content(server_round, action=op, **env.config), env)
            msgs.append(query(content, node, op, str(server_round)))
        replies = self.strategy.exchange(self.grid, msgs)
        return {r.metadata.src_node_id: envelope_from_message(r) for r in replies}


class LocalGrid:
    """A minimal in-process stand-in for Flower's ``Grid`` (in-process runs, tests, benchmarks).

    ``push_messages`` runs ``handler(msg, context)`` at once for each message with that
    node's persistent :class:`Context` (``node_config`` = partition-id/num-partitions,
    like the simulation engine). An exception in a handler becomes an error reply
    (:meth:`error_reply`), worded as a Flower SuperNode words it.
    ``sent`` keeps every pushed message (to inspect what the server sent; ``keep_sent=False``:
    none, so a long in-process run holds no message after its reply was pulled). ``node_ids``: the
    nodes' ids in partition order (default ``first_node_id + i``; random ids, as in Flower's
    simulation, test that nothing depends on their order). ``node_config``: extra node-config
    entries of every node (e.g. ``state-dir``).
    ``threaded=True`` runs each message's handler in its own thread (the stream transport
    needs every sampled node active at once, as Flower's runtimes provide).
    """

    def __init__(self, num_nodes: int, handler: Callable[[Message, Context], Message],
                 run_config: dict | None = None, first_node_id: int = 1001, threaded: bool = False,
                 node_ids: list[int] | None = None, node_config: dict | None = None,
                 keep_sent: bool = True) -> None:
        from flwr.app import RecordDict as _RD
        from flwr.supercore.task_identity import TaskIdentity

        for attr, val in (("run_id", 1), ("node_id", 1), ("task_id", 1)):
            try:
                getattr(TaskIdentity, attr)
            except RuntimeError:
                setattr(TaskIdentity, attr, val)
        self.handler = handler
        ids = list(node_ids) if node_ids is not None else [first_node_id + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes:
            raise ValueError(f"node_ids must be {num_nodes} distinct ids")
        # partition i goes to the i-th id, as Flower's simulation assigns them in creation order
        self.contexts = {
            nid: Context(run_id=1, node_id=nid,
                         node_config={**(node_config or {}), "partition-id": i, "num-partitions": num_nodes},
                         state=_RD(), run_config=dict(run_config or {}))
            for i, nid in enumerate(ids)}
        self.sent: list[Message] = []
        self.keep_sent = keep_sent
        self._replies: dict[str, Message] = {}
        self.pushed = 0
        self.threaded = threaded
        self._threads: list[threading.Thread] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def push_messages(self, messages) -> list[str]:
        ids = []
        for m in messages:
            mid = str(uuid.uuid4())
            m.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            self.pushed += 1
            if self.keep_sent:
                self.sent.append(m)
            node = m.metadata.dst_node_id
            if self.threaded:
                t = threading.Thread(target=self._handle, args=(mid, m, node), daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._handle(mid, m, node)
        return ids

    def _handle(self, mid: str, m: Message, node: int) -> None:
        try:
            r = self.handler(m, self.contexts[node])
        except Exception as e:  # noqa: BLE001 - mirrors Flower's error reply
            r = self.error_reply(m, e)
        self._replies[mid] = r

    def error_reply(self, msg: Message, exc: Exception) -> Message:
        """The error reply to ``msg`` whose handler raised ``exc``, worded as a Flower SuperNode
        words it (``<class 'T'>:<'message'>``, code ``CLIENT_APP_RAISED_EXCEPTION``)."""
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc)}:<'{exc}'>"),
                       reply_to=msg)

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the handler threads (threaded mode)."""
        for t in self._threads:
            t.join(timeout)

    def pull_messages(self, message_ids) -> list[Message]:
        out = [self._replies.pop(i) for i in list(message_ids) if i in self._replies]
        return out

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        ids = self.push_messages(messages)
        time.sleep(0)
        return self.pull_messages(ids)
