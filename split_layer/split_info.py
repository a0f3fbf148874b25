"""A split node's one-time self-description: :class:`SplitInfoQuery` (``split-info``).

Its reply carries the node's partition id, ``num-partitions``, ``|D_k|`` and how many ClientApps
a simulation runs at once, noted in the strategy's node directory; a split node is never asked
``node-info`` as well. Its label histogram ``n_k`` (entry ``hist``, bytes ``histogram``) is asked
only by a strategy that uses it (``asks_histogram``: SCALA's priors, CS-SFL's class-balanced
selection): every other node keeps its label counts.

On a simulated system (run-config ``system``) a node's draws are keyed by its partition id
(:meth:`strategies.core.node_directory.NodeDirectory.key_of`), which the server learns from this
very reply: the query's bytes and work are billed once its replies are noted, in the same stage
(:class:`_HeldBills`), so a node first asked within a round is timed with its own draws.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .actions import SPLIT_INFO
from .transport import Envelope, Transport

__all__ = ["SplitInfoQuery", "HISTOGRAM_KEY"]

#: ``split-info`` config: the node adds its label histogram (``tensors["histogram"]``)
HISTOGRAM_KEY = "label-histogram"


class _HeldBills:
    """Stands in for the strategy's clock (:class:`strategies.core.clock.SimClock`) during the
    ``split-info`` exchange: holds the bills (``add_bytes``, ``add_work``, ``missing``) that name
    a node until the directory knows its partition id (:meth:`charge`); everything else is the
    clock's."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._bills: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)

    def add_bytes(self, node: int, direction: str, nbytes: int) -> None:
        self._bills.append(("add_bytes", (node, direction, nbytes)))

    def add_work(self, reply: Any) -> None:
        self._bills.append(("add_work", (reply,)))

    def missing(self, node: int) -> None:
        self._bills.append(("missing", (node,)))

    def charge(self) -> None:
        """The held bills, to the clock (each node keyed as the directory knows it now)."""
        for name, args in self._bills:
            getattr(self._clock, name)(*args)
        self._bills.clear()


class SplitInfoQuery:
    """Asks ``strategy``'s nodes ``split-info``, each at most once per round until it answered."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.asked: dict[int, int] = {}   # node -> the round it was last asked

    def fetch(self, transport: Transport, server_round: int, nodes: list[int]) -> None:
        """The query to the nodes of ``nodes`` not known yet; their replies go into the node
        directory (a node whose histogram, where asked, is not one count per class is dropped)."""
        s = self.strategy
        todo = [n for n in nodes if not s.directory.has_stats(n) and self.asked.get(n) != server_round]
        if not todo:
            return
        self.asked.update({n: server_round for n in todo})
        config = {HISTOGRAM_KEY: True} if s.asks_histogram else {}
        clock, held = s.clock, _HeldBills(s.clock)
        with clock.stage():   # one stage: the exchange, then its bills under the nodes' partition ids
            s.clock = held
            try:
                replies = s.payloads.exchange(transport, server_round, SPLIT_INFO,
                                              {n: Envelope(config=dict(config)) for n in todo})
            finally:
                s.clock = clock
            self.note(replies)
            held.charge()

    def note(self, replies: dict[int, Envelope]) -> None:
        """The replies into the node directory (a node whose histogram, where asked, is not one
        count per class is dropped)."""
        s = self.strategy
        classes = self.num_classes() if s.asks_histogram else 0
        for n, env in replies.items():
            stats: dict[str, Any] = {"n": int(env.config["num-examples"])}
            if s.asks_histogram:
                hist = np.asarray(env.tensors.get("histogram", np.zeros(0)), dtype=np.int64)
                if hist.shape != (classes,) or (hist < 0).any():
                    s.drop(n, f"bad label histogram of shape {hist.shape}")
                    continue
                stats["hist"] = hist
            stats.update({"sim-actors": int(env.config.get("sim-actors", 0)),
                          "sim-threads": int(env.config.get("sim-threads", 0))})
            s.directory.note(n, env.config["partition-id"], env.config.get("num-partitions", 0), **stats)

    def num_classes(self) -> int:
        s = self.strategy
        if s.env is not None:
            return s.env.num_classes
        # asked at the start, before the server's data is partitioned (strategies.core.partition_count)
        from tasks.env import load_bundle
        return load_bundle(s.task).num_classes
