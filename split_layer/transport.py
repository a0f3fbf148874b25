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
from flwr.app import ConfigRecord, Context, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from strategies.core.records import CONFIG_KEY, METRICS_KEY, numpy_to_record, query, record_to_numpy

__all__ = ["Envelope", "Transport", "FlowerTransport", "LocalGrid", "envelope_from_message", "reply",
           "TENSORS_KEY", "ARRAYS_PREFIX", "SPLITCONFIG_KEY", "TRANSPORTS",
           "TRANSPORT_CHOICES"]

# the transports a split algorithm's exchanges can take (run-config key ``split-transport``):
# Flower messages (FlowerTransport) or the gRPC stream (split_layer.stream.StreamTransport)
TRANSPORTS = ("message", "stream")
# what the key accepts: a transport, or "auto" (split_layer.transport_choice.TransportChoice picks one per run)
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

    def __init__(self, strategy, grid) -> None:  # strategy: a split_layer.host.RoundHost
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

    ``push_messages`` gives each message an id and runs ``handler(msg, context)`` on it at once,
    with that node's persistent :class:`Context` (``node_config`` = partition-id/num-partitions,
    like the simulation engine). The handler sees the message as a SuperNode delivers it: the
    same content and metadata, with the message id the push returned (a new ``Message`` built
    with Flower's public ``Metadata``; the pushed message is not changed), so a reply built with
    ``Message(content, reply_to=msg)`` names it. An exception in a handler becomes an error reply
    (:meth:`error_reply`), worded as a Flower SuperNode words it. The grid holds only what is
    pending: the replies not yet pulled (and, threaded, the handler threads still running).
    ``node_ids``: the nodes' ids in partition order (default ``first_node_id + i``; random ids,
    as in Flower's simulation, test that nothing depends on their order). ``node_config``: extra
    node-config entries of every node (e.g. ``state-dir``).
    ``threaded=True`` runs each message's handler in its own thread (the stream transport
    needs every sampled node active at once, as Flower's runtimes provide).
    """

    #: its nodes run in this process: a simulation (:func:`strategies.core.simulation.simulated`)
    in_process = True

    def __init__(self, num_nodes: int, handler: Callable[[Message, Context], Message],
                 run_config: dict | None = None, first_node_id: int = 1001, threaded: bool = False,
                 node_ids: list[int] | None = None, node_config: dict | None = None) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        # the identity a ServerApp's process has (Message() reads it), set as Flower's runtime sets it
        for attr in ("run_id", "node_id", "task_id"):
            try:
                getattr(TaskIdentity, attr)
            except RuntimeError:
                setattr(TaskIdentity, attr, 1)
        self.handler = handler
        ids = list(node_ids) if node_ids is not None else [first_node_id + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes:
            raise ValueError(f"node_ids must be {num_nodes} distinct ids")
        # partition i goes to the i-th id, as Flower's simulation assigns them in creation order
        self.contexts = {
            nid: Context(run_id=1, node_id=nid,
                         node_config={**(node_config or {}), "partition-id": i, "num-partitions": num_nodes},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(ids)}
        self._replies: dict[str, Message] = {}
        self.threaded = threaded
        self._threads: list[threading.Thread] = []

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def push_messages(self, messages) -> list[str]:
        ids = []
        if self.threaded:
            self._threads = [t for t in self._threads if t.is_alive()]
        for m in messages:
            mid = str(uuid.uuid4())
            ids.append(mid)
            delivered = self.delivered(m, mid)
            node = m.metadata.dst_node_id
            if self.threaded:
                t = threading.Thread(target=self._handle, args=(mid, delivered, node), daemon=True)
                self._threads.append(t)
                t.start()
            else:
                self._handle(mid, delivered, node)
        return ids

    @staticmethod
    def delivered(msg: Message, message_id: str) -> Message:
        """``msg`` as its node receives it: the same content and metadata, with ``message_id``."""
        md = msg.metadata
        return Message(metadata=Metadata(
            run_id=md.run_id, message_id=message_id, src_node_id=md.src_node_id, dst_node_id=md.dst_node_id,
            reply_to_message_id=md.reply_to_message_id, group_id=md.group_id, created_at=md.created_at,
            ttl=md.ttl, message_type=md.message_type, src_task_id=md.src_task_id, dst_task_id=md.dst_task_id),
            content=msg.content)

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
        self._threads = [t for t in self._threads if t.is_alive()]

    def pull_messages(self, message_ids) -> list[Message]:
        """The replies that arrived among ``message_ids``; each is handed out once."""
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list[Message]:
        ids = self.push_messages(messages)
        time.sleep(0)
        return self.pull_messages(ids)
